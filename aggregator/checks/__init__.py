"""Cross-rank checks: small self-registering units, one file each in this package.

A check subclasses :class:`Check`, sets ``name``, ``description``, ``severity`` and ``default``
(on or off), and is registered with :func:`register`. Adding a check is adding one file here: the
package imports every module in it. A check reacts to any of four events, all delivered by the
aggregator's single writer thread:

    on_steps(job, views)           steps every rank reported (or that waited long enough), in
                                   step order, as :class:`~..steps.StepView` objects, every rank's
                                   record: released by the job's step table (:mod:`..steps`)
    on_heartbeat(job, rank, hb)    every heartbeat
    on_round(job, result)          a reconciled probed step (:class:`~..reconcile.RoundResult`)
    on_tick(job, now)              about every 0.1 s (longer when ticking takes over 25 ms: jobs of
                                   thousands of ranks), ``now`` from the aggregator's monotonic clock

and returns ``None`` (nothing to say this time) or an :class:`Evaluation`: an :class:`Outcome`
(healthy, finding, not enough data) and the findings now active. ``on_steps`` may return a list of
evaluations instead, in step order: the steps of one release can raise and resolve a finding (a
one-step spike, a gradient perturbed once), and each evaluation is recorded in turn, so neither is
lost. The runner (:mod:`..runner`) turns changes of
the active set into events — *raised* when a finding's key (rank, layer) appears, *resolved* when
it goes — written to the event log, counted, and exported. A check that raises is counted in
``gradwatch_check_errors_total{check}``, logged once, and never takes the aggregator down.

Thresholds. A check declares its own in a nested ``class Thresholds(Check.Thresholds)`` (pydantic
fields with default, bounds and description) and reads thresholds another check declares only by
naming them in ``uses``; thresholds every per-layer check shares are :class:`Common`. The
aggregate :class:`Thresholds` model (the aggregator's ``checks`` setting: CLI ``--checks.NAME``,
env ``GRADWATCH_AGGREGATOR_CHECKS__NAME``) is built from the registry by
:func:`thresholds_model`, so a threshold name is one flat, global name and must be unique across
checks. Each check is given the aggregate instance as ``self.t``.

Overload and knock-on. A check that judges silence (``judges_silence``: a rank or a step it did
not hear of) is not given ``on_tick`` for a job while the aggregator's intake drops that job's
frames, and a new finding of a check naming its causes in ``knock_on_of`` is folded into its
cause's finding: the runner does both (:mod:`..runner` says how).

What a check reads. Every event's ``job`` is the job's read-only view (:class:`.view.JobView`:
its label, world, ranks and schemas, the ranks' fields as columns, where a rank sits in the model,
a step's gradient norms lined up), never the aggregator's mutable job state. What a check keeps
per job it keeps through :meth:`Check.state` (one object per job, made from :attr:`Check.per_job`
or :meth:`Check.new_state` on first use, dropped by :meth:`Check.forget`).

Dashboards. ``dashboard`` names the Grafana dashboard that shows the check's status
(:data:`DASHBOARDS`); the generator takes its check lists from the registry.
"""

from __future__ import annotations

import enum
import importlib
import logging
import pkgutil
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo

log = logging.getLogger("gradwatch.aggregator")


class Outcome(str, enum.Enum):
    HEALTHY = "healthy"
    FINDING = "finding"
    NO_DATA = "no_data"


@dataclass(frozen=True)
class Finding:
    """One problem a check found.

    Attributes:
        check: the check's name.
        job: job id.
        step: optimizer step it refers to (-1 when not tied to a step).
        summary: one line for people, values included.
        rank: the rank it names, if any.
        layer: the layer (module path) it names, if any.
        details: everything else, for the event log and /api/findings (JSON-serialisable).
    """

    check: str
    job: str
    step: int
    summary: str
    rank: Optional[int] = None
    layer: Optional[str] = None
    details: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.rank, self.layer)


@dataclass(frozen=True)
class Evaluation:
    outcome: Outcome
    findings: tuple[Finding, ...] = ()

    @staticmethod
    def healthy() -> "Evaluation":
        return Evaluation(Outcome.HEALTHY)

    @staticmethod
    def no_data() -> "Evaluation":
        return Evaluation(Outcome.NO_DATA)

    @staticmethod
    def found(*findings: Finding) -> "Evaluation":
        return Evaluation(Outcome.FINDING, tuple(findings)) if findings else Evaluation(Outcome.HEALTHY)


