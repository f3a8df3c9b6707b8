"""The table of statistics (gradwatch/columns.py) is the one declaration of each per-layer and
per-parameter statistic: every row reaches the wire, /metrics of a real aggregator and the README
catalog, and a row added to the table reaches all three with no other change (but the agent's
on-device reducer, which these tests replace by hand-made wire arrays)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import requests
import zmq

from gradwatch import columns, wire
from gradwatch.columns import STATISTICS, Statistic

from .conftest import ROOT, free_port, loopback, samples, wait_for
from .fakejob import FakeJob, Model, kept
from .test_layout import imports, offenders

R = 3
#: two parameters per module: the merge into the module is exercised too
PARAMS = tuple((f"{m}.{p}", (4,), "float32") for m in ("emb", "fc1", "fc2") for p in ("weight", "bias"))
#: layers are not modules: a ReLU owns no parameter, so a per-module series read by layer index fails
SLOTS = (("emb", "", "Embedding", "float32"), ("fc1", "", "Linear", "float32"), ("act", "", "ReLU", "float32"),
         ("fc2", "", "Linear", "float32"), ("lstm", "[0]", "LSTM", "float32"))


def cell(array: str, rank: int, row: int, col: int) -> float:
    """A value unique to (array, rank, row, column), exact in float32, never NaN: every cell counts
    as observed, and a statistic read from a wrong column or row cannot match."""
    return 1000.0 * (list(columns.ARRAYS).index(array) + 1) + 100.0 * col + 10.0 * row + 0.25 * rank + 0.125


def arrays(rank: int) -> dict[str, np.ndarray]:
    n = {"slots": len(SLOTS), "params": len(PARAMS)}
    return {
        key: np.array([[cell(key, rank, i, c) for c in range(len(columns.fields(key)))] for i in range(n[a.rows])], np.float32)
        for key, a in columns.ARRAYS.items()
    }


def frames(job: str) -> list[bytes]:
    """Each rank's schema and its probed report of step 0 (:func:`arrays`), encoded."""
    sent: list = []
    ranks = FakeJob(kept(sent), job, R, Model(PARAMS, SLOTS), every=5, host="host", clock=lambda: 1.0,
                    boots=[f"b{r}" for r in range(R)])
    fp = np.zeros(len(PARAMS), np.uint64)
    for r in range(R):
        ranks.schema(r)
        ranks.report(r, 0, step_time=0.1, arrays=dict(probe=True, fp_grad=fp, fp_weight=fp, **arrays(r)))
    return [wire.encode(m) for m in sent]


def expected(stat: Statistic) -> dict[tuple[str, str], float]:
    """(layer, agg) -> value of ``gradwatch_layer_<stat>``, computed here with plain numpy."""
    a = columns.ARRAYS[stat.array]
    if a.rows == "slots":
        names = [m + o for m, o, _, _ in SLOTS]
        per_rank = np.array([[cell(stat.array, r, i, stat.column) for i in range(len(names))] for r in range(R)])
    else:  # two parameters per module, rows 2k and 2k+1, merged by the row's rule
        names = ["emb", "fc1", "fc2"]
        v = np.array([[cell(stat.array, r, i, stat.column) for i in range(len(PARAMS))] for r in range(R)]).reshape(R, 3, 2)
        per_rank = {"l2": np.sqrt((v**2).sum(-1)), "sum": v.sum(-1), "min": v.min(-1), "max": v.max(-1)}[stat.merge]
    funcs = {"min": np.min, "median": np.median, "max": np.max}
    return {(n, agg): float(funcs[agg](per_rank[:, i])) for i, n in enumerate(names) for agg in stat.aggs}


# --- the table itself ------------------------------------------------------------------------------


