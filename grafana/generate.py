"""The five gradwatch dashboards as code: plain dicts in Grafana's classic dashboard JSON model.

``python -m gradwatch.grafana.generate`` (or ``gradwatch grafana generate``) writes
``grafana/dashboards/<uid>.json`` and the file-provisioning YAML under ``grafana/provisioning/``;
``--check`` only compares and exits 1 when a committed file differs from what this module builds
(tests/test_grafana_dashboards.py does the same). Edit this module, never the JSON.

Every dashboard has a stable ``uid`` (Grafana's URL ``/d/<uid>``), the template variables
``datasource`` (a Prometheus datasource), ``job_id`` (the training job: the aggregator's
``job_id`` label, since Prometheus keeps ``job`` for the scrape job) and, where panels are per
rank or per layer, ``rank`` and ``layer`` (multi-value, "All" by default). Findings the aggregator
posts to Grafana (``--grafana-url``) show as annotations tagged ``gradwatch`` and ``job:<job_id>``.
Threshold lines are the aggregator's default check thresholds (:class:`~gradwatch.aggregator.
checks.Thresholds`), the ones its findings, and the alerts built on them, use. Which checks a
dashboard's status panels show comes from the check registry (each check's ``dashboard``), so a new
check appears without editing this module.

Only metrics of the aggregator's catalog (``gradwatch.aggregator.exporter.METRICS``, counters with
``_total``, the decode-time summary) and Prometheus' own per-scrape series appear in queries.
The loss panel shows ``gradwatch_rank_loss``: what the script hands to ``Monitor.observe_loss``.
"""

from __future__ import annotations

import json
import sys
from importlib.resources import files as _package_files
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from gradwatch.aggregator.checks import CHECKS, Thresholds
from gradwatch.commands.errors import CommandError

# dashboards/ and provisioning/ are package data of gradwatch.grafana (grafana/ in a checkout)
ROOT = Path(str(_package_files("gradwatch.grafana")))
DASHBOARD_DIR = ROOT / "dashboards"
PROVISIONING_DIR = ROOT / "provisioning"

FOLDER_UID = "gradwatch"
FOLDER_TITLE = "gradwatch"
DATASOURCE_UID = "gradwatch-prometheus"
DATASOURCE_NAME = "gradwatch Prometheus"
TAG = "gradwatch"
SCHEMA_VERSION = 41  # classic dashboard model of Grafana 11.6 (vendored schema)

DS = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_DS = {"type": "grafana", "uid": "-- Grafana --"}
J = 'job_id="$job_id"'
JR = 'job_id="$job_id", rank=~"$rank"'
JL = 'job_id="$job_id", layer=~"$layer"'
# Grafana sets the first threshold step to -Infinity whatever it holds (validateFieldConfig);
# JSON has no -Infinity and the schema wants a number, so the base step carries this one.
BASE = -1e300


def checks_on(dashboard: str) -> list[str]:
    """Registered checks whose status the dashboard shows (``Check.dashboard``), sorted."""
    return sorted(n for n, c in CHECKS.items() if c.dashboard == dashboard)


def pattern(names: list[str]) -> str:
    """A PromQL regex matching exactly these check names."""
    return "|".join(names)


def _listing(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


# --- building blocks ---------------------------------------------------------------------------


def target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False, table: bool = False) -> dict:
    """A Prometheus query of a panel (prometheus ``dataquery``)."""
    t = {"datasource": DS, "refId": ref, "expr": expr, "editorMode": "code", "range": not instant, "instant": instant}
    if legend:
        t["legendFormat"] = legend
    if table:
        t["format"] = "table"
    return t


def thresholds(*steps: tuple[float, str], base: str = "green") -> dict:
    return {"mode": "absolute", "steps": [{"color": base, "value": BASE}] + [{"color": c, "value": v} for v, c in steps]}


def _legend(table: bool = False) -> dict:
    return {"displayMode": "table" if table else "list", "placement": "bottom" if not table else "right",
            "showLegend": True, "calcs": ["lastNotNull", "max"] if table else []}


_TOOLTIP = {"mode": "multi", "sort": "desc"}