#: Grafana dashboards a check's status is shown on (``Check.dashboard``); see grafana/generate.py
DASHBOARDS = ("gradient_flow", "consistency", "rank_health")

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class Common(BaseModel):
    """Thresholds that are not one check's own: shared by every check that names layers, or read by
    the runner for every check (``json_schema_extra["scope"]`` says which, for the catalog)."""

    model_config = _FROZEN

    max_layers: int = Field(5, ge=1, le=100, description="Most layers a check names at once (the worst ones), to bound series.")
    knock_on_window_s: float = Field(
        60.0, ge=0, le=3600, json_schema_extra={"scope": "the runner (`knock_on_of`)"},
        description="Seconds after a finding resolves within which a new finding of a check it explains (knock_on_of: "
                    "training_stalled after rank_silent, replica_drift after grad_agreement) is folded into it as "
                    "a knock-on instead of raised (while it is active, always); 0: only while it is active.")


class Check:
    """Base class; see the module docstring."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    severity: ClassVar[str] = "warning"  # critical | warning | info
    default: ClassVar[bool] = True
    #: value series the check exports: short name -> (help, label names after job_id, unit)
    metrics: ClassVar[dict[str, tuple[str, tuple[str, ...], str]]] = {}
    #: Grafana dashboard showing the check's status, one of :data:`DASHBOARDS`
    dashboard: ClassVar[str] = ""
    #: thresholds this check reads that another check declares (their names)
    uses: ClassVar[tuple[str, ...]] = ()
    #: the check names ranks for what the aggregator did not hear: the runner skips its
    #: ``on_tick`` while the job is overloaded (:mod:`..runner`)
    judges_silence: ClassVar[bool] = False
    #: the checks whose finding (active, or resolved within ``knock_on_window_s``) in the same job
    #: explains a new finding of this one: the runner folds it into theirs instead of raising it
    #: (:mod:`..runner`); registered check names, validated by check_knock_ons
    knock_on_of: ClassVar[tuple[str, ...]] = ()
    #: what the check keeps per job: a class made with no argument on the job's first
    #: :meth:`state` (a check whose state needs its thresholds overrides :meth:`new_state`); None:
    #: nothing kept
    per_job: ClassVar[Optional[type]] = None

    class Thresholds(BaseModel):
        """The check's own thresholds: a subclass declares them as pydantic fields (default, bounds,
        description). Names are global (``--checks.NAME``), unique across checks."""

        model_config = _FROZEN

    def __init__(self, t: BaseModel):
        """``t``: the aggregate :class:`Thresholds` (or any model with the fields this check reads)."""
        self.t = t
        self._states: dict[str, Any] = {}

    # --- what the check keeps per job ------------------------------------------------------------

    def new_state(self) -> Any:
        """A fresh state for one job: :attr:`per_job`'s."""
        return self.per_job()

    def state(self, job_id: str) -> Any:
        """This check's state of job ``job_id``, made by :meth:`new_state` on first use."""
        st = self._states.get(job_id)
        if st is None:
            st = self._states[job_id] = self.new_state()
        return st

    def kept(self, job_id: str) -> Any:
        """This check's state of job ``job_id`` if it has one, else None (never made here: what
        :meth:`values` reads)."""
        return self._states.get(job_id)

    def reset(self, job_id: str) -> Any:
        """A fresh state of job ``job_id`` in place of the one kept; returns it."""
        st = self._states[job_id] = self.new_state()
        return st

    def on_steps(self, job, views) -> "Optional[Evaluation | list[Evaluation]]":
        return None

    def on_heartbeat(self, job, rank, heartbeat) -> Optional[Evaluation]:
        return None

    def on_round(self, job, result) -> Optional[Evaluation]:
        return None

    def on_tick(self, job, now: float) -> Optional[Evaluation]:
        return None

    def values(self, job_id: str) -> dict[str, dict[tuple, float]]:
        """Current values of :attr:`metrics` for one job: short name -> {label values: value}."""
        return {}

    def forget(self, job_id: str) -> None:
        """Drop what the check keeps of job ``job_id`` (the job went, or restarted)."""
        self._states.pop(job_id, None)


def ranks_live(job, ranks) -> bool:
    """Every rank of ``ranks`` is still heard in ``job`` and has not said goodbye: what a round too
    small to judge (a burst of probes on one rank) needs before it leaves the findings naming them
    standing; a rank gone for good (forgotten, or closed while training goes on) would otherwise
    never be judged again, nor its finding resolve."""
    return all(k in job.ranks and not job.ranks[k].closing for k in ranks)


CHECKS: dict[str, type[Check]] = {}


