"""``gradwatch top``: a live terminal view of a running aggregator, read from its HTTP API only.

:mod:`.model` reads the aggregator (/metrics, /api/findings) into a small typed model, pure
functions but one; :mod:`.app` is the terminal app (textual, the ``top`` extra). Importing this
package imports neither textual nor torch: :meth:`TopCommand.cli_cmd` takes textual when it runs.
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gradwatch.aggregator.checks.rank_silent import RankSilent
from gradwatch.aggregator.config import AggregatorConfig

from ..errors import CommandError
from .model import base_url

#: the aggregator's default HTTP address (its --metrics-host and --metrics-port defaults)
DEFAULT_URL = (f"http://{AggregatorConfig.model_fields['metrics_host'].default}:"
               f"{AggregatorConfig.model_fields['metrics_port'].default}")
#: textual missing: the one line ``gradwatch top`` says
NO_TEXTUAL = "needs textual, which is not installed: pip install 'gradwatch[top]'"


class TopCommand(BaseSettings):
    """gradwatch top: a running aggregator live in the terminal (jobs, ranks, findings); needs pip install 'gradwatch[top]'."""

    model_config = SettingsConfigDict(
        env_prefix="GRADWATCH_TOP_", extra="forbid", frozen=True, cli_kebab_case=True,
        cli_prog_name="gradwatch top", cli_implicit_flags=True,
    )

    url: str = Field(DEFAULT_URL, description="The aggregator's HTTP address, http://HOST:PORT (its --metrics-host and --metrics-port; a /metrics URL works too).")
    refresh_s: float = Field(1.0, ge=0.1, le=3600, description="Seconds between reads of the aggregator.")
    recent_minutes: float = Field(10.0, ge=0, description="Minutes a resolved finding stays listed (and a rank's status says it was named), so one raised and resolved between two refreshes is still seen.")
    silent_after_s: float = Field(
        RankSilent.Thresholds.model_fields["silent_after_s"].default, gt=0,
        description="Seconds without a message from a rank after which its status reads silent (default: the aggregator's rank_silent default).")
    job: str = Field("", description="Show only the jobs whose id matches this shell pattern (my-run, llama-*); '' for every job, those still training first.")
    max_ranks: int = Field(32, ge=1, description="Most ranks listed per job; beyond it the ranks not ok come first.")
    timeout_s: float = Field(5.0, gt=0, le=600, description="Seconds each HTTP request to the aggregator may take.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return base_url(v)

    def cli_cmd(self) -> None:
        """Run the view until q or ctrl+c.

        Raises:
            CommandError: textual is not installed (:data:`NO_TEXTUAL`).
        """
        try:
            import textual  # noqa: F401
        except ImportError:
            raise CommandError(NO_TEXTUAL) from None
        from .app import TopApp

        TopApp(self.url, refresh_s=self.refresh_s, recent_s=60 * self.recent_minutes,
               silent_after_s=self.silent_after_s, max_ranks=self.max_ranks, timeout_s=self.timeout_s, job=self.job).run()