def timeseries(title: str, description: str, targets: list[dict], *, unit: str = "short", w: int = 12, h: int = 8,
               lines: tuple = (), log: bool = False, minimum: float | None = None, maximum: float | None = None,
               bars: bool = False, no_value: str = "") -> dict:
    """A time series panel; ``lines`` are threshold lines ``(value, color)`` drawn dashed."""
    custom = {
        "drawStyle": "bars" if bars else "line", "lineWidth": 1, "fillOpacity": 60 if bars else 10,
        "showPoints": "never", "spanNulls": False,
        "scaleDistribution": {"type": "log", "log": 10} if log else {"type": "linear"},
        "thresholdsStyle": {"mode": "dashed" if lines else "off"},
    }
    defaults: dict = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}
    if lines:
        defaults["thresholds"] = thresholds(*lines, base="transparent")
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if no_value:
        defaults["noValue"] = no_value
    return _panel("timeseries", title, description, targets, w, h, {"defaults": defaults, "overrides": []},
                  {"legend": _legend(table=len(targets) > 1 or "{{" in targets[0].get("legendFormat", "")),
                   "tooltip": _TOOLTIP})


def stat(title: str, description: str, targets: list[dict], *, unit: str = "short", w: int = 4, h: int = 4,
         steps: tuple = (), no_value: str = "") -> dict:
    defaults: dict = {"unit": unit, "color": {"mode": "thresholds"}, "thresholds": thresholds(*steps)}
    if no_value:
        defaults["noValue"] = no_value
    return _panel("stat", title, description, targets, w, h, {"defaults": defaults, "overrides": []}, {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "value", "graphMode": "area", "justifyMode": "auto", "textMode": "auto",
        "orientation": "auto", "wideLayout": True, "showPercentChange": False,
    })


def state_timeline(title: str, description: str, targets: list[dict], mapping: dict[str, tuple[str, str]], *,
                   w: int = 24, h: int = 6) -> dict:
    """Values mapped to named, coloured states: ``{"0": ("healthy", "green"), ...}``."""
    defaults = {
        "custom": {"lineWidth": 0, "fillOpacity": 80},
        "color": {"mode": "thresholds"}, "thresholds": thresholds(),
        "mappings": [{"type": "value", "options": {
            v: {"text": text, "color": color, "index": i} for i, (v, (text, color)) in enumerate(mapping.items())}}],
    }
    return _panel("state-timeline", title, description, targets, w, h, {"defaults": defaults, "overrides": []}, {
        "showValue": "never", "rowHeight": 0.8, "mergeValues": True, "alignValue": "left",
        "legend": _legend(), "tooltip": {"mode": "single", "sort": "none"},
    })


def barchart(title: str, description: str, targets: list[dict], *, x: str, unit: str = "short", w: int = 12,
             h: int = 10, log: bool = False, drop: tuple[str, ...] = ()) -> dict:
    """Bars of an instant table query, one per value of label ``x``; ``drop`` hides label columns."""
    custom = {"fillOpacity": 80, "lineWidth": 1, "gradientMode": "none",
              "scaleDistribution": {"type": "log", "log": 10} if log else {"type": "linear"}}
    p = _panel("barchart", title, description, targets, w, h,
               {"defaults": {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}, "overrides": []}, {
        "xField": x, "orientation": "horizontal", "showValue": "never", "stacking": "none",
        "barWidth": 0.8, "groupWidth": 0.7, "xTickLabelRotation": 0, "xTickLabelSpacing": 0, "xTickLabelMaxLength": 40,
        "fullHighlight": False, "legend": _legend(), "tooltip": {"mode": "single", "sort": "none"},
    })
    p["transformations"] = [{"id": "organize", "options": {
        "excludeByName": {k: True for k in ("Time", "__name__", "job", "instance", *drop)}, "renameByName": {}}}]
    return p


def heatmap(title: str, description: str, targets: list[dict], *, unit: str = "short", w: int = 12, h: int = 10) -> dict:
    """Rows are the query's series (one per legend value), colour is the value, exponential scale."""
    return _panel("heatmap", title, description, targets, w, h,
                  {"defaults": {"unit": unit, "custom": {"scaleDistribution": {"type": "linear"}}}, "overrides": []}, {
        "calculate": False, "rowsFrame": {"layout": "auto"}, "cellGap": 1, "showValue": "never",
        "color": {"mode": "scheme", "scheme": "Oranges", "fill": "dark-orange", "scale": "exponential",
                  "exponent": 0.3, "steps": 64, "reverse": False},
        "yAxis": {"axisPlacement": "left", "reverse": False}, "cellValues": {"unit": unit},
        "legend": {"show": True}, "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
        "exemplars": {"color": "rgba(255,0,255,0.7)"}, "filterValues": {"le": 1e-12},
    })