def test_the_table_is_foundation_and_imports_neither_torch_nor_numpy():
    path = ROOT / "gradwatch" / "columns.py"
    found = {"columns.py": imports(path.read_text(), "gradwatch")}
    assert offenders(found, ("torch", "numpy", "prometheus_client", "zmq", "msgpack", "gradwatch")) == {}
    run = subprocess.run(
        [sys.executable, "-c", "import sys, gradwatch.columns; print(sorted(n for n in sys.modules "
         "if n.split('.')[0] in ('torch', 'numpy', 'prometheus_client', 'zmq') or n.startswith(('gradwatch.agent', 'gradwatch.aggregator'))))"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def test_wire_columns_are_the_tables():
    assert wire.ACT_FIELDS == ("mean", "std", "min", "max", "zero_ratio", "nonfinite")
    assert wire.ACT_GRAD_FIELDS == ("norm", "nonfinite")
    assert wire.PARAM_FIELDS == ("grad_norm", "weight_norm", "grad_nonfinite")
    for s in STATISTICS:
        assert columns.fields(s.array)[s.column] == s.field
    for key in columns.ARRAYS:
        assert [s.column for s in columns.of(key)] == list(range(len(columns.of(key))))


def test_agent_record_fields_are_the_tables():
    pytest.importorskip("torch")
    from gradwatch.agent import stats

    assert stats.MOMENT_FIELDS == columns.records("act") == ("mean", "m2", "min", "max", "zeros", "nonfinite")


@pytest.mark.parametrize(
    "row, why",
    [
        (Statistic("x", array="nope", field="x", record="x", combine="sum", merge="sum", help="h"), "unknown array"),
        (Statistic("x", array="act", field="x", record="x", combine="nope", merge="sum", help="h"), "unknown rule"),
        (Statistic("x", array="act", field="x", record="x", combine="sum", merge="nope", help="h"), "unknown rule"),
        (Statistic("x", array="act", field="x", record="x", combine="sum", merge="sum", help="h", aggs=("mode",)), "aggregation"),
        (Statistic("x", array="act", field="x", record="x", combine="sum", merge="sum", help="h", observed_by="y"), "observed_by"),
        (Statistic("x", array="act", field="x", record="x", combine="pooled_std", merge="sum", help="h"), "pooled_std"),
        (Statistic("activation_mean", array="act_grad", field="y", record="y", combine="sum", merge="sum", help="h"), "duplicate"),
        (Statistic("y", array="act", field="mean", record="y", combine="sum", merge="sum", help="h"), "duplicate"),
    ],
)
def test_a_row_that_references_nothing_known_is_refused_at_import(row, why):
    base = STATISTICS if why == "duplicate" else ()
    with pytest.raises(ValueError, match=why):
        columns.declare(*base, row)


def test_host_combine_of_several_calls_follows_the_rules():
    """Two calls of one module: the exact pooled moments of the concatenated data."""
    pytest.importorskip("torch")
    from gradwatch.agent import combine
    a, b = np.array([0.0, 1.0, 2.0, 0.0]), np.array([5.0, np.inf, 0.0])

    def record(x):
        f = x[np.isfinite(x)]
        return [f.mean(), ((f - f.mean()) ** 2).sum(), x.min(), x.max(), (x == 0).sum(), (~np.isfinite(x)).sum()]

    got = combine.combine_calls("act", np.array([3, 2]), np.array([record(a[:3]), record(np.array([5.0, 0.0]))]))
    both = np.array([0.0, 1.0, 2.0, 5.0, 0.0])
    assert got == pytest.approx((both.mean(), both.std(), 0.0, 5.0, 2 / 5, 0.0))
    got = combine.combine_calls("act", np.array([4, 3]), np.array([record(a), record(b)]))
    assert got[2:4] == (0.0, np.inf) and got[4] == 3 / 7 and got[5] == 1.0
    empty = combine.combine_calls("act", np.array([0]), np.zeros((1, 6)))
    assert np.isnan(empty[:4]).all() and empty[4:] == (0.0, 0.0)
    with pytest.raises(ValueError):  # output gradients are combined by the agent's vectorised code
        combine.combine_calls("act_grad", np.array([1]), np.zeros((1, 2)))


# --- every row reaches the wire, /metrics and the README ----------------------------------------


@pytest.mark.parametrize("stat", STATISTICS, ids=lambda s: s.name)
def test_every_row_reaches_the_wire(stat):
    for r in range(R):
        rep = wire.decode(frames("wire")[2 * r + 1], schema_sizes=lambda h, d: (len(PARAMS), len(SLOTS)))
        got = getattr(rep, stat.array)[:, stat.column]
        assert got.tolist() == [cell(stat.array, r, i, stat.column) for i in range(len(got))]


@pytest.fixture(scope="module")
def scrape():
    """/metrics of a real in-process aggregator fed the frames over a real ZeroMQ socket, scraped over HTTP."""
    from gradwatch.aggregator import Aggregator

    agg = Aggregator(loopback(metrics_port=free_port(), proof_steps=0)).start()  # exported from its first frame
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(agg.endpoint)
    try:
        for f in frames("table"):
            sock.send(f)

        def complete():
            text = requests.get(agg.metrics_url, timeout=5).text
            return text if samples(text, "gradwatch_rounds_total").get((("job_id", "table"), ("outcome", "complete"))) == 1 else None

        yield wait_for(complete, 20, interval=0.05, what="the probed step reconciled")
    finally:
        sock.close()
        ctx.term()
        agg.stop()


@pytest.mark.parametrize("stat", STATISTICS, ids=lambda s: s.name)
def test_every_row_reaches_metrics(scrape, stat):
    from gradwatch.aggregator.exporter import METRICS

    name = f"gradwatch_layer_{stat.name}"
    got = {(d["layer"], d["agg"]): v for k, v in samples(scrape, name).items() if (d := dict(k))["job_id"] == "table"}
    assert got == expected(stat)
    d = METRICS[name]
    assert d.help.startswith(stat.help) and d.unit == stat.unit and d.labels == ("job_id", "layer", "agg")
    assert f"# HELP {name} {stat.help}" in scrape
    if stat.rank_total:
        totals = {dict(k)["rank"]: v for k, v in samples(scrape, "gradwatch_" + stat.rank_total[0]).items()}
        n = len(SLOTS) if columns.ARRAYS[stat.array].rows == "slots" else len(PARAMS)
        assert totals == {str(r): sum(cell(stat.array, r, i, stat.column) for i in range(n)) for r in range(R)}


@pytest.mark.parametrize("stat", STATISTICS, ids=lambda s: s.name)
def test_every_row_reaches_the_readme_catalog(stat):
    readme = (ROOT / "docs" / "catalog.md").read_text()
    metric_rows = [line for line in readme.splitlines() if line.startswith(f"| `gradwatch_layer_{stat.name}` |")]
    assert len(metric_rows) == 2, metric_rows  # the metrics table and the statistics table
    assert stat.help in metric_rows[0]
    row = metric_rows[1]
    for part in (f"`{stat.array}[{stat.column}]`", columns.CALL_RULES[stat.combine].doc,
                 columns.MERGE_RULES[stat.merge].doc, ", ".join(stat.aggs)):
        assert part in row, (part, row)


# --- adding a row is enough ----------------------------------------------------------------------


PLUMBING = {
    "wire": ROOT / "gradwatch" / "wire.py",
    "reconcile": ROOT / "aggregator" / "reconcile.py",
    "exporter": ROOT / "aggregator" / "exporter.py",
    "catalog": ROOT / "commands" / "catalog.py",
    "agent stats": ROOT / "agent" / "stats.py",
}


@pytest.mark.parametrize("name", PLUMBING)
def test_the_plumbing_names_no_statistic(name):
    """No string in the modules a statistic travels through names one (the checks may: they use
    statistics, they do not carry them)."""
    known = {s.name for s in STATISTICS} | {s.field for s in STATISTICS} | {s.record for s in STATISTICS}
    known -= {"min", "max"}  # also aggregation names
    # a report's own scalars (the global "grad_norm" of the sentinel) are no per-layer statistic
    import msgpack

    known -= set(msgpack.unpackb(wire.encode(wire.Report(wire.Header("j", 0, 1, "b", 0, 0.0), "h", 0, 0.1, 1.0, 0))))
    tree = ast.parse(PLUMBING[name].read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert strings & known == set()


ADD_A_ROW = """
import json
import numpy as np
import gradwatch.columns as st
from gradwatch.agent.combine import combine_calls

# the one change: a row (an activation's largest absolute value) appended to the table
st.STATISTICS = st.declare(*st.STATISTICS, st.Statistic(
    "activation_absmax", array="act", field="absmax", record="absmax", combine="max", merge="max",
    help="Largest absolute output activation of the layer.", observed_by="nonfinite"))

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from gradwatch import wire
from gradwatch.commands import catalog
from gradwatch.aggregator import Aggregator, load

out = {"fields": wire.ACT_FIELDS}
slots = (("blocks.0.fc", "", "Linear", "float32"), ("blocks.1.fc", "", "Linear", "float32"))
params = (("blocks.0.fc.weight", (2,), "float32"),)
for depth in (0, 1):
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", layer_depth=depth, proof_steps=0), clock=lambda: 0.0)
    for r in range(2):
        sch = wire.Schema(wire.Header("j", r, 2, "b", 0, 0.0), "h", 0, 5, params, slots)
        act = np.zeros((2, 7), np.float32)
        act[:, 6] = [3 + r, 7 + r]  # absmax of each layer on each rank
        rep = wire.Report(wire.Header("j", r, 2, "b", 1, 0.0), sch.hash, 0, 0.1, 1.0, 0, probe=True, act=act,
                          act_grad=np.zeros((2, 2), np.float32), param=np.zeros((1, 3), np.float32),
                          fp_grad=np.zeros(1, np.uint64), fp_weight=np.zeros(1, np.uint64))
        agg.handle(wire.encode(sch))
        agg.handle(wire.encode(rep))
    agg.publish()
    text = generate_latest(agg.registry).decode()
    agg.runner.close()
    out[depth] = sorted(
        (s.labels["layer"], s.labels["agg"], s.value) for f in text_string_to_metric_families(text)
        for s in f.samples if s.name == "gradwatch_layer_activation_absmax"
    )
calls = np.array([[0, 0, -1, 1, 0, 0, 1], [0, 0, -4, 2, 0, 0, 4]], np.float64)
out["combined"] = combine_calls("act", np.array([2, 3]), calls)[-1]
out["catalog"] = [l for l in catalog.render().splitlines() if "`gradwatch_layer_activation_absmax`" in l]
print(json.dumps(out))
"""


def test_adding_a_row_is_enough():
    """A fresh interpreter appends one row to the table before anything else reads it: the wire
    carries a seventh activation column, the aggregator exports it per layer (and merged under
    --layer-depth by the row's rule), the host combine applies the row's rule, the catalog lists it."""
    import json

    run = subprocess.run([sys.executable, "-c", textwrap.dedent(ADD_A_ROW)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["fields"][-1] == "absmax" and len(out["fields"]) == 7
    aggs = ("min", "median", "max")
    assert out["0"] == sorted([["blocks.0.fc", a, v] for a, v in zip(aggs, (3.0, 3.5, 4.0))]
                              + [["blocks.1.fc", a, v] for a, v in zip(aggs, (7.0, 7.5, 8.0))])
    assert out["1"] == sorted(["blocks", a, v] for a, v in zip(aggs, (7.0, 7.5, 8.0)))  # merged by max
    assert out["combined"] == 4.0
    assert len(out["catalog"]) == 2 and "Largest absolute output activation" in out["catalog"][0]  # metrics and statistics tables


def test_nanmedian_equals_numpys_bit_for_bit():
    """The aggregations' median (reductions.nanmedian) gives np.nanmedian's values exactly, NaN
    where a column holds none, on either axis."""
    import warnings

    from gradwatch.aggregator.reductions import nanmedian

    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's own all-NaN warning
        for _ in range(2000):
            a = rng.standard_normal((int(rng.integers(1, 9)), int(rng.integers(1, 6))))
            a[rng.random(a.shape) < 0.3] = np.nan
            if rng.random() < 0.2:
                a = np.round(a)  # ties
            for axis in (0, 1):
                assert np.array_equal(nanmedian(a, axis), np.nanmedian(a, axis=axis), equal_nan=True)


# --- a column is named once ----------------------------------------------------------------------

#: names of the arrays whose last axis is the table's columns (or the agent's records of them): the
#: wire arrays, a round's merged and own parameter rows, and the records a report is built from
COLUMN_ARRAYS = frozenset(columns.ARRAYS) | {"module", "own_param", "out_grad", "rec", "recs", "sums"}


def _names(node) -> set[str]:
    """Every name and attribute name mentioned in the expression ``node``."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


def _literal_int(node) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def positional_reads(source: str) -> list[str]:
    """Where ``source`` reads or writes a column of a :data:`COLUMN_ARRAYS` array by position: a
    subscript with two or more indices (or ``...``) whose last one is an integer literal
    (``r.act[:, :, 5]``, ``np.asarray(r.act)[rows, :, 1]``), a tuple unpacked from such an
    array's row (``mean, std, lo, hi, zero, n = (float(x) for x in r.act[k, i])``), or a row
    written from a tuple (``act_count[s] = (calls, elements)``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) >= 2:
            if _literal_int(node.slice.elts[-1]) and _names(node.value) & COLUMN_ARRAYS:
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            # the row unpacked: the value itself, or what a comprehension in it iterates over
            rows = [node.value, *(g.iter for g in ast.walk(node.value) if isinstance(g, ast.comprehension))]
            if any(isinstance(x, ast.Subscript) and _names(x.value) & COLUMN_ARRAYS for x in rows):
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            # a row written from a tuple: each value lands in the column of its position
            if any(isinstance(t, ast.Subscript) and _names(t.value) & COLUMN_ARRAYS for t in node.targets):
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_the_positional_read_finder_sees_each_form():
    src = textwrap.dedent(
        """
        a = r.act[:, :, 5] > 0
        b = np.asarray(r.act, np.float64)[rows, :, 1]
        c = r.module[..., -1]
        param[idx, 2] = f["grad_nonfinite"]
        mean, std, lo, hi, zero, n = (float(x) for x in r.act[k, i])
        ok = r.act[:, :, A.nonfinite], r.act[k], rr.rank_totals[k, col], values[1], x[:, 0]
        at, group = g.placed(*param.shape[:2]), g.index
        loss, scale = rec["loss"], rec["loss_scale"]
        norm, n = r.act_grad[k, i]
        act_count[s] = (calls, elements)
        """
    )
    assert sorted(line.split(":")[0] for line in positional_reads(src)) == ["line 10", "line 11", "line 2", "line 3", "line 4", "line 5", "line 6"]


@pytest.mark.parametrize("folder", ["agent", "aggregator", "gradwatch"])
def test_no_column_is_read_by_position(folder):
    """The agent's report builder and frame, the aggregator's reconciliation, reductions and
    checks read and write each column by its name in the table (:func:`gradwatch.columns.at`),
    never by a literal position: a column added or moved in the table is read where it is."""
    found = {str(p.relative_to(ROOT)): hits for p in sorted((ROOT / folder).rglob("*.py"))
             if (hits := positional_reads(p.read_text()))}
    assert found == {}


def test_every_declared_rule_has_its_implementation():
    """The table names its rules; each side implements those it runs: the agent's host combine,
    the aggregator's member merge and aggregations over ranks."""
    pytest.importorskip("torch")
    from gradwatch.agent.combine import CALL_FUNCS
    from gradwatch.aggregator.reductions import AGG_FUNCS, MERGE_FUNCS

    assert set(CALL_FUNCS) == {name for name, rule in columns.CALL_RULES.items() if rule.host}
    assert set(MERGE_FUNCS) == set(columns.MERGE_RULES)
    assert tuple(AGG_FUNCS) == columns.AGGREGATIONS


def test_columns_are_read_by_name_through_the_table():
    for key in columns.ARRAYS:
        at, rec = columns.at(key), columns.record_at(key)
        assert at._fields == columns.fields(key) and tuple(at) == tuple(range(len(at)))
        assert rec._fields == columns.records(key) and tuple(rec) == tuple(range(len(rec)))
    assert columns.at("param").weight_norm == wire.PARAM_FIELDS.index("weight_norm")
    assert columns.named("grad_norm").array == "param" and columns.named("no_such_statistic") is None
    groups = columns.observing()
    assert sorted(s.name for g in groups for s in g) == sorted(s.name for s in STATISTICS)
    assert all(len({(s.array, s.observed_by) for s in g}) == 1 for g in groups)


def test_a_probe_reports_held_bytes_count_every_declared_array():
    """A round holds its reports within max_pending_bytes counting every array the wire declares
    for a probe report (the table's arrays, act_count among them, and the fingerprints)."""
    from gradwatch.aggregator.rounds import nbytes

    rep = wire.decode(frames("bytes")[1], schema_sizes=lambda h, d: (len(PARAMS), len(SLOTS)))
    assert rep.act_count is not None and rep.act_count.nbytes > 0
    assert nbytes(rep) == sum(getattr(rep, k).nbytes for k in wire.PROBE_ARRAYS) == sum(
        getattr(rep, k).nbytes for k in (*columns.ARRAYS, "fp_grad", "fp_weight"))
