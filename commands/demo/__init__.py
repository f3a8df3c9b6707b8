"""``gradwatch demo``: the main job. See :mod:`.run`."""


def main(argv=None) -> int:
    from .run import main as _main

    return _main(argv)