def alert_list(title: str, description: str, *, w: int = 8, h: int = 9) -> dict:
    """Grafana's alert list: firing and pending alerts whose labels carry the selected job_id."""
    return _panel("alertlist", title, description, [], w, h, None, {
        "viewMode": "list", "groupMode": "default", "groupBy": [], "maxItems": 20, "sortOrder": 1,
        "dashboardAlerts": False, "alertName": "", "alertInstanceLabelFilter": '{job_id="$job_id"}',
        "stateFilter": {"firing": True, "pending": True, "noData": False, "normal": False, "error": True},
    })


def _panel(kind, title, description, targets, w, h, field_config, options) -> dict:
    p = {"type": kind, "title": title, "description": description, "gridPos": {"h": h, "w": w, "x": 0, "y": 0}}
    if targets:
        p["datasource"] = DS
        p["targets"] = targets
    if field_config is not None:
        p["fieldConfig"] = field_config
    p["options"] = options
    return p


def layout(panels: list[dict]) -> list[dict]:
    """Number the panels and place them left to right in rows of Grafana's 24 columns."""
    x = y = row_h = 0
    for i, p in enumerate(panels, 1):
        g = p["gridPos"]
        if x + g["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        g["x"], g["y"] = x, y
        x += g["w"]
        row_h = max(row_h, g["h"])
        p["id"] = i
    return panels


def variables(*names: str) -> list[dict]:
    """Template variables: always ``datasource`` and ``job_id``, then any of ``rank``, ``layer``."""
    q = {"type": "prometheus", "uid": "${datasource}"}
    out = [
        {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
         "current": {"text": DATASOURCE_NAME, "value": DATASOURCE_UID}, "hide": 0, "refresh": 1,
         "includeAll": False, "multi": False, "options": [], "regex": ""},
        {"type": "query", "name": "job_id", "label": "job", "datasource": q,
         "description": "Training job: the aggregator's job_id label (TORCHELASTIC_RUN_ID or GRADWATCH_JOB).",
         # a gauge every job has: above --rank-series-max, per-rank series exist only for named ranks
         "query": "label_values(gradwatch_job_world_size, job_id)", "refresh": 2, "sort": 1,
         "includeAll": False, "multi": False, "options": [], "regex": ""},
    ]
    picks = {
        "rank": ("rank", "label_values(gradwatch_rank_step{job_id=\"$job_id\"}, rank)", 3),
        "layer": ("layer", "label_values(gradwatch_layer_grad_norm{job_id=\"$job_id\"}, layer)", 1),
    }
    for n in names:
        label, query, sort = picks[n]
        out.append({"type": "query", "name": n, "label": label, "datasource": q, "query": query, "refresh": 2,
                    "sort": sort, "includeAll": True, "allValue": ".*", "multi": True, "options": [], "regex": "",
                    "current": {"text": ["All"], "value": ["$__all"], "selected": True}})
    return out


def annotations() -> dict:
    return {"list": [
        {"name": "Annotations & Alerts", "builtIn": 1, "datasource": GRAFANA_DS, "enable": True, "hide": True,
         "iconColor": "rgba(0, 211, 255, 1)", "type": "dashboard"},
        {"name": "gradwatch findings", "datasource": GRAFANA_DS, "enable": True, "hide": False, "iconColor": "red",
         "target": {"type": "tags", "tags": [TAG, "job:$job_id"], "matchAny": False, "limit": 200}},
    ]}


def dashboard(uid: str, title: str, description: str, panels: list[dict], *vars_: str) -> dict:
    return {
        "uid": uid, "title": f"gradwatch / {title}", "description": description, "tags": [TAG],
        "timezone": "browser", "editable": True, "graphTooltip": 1, "liveNow": False,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "schemaVersion": SCHEMA_VERSION,
        "links": [{"title": "gradwatch", "type": "dashboards", "icon": "external link", "tooltip": "", "url": "",
                   "tags": [TAG], "asDropdown": True, "targetBlank": False, "includeVars": True, "keepTime": True}],
        "templating": {"list": variables(*vars_)},
        "annotations": annotations(),
        "panels": layout(panels),
    }


def check_states(checks: str, w: int = 24, h: int = 6) -> dict:
    """One row per check: 0 healthy, 1 not enough data, 2 finding (from gradwatch_check_status)."""
    expr = (f'2 * gradwatch_check_status{{{J}, check=~"{checks}", status="finding"}}'
            f' + ignoring(status) gradwatch_check_status{{{J}, check=~"{checks}", status="no_data"}}')
    return state_timeline(
        "Check status", "Latest outcome of each check over time: healthy, not enough data, or an active finding. "
        "Findings are also annotations (red markers) when the aggregator posts to Grafana.",
        [target(expr, "{{check}}")],
        {"0": ("healthy", "green"), "1": ("no data", "text"), "2": ("finding", "red")}, w=w, h=h,
    )


# --- the dashboards ------------------------------------------------------------------------------


def overview(t: Thresholds) -> dict:
    return dashboard("gradwatch-overview", "Job overview", (
        "One training job at a glance, for on-call: ranks, progress, the global gradient norm against "
        "the alert thresholds, the gradient noise scale, firing alerts, and findings as annotations."
    ), [
        stat("Ranks reporting", "Ranks of the job the aggregator currently hears from; compare with the world size.",
             [target(f"gradwatch_job_ranks_reporting{{{J}}}")]),
        stat("World size", "World size the job's ranks report.", [target(f"gradwatch_job_world_size{{{J}}}")]),
        # job-level series first: above --rank-series-max ranks the per-rank ones cover named ranks only
        stat("Step", "Latest optimizer step of the most advanced rank.",
             [target(f'max(gradwatch_job_rank_step{{{J}, agg="max"}}) or max(gradwatch_rank_step{{{J}}})')]),
        stat("Steps per second", "Optimizer steps per second, averaged over ranks.",
             [target(f"sum(rate(gradwatch_job_steps_total{{{J}}}[$__rate_interval])) / sum(gradwatch_job_ranks_reporting{{{J}}})"
                     f" or avg(rate(gradwatch_rank_steps_total{{{J}}}[$__rate_interval]))")], unit="short"),
        stat("Checks with a finding", "Checks whose latest evaluation found a problem (see the check status below).",
             [target(f'sum(gradwatch_check_status{{{J}, status="finding"}})')], steps=((1, "red"),)),
        stat("Non-finite steps", "Steps in the time range whose gradient held NaN or Inf, summed over ranks.",
             [target(f"sum(increase(gradwatch_job_nonfinite_steps_total{{{J}}}[$__range]))"
                     f" or sum(increase(gradwatch_rank_nonfinite_steps_total{{{J}}}[$__range]))")], steps=((1, "red"),)),
        timeseries("Global gradient norm", (
            "L2 norm of all gradients after all-reduce (every rank holds the same one), before the optimizer "
            f"step; log scale. Dashed lines: vanish_below ({t.vanish_below:g}) and explode_above "
            f"({t.explode_above:g}); the spike threshold is spike_factor ({t.spike_factor:g}) times the rolling "
            "median of the norm: the aggregator's default thresholds, which its findings and alerts use."), [
                target(f"max(gradwatch_rank_grad_norm{{{J}}})", "global gradient norm", "A"),
                target(f"{t.spike_factor:g} * gradwatch_job_grad_norm_median{{{J}}}", "spike threshold", "B"),
            ], w=16, h=9, log=True, lines=((t.vanish_below, "orange"), (t.explode_above, "red"))),
        alert_list("Firing alerts", "Alerts firing or pending for this job (Prometheus rules over gradwatch's series)."),
        timeseries("Loss", (
            "Training loss per rank, as the script hands it to Monitor.observe_loss (mean over micro-steps of "
            "a step); each rank's own batch, so ranks differ. Empty when the script does not report it."),
            [target(f"gradwatch_rank_loss{{{J}}}", "rank {{rank}}")], w=12, h=8),
        timeseries("Gradient noise scale", (
            "Simple gradient noise scale B_simple = tr(S) / |G|^2 from the ranks' local and global gradient "
            "norms (McCandlish et al. 2018, appendix A): the batch size beyond which larger batches stop "
            "paying off."), [target(f"gradwatch_job_gradient_noise_scale{{{J}}}", "B_simple")], log=True),
        check_states(".*", w=12, h=8),
    ])


def gradient_flow(t: Thresholds) -> dict:
    agg = "agg=\"median\""
    return dashboard("gradwatch-gradient-flow", "Gradient flow", (
        "Per layer, for training teams: how the gradient norm is spread over the layers, how it evolves, "
        "dead units and non-finite values, at every probed step (medians or maxima over ranks)."
    ), [
        check_states(pattern(checks_on("gradient_flow"))),
        barchart("Gradient norm by layer (latest probed step)",
                 "L2 norm of each layer's parameter gradient after all-reduce, median over ranks; log scale. "
                 "Vanishing layers have the shortest bars, exploding ones the longest.",
                 [target(f"gradwatch_layer_grad_norm{{{JL}, {agg}}}", instant=True, table=True)],
                 x="layer", log=True, drop=("agg", "job_id")),
        heatmap("Gradient norm by layer over time",
                "Each row a layer, colour the L2 norm of its parameter gradient (median over ranks) at each probed step.",
                [target(f"gradwatch_layer_grad_norm{{{JL}, {agg}}}", "{{layer}}")]),
        timeseries("Gradient reaching each layer's output",
                   "L2 norm of the gradient arriving at each layer's output, local to a rank before all-reduce "
                   "(median over ranks); log scale. A collapse towards the input layers is vanishing gradients.",
                   [target(f"gradwatch_layer_output_grad_norm{{{JL}, {agg}}}", "{{layer}}")], log=True),
        timeseries("Weight norm by layer", "L2 norm of each layer's parameters after the optimizer step (median over ranks).",
                   [target(f"gradwatch_layer_weight_norm{{{JL}, {agg}}}", "{{layer}}")]),
        timeseries("Activation zero ratio by layer",
                   f"Fraction of each layer's output activations that are exactly zero, worst rank. Dashed line: "
                   f"dead_ratio ({t.dead_ratio:g}), above which an activation's units count as dead.",
                   [target(f'gradwatch_layer_activation_zero_ratio{{{JL}, agg="max"}}', "{{layer}}")],
                   unit="percentunit", minimum=0, maximum=1, lines=((t.dead_ratio, "red"),), w=24),
        timeseries("Non-finite activations by layer", "NaN/Inf elements in each layer's output activations, worst rank.",
                   [target(f'gradwatch_layer_activation_nonfinite{{{JL}, agg="max"}}', "{{layer}}")], w=8, minimum=0),
        timeseries("Non-finite output gradients by layer", "NaN/Inf elements in the gradient reaching each layer's output, worst rank.",
                   [target(f'gradwatch_layer_output_grad_nonfinite{{{JL}, agg="max"}}', "{{layer}}")], w=8, minimum=0),
        timeseries("Non-finite parameter gradients by layer", "NaN/Inf elements in each layer's parameter gradient, worst rank.",
                   [target(f'gradwatch_layer_grad_nonfinite{{{JL}, agg="max"}}', "{{layer}}")], w=8, minimum=0),
    ], "layer")


def consistency(t: Thresholds) -> dict:
    names = checks_on("consistency")
    c = f'check=~"{pattern(names)}"'
    return dashboard("gradwatch-consistency", "Cross-rank consistency", (
        "Do the replicas agree? Gradient fingerprints after all-reduce and weight fingerprints after the "
        "step must be equal bit for bit on every rank; a rank whose own statistics stand apart is an outlier."
    ), [
        check_states(pattern(names)),
        timeseries("Ranks named by consistency findings",
                   f"1 while an active finding of {_listing(names)} names the rank.",
                   [target(f"gradwatch_check_rank_flagged{{{JR}, {c}}}", "rank {{rank}}: {{check}}")],
                   bars=True, minimum=0, no_value="no rank named"),
        stat("Findings raised", "Findings each consistency check raised for this job since the aggregator started.",
             [target(f"sum by (check) (gradwatch_findings_total{{{J}, {c}}})", "{{check}}")],
             w=12, h=8, steps=((1, "red"),), no_value="0"),
        timeseries("Outlier score per rank", (
            "Largest robust z-score (median/MAD over ranks) of each rank's local gradient norm, activation "
            f"scale and non-finite count. Dashed line: outlier_z ({t.outlier_z:g})."),
            [target(f"gradwatch_rank_outlier_zscore{{{JR}}}", "rank {{rank}}")], lines=((t.outlier_z, "red"),), minimum=0),
        timeseries("Local gradient norm per rank",
                   "Each rank's own gradient norm before all-reduce: ranks see different samples, so these differ "
                   "by sampling noise only; one far from the others is fed different data or runs on a faulty device.",
                   [target(f"gradwatch_rank_local_grad_norm{{{JR}}}", "rank {{rank}}")], log=True),
        timeseries("Global gradient norm per rank",
                   "Gradient norm after all-reduce as each rank reports it: identical on every rank unless the "
                   "all-reduce or a communication hook is broken.",
                   [target(f"gradwatch_rank_grad_norm{{{JR}}}", "rank {{rank}}")], log=True),
        timeseries("Non-finite elements per rank", "NaN/Inf elements in each rank's activations, output gradients and "
                   "parameter gradients at the latest probed step.", [
                       target(f"gradwatch_rank_activation_nonfinite{{{JR}}}", "rank {{rank}} activations", "A"),
                       target(f"gradwatch_rank_output_grad_nonfinite{{{JR}}}", "rank {{rank}} output gradients", "B"),
                       target(f"gradwatch_rank_param_grad_nonfinite{{{JR}}}", "rank {{rank}} parameter gradients", "C"),
                   ], minimum=0),
    ], "rank")


def rank_health(t: Thresholds) -> dict:
    return dashboard("gradwatch-rank-health", "Rank health", (
        "Is every rank alive and keeping up? Step times, straggler scores, heartbeat age and step skew."
    ), [
        check_states(pattern(checks_on("rank_health"))),
        timeseries("Step time per rank", "Wall time of each rank's latest optimizer step (waiting in all-reduce included).",
                   [target(f"gradwatch_rank_step_seconds{{{JR}}}", "rank {{rank}}")], unit="s", minimum=0),
        timeseries("Straggler score per rank (relative)", (
            "Median over the latest straggler_windows windows' steps of the other ranks' median own time at "
            "the step (compute time less CPU wait) divided by this rank's, capped at 1: 1 is no slower than its "
            "typical peer. Dashed line: "
            "straggler_score "
            f"({t.straggler_score:g})."),
            [target(f"gradwatch_rank_straggler_relative_score{{{JR}}}", "rank {{rank}}")],
            unit="percentunit", minimum=0, maximum=1, lines=((t.straggler_score, "red"),)),
        timeseries("Straggler score per rank (individual)",
                   "The rank's best window median own time per step divided by its latest: below 1 when it got "
                   "slower than it used to be (all ranks together: the job got slower).",
                   [target(f"gradwatch_rank_straggler_individual_score{{{JR}}}", "rank {{rank}}")],
                   unit="percentunit", minimum=0, maximum=1),
        timeseries("CPU wait per rank", (
            "Share of each rank's compute time its training thread spent waiting for a CPU (Linux run-queue wait; "
            "median over its latest straggler_window steps): the host starving the rank, which straggler leaves "
            "out of its own time. High on one rank: another busy process shares its cores; on every rank: more "
            "busy threads than cores."),
            [target(f"gradwatch_rank_straggler_cpu_wait_ratio{{{JR}}}", "rank {{rank}}")],
            unit="percentunit", minimum=0, maximum=1),
        timeseries("Heartbeat age per rank", (
            "Seconds since the aggregator last heard from each rank (heartbeats come every second). Dashed "
            f"line: silent_after_s ({t.silent_after_s:g} s)."),
            [target(f"time() - gradwatch_rank_last_seen_timestamp_seconds{{{JR}}}", "rank {{rank}}")],
            unit="s", minimum=0, lines=((t.silent_after_s, "red"),)),
        timeseries("Step skew", (
            "Latest step of the most advanced live rank minus that of the least advanced. Dashed line: "
            f"skew_steps ({t.skew_steps})."), [target(f"gradwatch_job_step_skew{{{J}}}", "step skew")],
            w=8, minimum=0, lines=((t.skew_steps, "red"),)),
        timeseries("Step per rank", "Latest optimizer step each rank reported.",
                   [target(f"gradwatch_rank_step{{{JR}}}", "rank {{rank}}")], w=8),
        timeseries("Seconds since the last step", (
            "Seconds since any rank last completed a step. Dashed line: stall_after_s "
            f"({t.stall_after_s:g} s), the least a stall takes (stall_steps median step times when longer; "
            f"stall_outside_after_s, {t.stall_outside_after_s:g} s, when no rank waits in all-reduce)."), [target(f"gradwatch_job_step_age_seconds{{{J}}}", "since last step")],
            unit="s", w=8, minimum=0, lines=((t.stall_after_s, "red"),)),
    ], "rank")


def itself(t: Thresholds) -> dict:
    rate = "[$__rate_interval]"
    on_aggregator = "and on (job, instance) gradwatch_decode_seconds_count"  # gradwatch's scrape targets only
    return dashboard("gradwatch-self", "gradwatch itself", (
        "Is the monitoring healthy? Messages in, rejected and lost, agent drops, probed-step rounds, "
        "scrape and check durations."
    ), [
        timeseries("Messages received by kind", "Valid messages per second by kind (schema, report, heartbeat).",
                   [target(f"sum by (kind) (rate(gradwatch_messages_received_total{rate}))", "{{kind}}")], unit="reqps"),
        timeseries("Messages rejected by reason", "Malformed or oversized input per second, by reason; a peer's bytes "
                   "never stop the aggregator, they are counted here.",
                   [target(f"sum by (reason) (rate(gradwatch_messages_rejected_total{rate}))", "{{reason}}")],
                   unit="reqps", no_value="none rejected"),
        timeseries("Messages lost in flight per rank", "Gaps in each rank's sequence numbers, per second.",
                   [target(f"rate(gradwatch_rank_messages_lost_total{{{JR}}}{rate})", "rank {{rank}}")], unit="reqps", w=8),
        timeseries("Reports dropped by agents per rank", "Reports each rank's agent dropped (full queue or ZeroMQ "
                   "high-water mark), per second.",
                   [target(f"rate(gradwatch_agent_dropped_reports_total{{{JR}}}{rate})", "rank {{rank}}")],
                   unit="reqps", w=8),
        timeseries("Agent errors and restarts per rank", "Internal failures of each rank's agent and agent restarts "
                   "(a new boot id), per second.", [
                       target(f"rate(gradwatch_agent_errors_total{{{JR}}}{rate})", "rank {{rank}} errors", "A"),
                       target(f"rate(gradwatch_rank_restarts_total{{{JR}}}{rate})", "rank {{rank}} restarts", "B"),
                   ], unit="reqps", w=8),
        timeseries("Probed-step rounds by outcome", "Probed steps reconciled per second: complete (every rank "
                   "reported), partial (the ranks missing did not probe the step: their interval skips it, or a "
                   "burst on other ranks) or incomplete (a report due did not come in time).",
                   [target(f"sum by (outcome) (rate(gradwatch_rounds_total{{{J}}}{rate}))", "{{outcome}}")], unit="reqps"),
        stat("Round completion", "Share of the probed steps in the time range reconciled with every report due "
             "(complete or partial rounds; incomplete ones missed a rank's report).",
             [target(f'1 - sum(increase(gradwatch_rounds_total{{{J}, outcome="incomplete"}}[$__range])) / '
                     f"sum(increase(gradwatch_rounds_total{{{J}}}[$__range]))")],
             unit="percentunit", w=6, h=8, steps=((0.99, "green"),), no_value="no rounds"),
        stat("Check errors", "Exceptions raised inside checks in the time range (each is isolated and counted).",
             [target("sum(increase(gradwatch_check_errors_total[$__range])) or vector(0)")], w=6, h=8, steps=((1, "red"),)),
        timeseries("Scrape duration", "How long Prometheus takes to scrape each aggregator's /metrics.",
                   [target(f"scrape_duration_seconds {on_aggregator}", "{{instance}}")], unit="s", w=8),
        timeseries("Samples per scrape", "Series each aggregator exports per scrape (grows with ranks x layers).",
                   [target(f"scrape_samples_scraped {on_aggregator}", "{{instance}}")], w=8),
        timeseries("Check evaluation time", "Share of the aggregator's writer thread spent in each check.",
                   [target(f"sum by (check) (rate(gradwatch_check_seconds_total{rate}))", "{{check}}")],
                   unit="percentunit", w=8),
        timeseries("Decode time per message", "Average time to decode and apply one message.",
                   [target(f"sum(rate(gradwatch_decode_seconds_sum{rate})) / sum(rate(gradwatch_decode_seconds_count{rate}))",
                           "decode and apply")], unit="s", w=12),
        timeseries("Ranks reporting per job", "Ranks each job's aggregator hears from, against the world size.", [
            target("gradwatch_job_ranks_reporting", "{{job_id}} reporting", "A"),
            target("gradwatch_job_world_size", "{{job_id}} world size", "B"),
        ], w=12),
    ], "rank")


BUILDERS = (overview, gradient_flow, consistency, rank_health, itself)


def build(t: Thresholds | None = None) -> dict[str, dict]:
    """Every dashboard, by uid (in order: overview, gradient flow, consistency, rank health, itself)."""
    t = t or Thresholds()
    return {d["uid"]: d for d in (b(t) for b in BUILDERS)}


# --- files ---------------------------------------------------------------------------------------


def datasource_yaml() -> str:
    return f"""# Generated by `gradwatch grafana generate` (grafana/generate.py); do not edit.
# Grafana file provisioning: copy or mount into /etc/grafana/provisioning/datasources/.
apiVersion: 1
datasources:
  - name: {DATASOURCE_NAME}
    uid: {DATASOURCE_UID}
    type: prometheus
    access: proxy
    # Where Grafana's server reaches the Prometheus that scrapes the aggregator, from Grafana's
    # environment (e.g. GRADWATCH_PROMETHEUS_URL=http://prometheus:9090).
    url: ${{GRADWATCH_PROMETHEUS_URL}}
    isDefault: false
    editable: false
    jsonData:
      # the shipped scrape interval (deploy/prometheus/prometheus.yml): $__rate_interval is 4x
      # this, and a shorter one left the rate panels windows holding one sample, hence gaps
      timeInterval: 15s
"""


def dashboards_yaml(path: str = "/var/lib/grafana/dashboards/gradwatch") -> str:
    return f"""# Generated by `gradwatch grafana generate` (grafana/generate.py); do not edit.
# Grafana file provisioning: copy or mount into /etc/grafana/provisioning/dashboards/, and
# grafana/dashboards/*.json into {path}.
apiVersion: 1
providers:
  - name: gradwatch
    orgId: 1
    folder: {FOLDER_TITLE}
    folderUid: {FOLDER_UID}
    type: file
    disableDeletion: false
    allowUiUpdates: false
    updateIntervalSeconds: 30
    options:
      path: {path}
      foldersFromFilesStructure: false
"""


def render_json(d: dict) -> str:
    return json.dumps(d, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def files() -> dict[Path, str]:
    """Every generated file, path -> text."""
    out = {DASHBOARD_DIR / f"{uid}.json": render_json(d) for uid, d in build().items()}
    out[PROVISIONING_DIR / "datasources" / "gradwatch.yaml"] = datasource_yaml()
    out[PROVISIONING_DIR / "dashboards" / "gradwatch.yaml"] = dashboards_yaml()
    return out


def drift(root: Path = ROOT) -> list[str]:
    """Generated files under ``root`` (the package's grafana/ folder, or another holding the same
    layout) that are missing, differ, or (dashboards) should not be there."""
    want = {root / p.relative_to(ROOT): text for p, text in files().items()}
    bad = [str(p.relative_to(root)) for p, text in want.items() if not p.is_file() or p.read_text() != text]
    bad += [str(p.relative_to(root)) + " (not generated)" for p in sorted((root / "dashboards").glob("*.json")) if p not in want]
    return bad


class GenerateCommand(BaseModel):
    """Write grafana/dashboards/*.json and grafana/provisioning/ from the dashboards as code."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    check: bool = Field(False, description="Only compare: exit 1 naming the files that drifted, write nothing.")
    out: str = Field("", description="Directory to write dashboards/ and provisioning/ into. '' writes the package's "
                     "own grafana/ folder (in a checkout: regenerates the committed files; in an installed package: "
                     "its site-packages copy, which `grafana push` reads).")

    def cli_cmd(self) -> None:
        """Write (or compare) the files.

        Raises:
            CommandError: with ``check``, naming the generated files that drifted.
        """
        root = Path(self.out).resolve() if self.out else ROOT
        if self.check:
            bad = drift(root)
            if bad:
                raise CommandError(f"drifted under {root}: " + ", ".join(bad))
            return
        for p, text in files().items():
            dest = root / p.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
            print(f"wrote {dest}")  # absolute: the package's folder is not the working directory


def main(argv: list[str] | None = None) -> int:
    """``gradwatch grafana generate [--check]``; the exit status."""
    from gradwatch.commands.cli import main as gradwatch

    return gradwatch(["grafana", "generate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
