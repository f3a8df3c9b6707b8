"""gradwatch: monitoring for distributed PyTorch training.

Subpackages: :mod:`gradwatch.agent` (inside each rank, needs torch), :mod:`gradwatch.wire` (the
message format), :mod:`gradwatch.aggregator` (the daemon, runs without torch).
"""

__version__ = "0.1.0"
