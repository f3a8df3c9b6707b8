"""The terminal app of ``gradwatch top`` (textual): a status line, one panel per job (its global
gradient norm as a sparkline, a table of its ranks), and a table of findings.

Every ``refresh_s`` a worker thread reads the aggregator (:func:`.model.fetch`, so the terminal
never waits on the network) and hands the :class:`~.model.View` to the app's thread. A failed
read shows its reason on the status line, keeps the last view on screen and is retried at the
next refresh; the app never stops on it.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Optional

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Sparkline, Static

from . import model

RANK_COLUMNS = ("rank", "step", "step time", "grad norm", "local norm", "loss", "seen", "status")
FINDING_COLUMNS = ("state", "check", "severity", "job", "rank", "layer", "step", "raised", "resolved", "summary")
#: longest summary shown in the findings table, characters
SUMMARY_CHARS = 200
#: most rows of the findings table
MAX_FINDINGS = 200


def number(v: float) -> str:
    """A float in a few characters (``1.234``, ``5e+03``); ``-`` for NaN (no series)."""
    return "-" if math.isnan(v) else f"{v:.4g}"


def seconds(v: float) -> str:
    """A step time: ``85ms``, ``1.25s``; ``-`` for NaN."""
    if math.isnan(v):
        return "-"
    return f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s"


def fill(table: DataTable, rows: list[tuple[str, tuple]]) -> None:
    """Show ``rows``, ``(key, cells)`` in the order of the table's columns, in ``table``: cell by
    cell when it lists the same keys in the same order (its cursor and scroll stay where the user
    put them), else anew."""
    if [k.value for k in table.rows] == [k for k, _ in rows]:
        columns = list(table.columns)
        for key, cells in rows:
            for column, cell in zip(columns, cells):
                table.update_cell(key, column, cell, update_width=True)
        return
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)


def _status_style(word: str) -> str:
    head = word.split(" (was ", 1)[0]
    if head == "ok":
        return "green" if " (was " not in word else "yellow"
    if head == "finished":
        return "dim"
    if head == "silent":
        return "yellow"
    return "bold red"


class JobPanel(Vertical):
    """One job: a title line, its global gradient norm's sparkline, its ranks' table."""

    DEFAULT_CSS = """
    JobPanel { height: auto; border: round $primary; padding: 0 1; margin-bottom: 1; }
    JobPanel .title { height: auto; }
    JobPanel .spark { height: 1; }
    JobPanel .spark Sparkline { width: 1fr; }
    JobPanel .spark Static { width: auto; padding-left: 1; }
    JobPanel DataTable { height: auto; max-height: 24; }
    JobPanel .note { height: auto; color: $text-muted; }
    """

    def __init__(self, job_id: str):
        super().__init__()
        self.job_id = job_id
        self.border_title = f"job {job_id}"
        self.title = Static(classes="title")
        self.spark = Sparkline([], summary_function=max)
        self.spark_label = Static()
        self.ranks = DataTable(cursor_type="row", zebra_stripes=True)
        self.ranks.add_columns(*((c, c) for c in RANK_COLUMNS))
        self.note = Static(classes="note")

    def compose(self) -> ComposeResult:
        yield self.title
        with Horizontal(classes="spark"):
            yield self.spark
            yield self.spark_label
        yield self.ranks
        yield self.note

    def show(self, job: model.Job, history: model.NormHistory, now: float, silent_after_s: float, recent_s: float,
             max_ranks: int) -> None:
        state = "ended" if job.ended else "running"
        steps = "-" if job.steps is None else (
            str(job.steps[1]) if job.steps[0] == job.steps[1] else f"{job.steps[0]}..{job.steps[1]}")
        parts = [f"world {job.world}", f"reporting {job.reporting}", state, f"step {steps}"]
        if not math.isnan(job.step_age_s) and not job.ended:
            parts.append(f"last step {model.age(job.step_age_s)} ago")
        parts.append(f"probed {'-' if job.probe_step is None else job.probe_step}")
        if job.restarts:
            parts.append(f"restarts {job.restarts}")
        if job.active:
            parts.append("findings: " + ", ".join(c + (f" x{n}" if n > 1 else "") for c, n in job.active))
        self.title.update(Text("  ·  ".join(parts), style="bold red" if job.active else ""))

        self.spark.data = history.sparkline(self.job_id)
        pts = history.points(self.job_id)
        label = f"grad norm {number(job.grad_norm)}"
        finite = [v for _, v in pts if math.isfinite(v) and v > 0]
        if finite:
            label += f" (log scale: {number(min(finite))}..{number(max(finite))}, steps {pts[0][0]}..{pts[-1][0]})"
        self.spark_label.update(label)

        rows, hidden = model.rank_rows(job, now, silent_after_s, recent_s, max_ranks)
        fill(self.ranks, [(str(r.rank), (
            str(r.rank), "-" if r.step is None else str(r.step), seconds(r.step_s), number(r.grad_norm),
            number(r.local_grad_norm), number(r.loss), model.age(now - r.last_seen) if math.isfinite(r.last_seen) else "-",
            Text(word, style=_status_style(word)))) for r, word in rows])
        notes = []
        if hidden:
            notes.append(f"{hidden} more ranks not shown (--max-ranks {max_ranks})")
        if job.reporting > len(job.ranks):
            notes.append(f"{job.reporting - len(job.ranks)} reporting ranks have no per-rank series "
                         "(a job above the aggregator's --rank-series-max: only the ranks a finding names)")
        self.note.update("; ".join(notes))
        self.note.display = bool(notes)


class TopApp(App):
    """``gradwatch top``: a live view of one aggregator.

    Args:
        url: the aggregator's HTTP address (:func:`.model.base_url`).
        refresh_s: seconds between reads.
        recent_s: seconds a resolved finding stays listed.
        silent_after_s: seconds without a message after which a rank's status is ``silent``.
        max_ranks: most ranks listed per job.
        timeout_s: seconds each HTTP request may take.
    """

    TITLE = "gradwatch top"
    CSS = """
    #status { height: auto; padding: 0 1; background: $boost; }
    #status.error { background: $error 40%; }
    #jobs { height: 2fr; }
    #findings-title { height: 1; padding: 0 1; text-style: bold; }
    #findings { height: 1fr; }
    """
    # ctrl+c quits too, as it does top(1) (textual's own ctrl+c only says to press ctrl+q)
    BINDINGS = [("q", "quit", "Quit"), ("r", "poll", "Refresh now"), Binding("ctrl+c", "quit", show=False, priority=True)]

    def __init__(self, url: str, *, refresh_s: float = 1.0, recent_s: float = 600.0, silent_after_s: float = 2.5,
                 max_ranks: int = 32, timeout_s: float = 5.0, job: str = ""):
        super().__init__()
        self.url = model.base_url(url)
        self.job = job
        self.refresh_s, self.recent_s, self.silent_after_s = refresh_s, recent_s, silent_after_s
        self.max_ranks, self.timeout_s = max_ranks, timeout_s
        self.history = model.NormHistory()
        self.view: Optional[model.View] = None  # the latest one shown
        self.error: Optional[str] = None  # why the latest read failed, None after a good one
        self.updated_at: Optional[float] = None  # this host's clock at the latest good read
        self._panels: dict[str, JobPanel] = {}
        self._busy = threading.Lock()

    def compose(self) -> ComposeResult:
        yield Static(f"{self.url}: connecting ...", id="status")
        yield VerticalScroll(id="jobs")
        yield Static("Findings", id="findings-title")
        yield DataTable(id="findings", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#findings", DataTable).add_columns(*((c, c) for c in FINDING_COLUMNS))
        self.action_poll()
        self.set_interval(self.refresh_s, self.action_poll)

    # --- reading, on a worker thread ----------------------------------------------------------------

    def action_poll(self) -> None:
        """Read the aggregator on a worker thread, unless a read is still under way."""
        if self._busy.acquire(blocking=False):
            self.run_worker(self._read, thread=True, exit_on_error=False, group="read")

    def _read(self) -> None:
        try:
            v = model.view(model.fetch(self.url, self.timeout_s), self.recent_s, self.job)
        except model.FetchError as e:
            self._hand(self._failed, str(e))
        except Exception as e:  # a bug of ours reading what it got: said on the status line, retried
            self._hand(self._failed, f"cannot show {self.url}: {type(e).__name__}: {e}")
        else:
            self._hand(self._show, v)
        finally:
            self._busy.release()

    def _hand(self, fn, arg) -> None:
        try:
            self.call_from_thread(fn, arg)
        except RuntimeError:  # the app closed while the read was under way
            pass

    # --- showing, on the app's thread -----------------------------------------------------------------

    def _failed(self, reason: str) -> None:
        self.error = reason
        status = self.query_one("#status", Static)
        since = ""
        if self.updated_at is not None:
            since = f"; showing the view of {model.age(time.time() - self.updated_at)} ago"
        status.update(Text(f"{reason}; retrying every {self.refresh_s:g} s{since}", style="bold"))
        status.add_class("error")

    async def _show(self, v: model.View) -> None:
        self.view, self.error, self.updated_at = v, None, time.time()
        self.history.add(v.jobs)
        active = sum(f.active for f in v.findings)
        status = self.query_one("#status", Static)
        status.remove_class("error")
        status.update(
            f"{self.url}  ·  {len(v.jobs)} job{'s' if len(v.jobs) != 1 else ''}  ·  {active} active "
            f"finding{'s' if active != 1 else ''}, {len(v.findings) - active} resolved in the last "
            f"{model.age(self.recent_s)}  ·  updated {time.strftime('%H:%M:%S', time.localtime(self.updated_at))}, "
            f"every {self.refresh_s:g} s  ·  q quit, r refresh")
        await self._show_jobs(v)
        self._show_findings(v)

    async def _show_jobs(self, v: model.View) -> None:
        box = self.query_one("#jobs", VerticalScroll)
        ids = {j.job_id for j in v.jobs}
        for job_id in [k for k in self._panels if k not in ids]:
            self._panels.pop(job_id).remove()
        if not v.jobs:
            if not box.query("#no-jobs"):
                await box.mount(Static("No job reports to this aggregator yet.", id="no-jobs"))
            return
        for s in box.query("#no-jobs"):
            s.remove()
        for j in v.jobs:
            panel = self._panels.get(j.job_id)
            if panel is None:
                panel = self._panels[j.job_id] = JobPanel(j.job_id)
                await box.mount(panel)
            panel.show(j, self.history, v.now, self.silent_after_s, self.recent_s, self.max_ranks)

    def _show_findings(self, v: model.View) -> None:
        rows = []
        for f in v.findings[:MAX_FINDINGS]:
            state = Text("ACTIVE", style="bold red") if f.active else Text("resolved", style="green")
            raised = "?" if f.raised_at is None else model.age(v.now - f.raised_at) + " ago"
            resolved = "-" if f.active else ("?" if f.resolved_at is None else model.age(v.now - f.resolved_at) + " ago")
            summary = f.summary if len(f.summary) <= SUMMARY_CHARS else f.summary[: SUMMARY_CHARS - 3] + "..."
            rows.append((repr((*f.key, f.raised_at)), (
                state, f.check, f.severity, f.job_id, "-" if f.rank is None else str(f.rank), f.layer or "-", str(f.step),
                raised, resolved, summary)))
        fill(self.query_one("#findings", DataTable), rows)