def register(cls: type[Check]) -> type[Check]:
    """Class decorator adding a check to :data:`CHECKS`.

    Raises:
        ValueError: the name is empty or taken, ``dashboard`` is not one of :data:`DASHBOARDS`, or
            ``Thresholds`` is not a subclass of ``Check.Thresholds``.
    """
    if not cls.name or cls.name in CHECKS:
        raise ValueError(f"check {cls.__name__} needs a unique name, got {cls.name!r}")
    if cls.dashboard not in DASHBOARDS:
        raise ValueError(f"check {cls.name}: dashboard must be one of {', '.join(DASHBOARDS)}, got {cls.dashboard!r}")
    if not issubclass(cls.Thresholds, Check.Thresholds):
        raise ValueError(f"check {cls.name}: its Thresholds must subclass Check.Thresholds")
    CHECKS[cls.name] = cls
    return cls


def check_knock_ons(checks: Optional[dict[str, type[Check]]] = None) -> None:
    """Validate every ``knock_on_of`` of ``checks`` (default the registry) against the registry.

    Raises:
        ValueError: a check names an unregistered check, itself, or a check that is itself a
            knock-on of another (folds are one level deep); the message names the check.
    """
    checks = CHECKS if checks is None else checks
    for name, cls in checks.items():
        for cause in cls.knock_on_of:
            if cause not in CHECKS:
                raise ValueError(f"check {name}: knock_on_of names {cause!r}, not a registered check; "
                                 f"known: {', '.join(sorted(CHECKS))}")
            if cause == name:
                raise ValueError(f"check {name}: knock_on_of names the check itself")
            if CHECKS[cause].knock_on_of:
                raise ValueError(f"check {name}: knock_on_of names {cause!r}, itself a knock-on of "
                                 f"{', '.join(CHECKS[cause].knock_on_of)} (folds are one level deep)")


def _same(a: FieldInfo, b: FieldInfo) -> bool:
    return (a.annotation, a.default, a.description, a.metadata) == (b.annotation, b.default, b.description, b.metadata)


#: threshold name -> the check declaring it ("" for :class:`Common`), in the aggregate's order
OWNERS: dict[str, str] = {}


def thresholds_model(checks: Optional[dict[str, type[Check]]] = None) -> type[BaseModel]:
    """The aggregate thresholds model: :class:`Common`'s fields, then every check's own, in
    registration order (a field a check inherits from another's ``Thresholds`` counts once).
    Fills :data:`OWNERS` when built from the registry.

    Raises:
        ValueError: two checks declare the same threshold differently, or a check ``uses`` a
            threshold no check declares; the message names the checks.
    """
    checks = CHECKS if checks is None else checks
    fields: dict[str, tuple[Any, FieldInfo]] = {n: (f.annotation, f) for n, f in Common.model_fields.items()}
    owners = dict.fromkeys(fields, "")
    for cname, cls in checks.items():
        for fname, f in cls.Thresholds.model_fields.items():
            if fname not in fields:
                fields[fname], owners[fname] = (f.annotation, f), cname
            elif not _same(fields[fname][1], f):
                raise ValueError(f"check {cname} declares threshold {fname!r}, already declared by "
                                 f"{owners[fname] or 'Common'}; read it with uses = ({fname!r},)")
    for cname, cls in checks.items():
        missing = [u for u in cls.uses if u not in fields]
        if missing:
            raise ValueError(f"check {cname} uses thresholds no check declares: {', '.join(missing)}")
    common = [n for n in fields if not owners[n]]
    ordered = {n: fields[n] for n in [*[n for n in fields if owners[n]], *common]}
    model = create_model(
        "Thresholds", __base__=_AllThresholds, __module__=__name__,
        **ordered,  # type: ignore[call-overload]
    )
    if checks is CHECKS:
        OWNERS.clear()
        OWNERS.update({n: owners[n] for n in ordered})
    return model


class _AllThresholds(BaseModel):
    """Every check's thresholds, in one model built from the registry (:func:`thresholds_model`).
    CLI: ``--checks.NAME``; env: ``GRADWATCH_AGGREGATOR_CHECKS__NAME``."""

    model_config = _FROZEN


def load_all() -> dict[str, type[Check]]:
    """Import every module of this package, so each check registers itself."""
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{m.name}")
    return CHECKS


def resolve(enable: list[str], disable: list[str]) -> list[str]:
    """Names of the checks to run.

    Raises:
        ValueError: naming an unknown check.
    """
    load_all()
    for n in [*enable, *disable]:
        if n not in CHECKS:
            raise ValueError(f"unknown check {n!r}; known: {', '.join(sorted(CHECKS))}")
    return [n for n, c in CHECKS.items() if (c.default or n in enable) and n not in disable]



# every check registers itself on import; the aggregate model needs all of them
load_all()
check_knock_ons()
Thresholds = thresholds_model()
