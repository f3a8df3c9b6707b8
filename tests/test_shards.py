"""aggregator/shards.py on hand-made meshes: pipeline stages (a "pp" mesh dimension)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch import wire
from gradwatch.aggregator.shards import combine_params, global_norms

from .fakejob import FakeJob, LocalJob, Model

PP_DP = ("pp", "dp")


def mesh(pp: int, dp: int, names=PP_DP) -> wire.Mesh:
    return wire.Mesh(names, (2, 2), (pp, dp))


def test_stage_dims_by_name():
    assert wire.stage_dims(mesh(0, 0)) == (0,)
    assert wire.stage_dims(wire.Mesh(("dp", "pp_stage"), (2, 2), (0, 0))) == (1,)
    assert wire.stage_dims(wire.Mesh(("replicate", "shard"), (2, 2), (0, 0))) == ()
    assert wire.stage_dims(None) == ()


def test_pipeline_global_norm_adds_each_stage_once():
    # stage 0: a parameter FSDP-sharded over dp (dims (1,)); stage 1: the same plus a whole one
    entries = {
        0: (mesh(0, 0), (((1,), 1.0),)),
        1: (mesh(0, 1), (((1,), 2.0),)),
        2: (mesh(1, 0), (((), 5.0), ((1,), 3.0))),
        3: (mesh(1, 1), (((), 5.0), ((1,), 4.0))),
    }
    want = math.sqrt(1 + 2 + 5 + 3 + 4)  # stage 1's replicated class counted once per rank, not twice
    got = global_norms(entries)
    assert got == {r: pytest.approx(want) for r in range(4)}
    # a stage missing: no global norm for anyone yet (never a stage's norm passed off as global)
    assert global_norms({r: entries[r] for r in (0, 1)}) == {}
    # one replica of stage 1 only: ranks on its dp coordinate are not complete either (group of 2)
    assert global_norms({r: entries[r] for r in (0, 1, 2)}) == {}


def test_pipeline_holders_never_span_stages():
    # both stages name their parameter "w" (a hand-split model): held by different ranks' stages
    meshes = [mesh(0, 0), mesh(0, 1), mesh(1, 0), mesh(1, 1)]
    shards = [((),)] * 4  # plain replicas within a stage
    pcols = [np.array([0])] * 4
    param = np.ones((4, 1, 3))
    _, holders = combine_params(meshes, shards, pcols, param)
    h = holders[:, 0]
    assert h[0] == h[1] and h[2] == h[3] and h[0] != h[2]


# --- checks that compare ranks' own statistics: peers are the ranks of one pipeline stage ----------

PP_PARAMS = ((("0.weight", (16, 8), "float32"), ("0.bias", (16,), "float32")),  # stage 0
             (("2.weight", (4, 16), "float32"), ("2.bias", (4,), "float32")))  # stage 1
PP_SLOTS = ((("0", "", "Linear", "float32"), ("1", "", "ReLU", "float32")),
            (("2", "", "Linear", "float32"), ("3", "", "LayerNorm", "float32")))


class PipelineFrames(LocalJob):
    """A 2-stage x 3-replica pipeline job (mesh ("pp", "dp")) of fake ranks: every message goes
    through ``wire.encode`` and ``wire.decode`` into a real State and Runner (no sockets)."""

    def __init__(self, checks: list[str], job: str = "pp"):
        super().__init__(checks, t0=1000.0, state={"grace_s": 5.0}, job=job, world=6, every=1, clock=lambda: self.now,
                         boots=[f"boot{r}" for r in range(6)])
        for r in range(6):
            self.coord[r] = (r // 3, r % 3)
            self.schema(r, model=Model(PP_PARAMS[r // 3], PP_SLOTS[r // 3]), mesh=wire.Mesh(PP_DP, (2, 3)),
                        shard=tuple(() for _ in PP_PARAMS[r // 3]))

    def step(self, step: int, local: list[float], compute: list[float], grad_sq: list[float],
             frozen: tuple = ()) -> None:
        """Every rank's probed report of ``step``: its local gradient norm, compute time (s), and
        the sum of squares of its stage's gradient (equal within a stage: replicas); its own norm
        the sum's root, as the agent sends, or NaN on the ``frozen`` stages: no gradient there."""
        self.now += 0.1
        for r in range(6):
            n = len(PP_PARAMS[r // 3])
            g = np.float32(local[r] / np.sqrt(n))
            self.send(wire.Report(
                self.header(r), self.digest[r], step, 0.1, math.nan if r // 3 in frozen else math.sqrt(grad_sq[r // 3]), 0, probe=True,
                act=np.tile(np.array([0.0, 1.0 + r // 3, -1.0, 1.0, 0.1, 0.0], np.float32), (2, 1)),
                act_grad=np.tile(np.array([0.5, 0.0], np.float32), (2, 1)),
                param=np.tile(np.array([g, 2.0, 0.0], np.float32), (n, 1)),
                fp_grad=np.arange(n, dtype=np.uint64), fp_weight=np.arange(n, dtype=np.uint64),
                local_grad_norm=local[r], compute_time=compute[r], grad_sq=(((), grad_sq[r // 3]),), batch=3,
            ))
        self.state.tick()

    def findings(self) -> list:
        return [(e.check, e.event, e.rank) for e in self.runner.events]


def test_pipeline_stages_with_different_norms_and_times_are_not_outliers_or_stragglers():
    # stage 0's healthy local gradient norm is 20x stage 1's, its activations twice as wide, and
    # its compute time (until its first gradient bucket, which waits for the later stage's
    # backward) 5x: scored across the job, stage 0's three ranks would be the outliers and
    # stragglers of six. Scored within a stage, a clean job has no finding over 60 probed steps.
    rng = np.random.default_rng(0)
    j = PipelineFrames(["outlier_rank", "straggler", "noise_scale"])
    for step in range(60):
        local = [20.0 * (1 + 0.05 * rng.standard_normal()) if r < 3 else 1.0 * (1 + 0.05 * rng.standard_normal())
                 for r in range(6)]
        compute = [0.5 + 0.005 * rng.standard_normal() if r < 3 else 0.1 + 0.001 * rng.standard_normal() for r in range(6)]
        j.step(step, local, compute, [400.0, 1.0])
    rr = j.state.jobs["pp"].last_round
    assert rr.step == 59 and rr.complete and rr.part.tolist() == [0, 0, 0, 1, 1, 1]
    assert rr.grad_norm == pytest.approx(np.full(6, math.sqrt(401.0)))  # the stages' totals added
    assert j.findings() == []
    view = j.runner.view().values
    assert set(view["rank_outlier_zscore"]) == {("pp", str(r)) for r in range(6)}  # every rank scored
    assert max(view["rank_outlier_zscore"].values()) < 3.5
    assert min(view["rank_straggler_relative_score"].values()) > 0.9  # against its stage's fastest
    # the noise scale needs every rank to be a data-parallel replica of the whole model
    from gradwatch.aggregator.checks import Outcome

    assert j.runner.status[("pp", "noise_scale")] == Outcome.NO_DATA
    # the checks still work within a stage: rank 4's local norm 10x its stage's, rank 1 slow
    for step in range(60, 130):
        local = [20.0, 20.0, 20.0, 1.0, 10.0, 1.0]
        compute = [0.5, 1.0, 0.5, 0.1, 0.1, 0.1]
        j.step(step, local, compute, [400.0, 1.0])
    assert j.findings() == [("outlier_rank", "raised", 4), ("straggler", "raised", 1)]
    (f,) = j.runner.active[("pp", "outlier_rank")].values()
    assert f.details["peers"] == [3, 4, 5] and f.details["statistic"] == "local_grad_norm"


def test_a_sharded_step_without_gradients_has_no_global_norm_and_is_not_vanishing():
    # with no gradient at a step the agent sends a NaN norm, no non-finite parameter and 0.0 for
    # each grad_sq class. A replica's NaN is not judged; a sharded rank's global norm (from the
    # classes) was sqrt(0) = 0.0, a false "vanishing" finding. Zero gradients are vanishing.
    j = PipelineFrames(["vanishing", "explosion"])
    ones = [1.0] * 6
    for step in range(3):
        j.step(step, ones, [0.1] * 6, [4.0, 1.0])
    j.step(3, ones, [0.1] * 6, [0.0, 0.0], frozen=(0, 1))
    job = j.state.jobs["pp"]
    assert job.last_round.step == 3 and np.isnan(job.last_round.grad_norm).all()  # the probed round
    assert all(math.isnan(job.ranks[r].grad_norm) for r in range(6))  # the released step's gauges
    j.step(4, ones, [0.1] * 6, [4.0, 1.0])
    assert job.last_round.grad_norm.tolist() == [math.sqrt(5.0)] * 6
    j.step(5, ones, [0.1] * 6, [4.0, 0.0], frozen=(1,))  # stage 1 frozen: its ranks show the model's norm
    assert job.last_round.grad_norm.tolist() == [2.0] * 6 and job.ranks[5].grad_norm == 2.0
    assert j.findings() == []
    j.step(6, ones, [0.1] * 6, [0.0, 0.0])  # gradients present, all zero
    assert job.last_round.grad_norm.tolist() == [0.0] * 6 and job.ranks[0].grad_norm == 0.0
    assert j.findings() == [("vanishing", "raised", None)]


def test_pipeline_stage_of_two_ranks_has_no_outlier_data():
    # two replicas per stage: no majority within a stage; the other stage's ranks are no peers
    from gradwatch.aggregator.checks.outlier_rank import peer_groups

    class R:
        ranks = (0, 1, 2, 3)
        part = np.array([0, 0, 1, 1])

    assert [g.tolist() for g in peer_groups(R)] == [[0, 1], [2, 3]]
    R.part = None
    assert [g.tolist() for g in peer_groups(R)] == [[0, 1, 2, 3]]


# --- the vectorised grouping against the plain per-entry definition ---------------------------------


def _ref_off(mesh, dims):
    return (mesh.names, mesh.sizes, tuple(c for k, c in enumerate(mesh.coord) if k not in dims))


def _ref_on(mesh, dims):
    stage = tuple(mesh.coord[k] for k in wire.stage_dims(mesh))
    return (mesh.names, mesh.sizes, tuple(dims), tuple(mesh.coord[k] for k in dims), stage)


def _ref_combine(meshes, shards, pcols, param):
    """The module docstring's definition, one entry at a time (float64, members in rank order)."""
    out = param.copy()
    groups, need = {}, {}
    for k, (mesh, shard) in enumerate(zip(meshes, shards)):
        if mesh is None:
            continue
        for j, dims in zip(pcols[k], shard):
            if dims:
                key = (int(j), tuple(dims), _ref_off(mesh, dims))
                groups.setdefault(key, []).append(k)
                need[key] = math.prod(mesh.sizes[d] for d in dims)
    for key, members in groups.items():
        j = key[0]
        if len(members) < need[key]:
            out[members, j] = np.nan
            continue
        for f in (0, 1):
            acc = 0.0
            for k in members:
                x = float(param[k, j, f])
                acc += x * x  # the IEEE product: libm's pow (x ** 2) is off by an ulp at times
            out[members, j, f] = math.sqrt(acc) if acc == acc else math.nan
        out[members, j, 2] = sum(float(param[k, j, 2]) for k in members)
    return out


def _ref_holders(meshes, shards, pcols, n):
    """Ranks holding the same bytes, by the definition: a partition of each column, as sets."""
    sets = {}
    for k, (mesh, shard) in enumerate(zip(meshes, shards)):
        if mesh is None:
            continue
        staged = bool(wire.stage_dims(mesh))
        for j, dims in zip(pcols[k], shard):
            if dims or staged:
                sets.setdefault((int(j), _ref_on(mesh, dims)), set()).add(k)
    return sorted((j, frozenset(m)) for (j, _), m in sets.items())


def _ref_global(entries):
    acc = {}
    for mesh, sq in entries.values():
        for dims, v in sq:
            a = acc.setdefault((tuple(dims), _ref_off(mesh, dims)), [0.0, 0])
            a[0] += v
            a[1] += 1
    totals = {}
    for r, (mesh, sq) in entries.items():
        total = 0.0
        for dims, _ in sq:
            s, n = acc[(tuple(dims), _ref_off(mesh, dims))]
            if n < math.prod(mesh.sizes[d] for d in dims):
                break
            total += s
        else:
            totals[r] = total
    out = {}
    for r, t in totals.items():
        mesh = entries[r][0]
        st = wire.stage_dims(mesh)
        if st:
            per = {tuple(entries[q][0].coord[k] for k in st): totals[q] for q in totals
                   if _ref_off(entries[q][0], st) == _ref_off(mesh, st)}
            if len(per) < math.prod(mesh.sizes[k] for k in st):
                continue
            t = sum(per[s] for s in sorted(per))
        out[r] = math.sqrt(t) if t >= 0 else math.nan
    return out


def _random_job(rng, staged: bool):
    """A (pp,) dp x tp mesh job's ranks, some missing, two shard objects per stage (blocks), values
    with NaN and Inf now and then."""
    names = ("pp", "dp", "tp") if staged else ("rep", "dp", "tp")
    sizes = (2, 3, 2)
    kinds = [(), (1,), (2,), (1, 2)]
    stage_shards = []
    for _ in range(sizes[0]):
        n = int(rng.integers(2, 6))
        shard = tuple(kinds[int(rng.integers(0, 4))] for _ in range(n))
        stage_shards.append((shard, np.sort(rng.choice(12, n, replace=False)).astype(np.int64)))
    if rng.random() < 0.4:
        stage_shards = [stage_shards[0]] * sizes[0]  # every stage lists the same: one block
    meshes, shards, pcols = [], [], []
    missing = 0.15 * int(rng.integers(0, 2))  # every rank in half of the draws
    split = rng.random() < 0.5  # ranks of a stage in one block or in several (equal lists, other objects)
    for c in np.ndindex(*sizes):
        if rng.random() < missing:
            continue  # a rank that did not report
        if split and rng.random() < 0.05:
            meshes.append(None)
            shards.append(())
            pcols.append(np.arange(3, dtype=np.int64))
            continue
        shard, cols = stage_shards[c[0]]
        meshes.append(wire.Mesh(names, sizes, tuple(int(x) for x in c)))
        shards.append(tuple(list(shard)) if split and rng.random() < 0.5 else shard)  # equal content, another object
        pcols.append(cols)
    param = rng.standard_normal((len(meshes), 12, 3))
    param[..., 2] = rng.integers(0, 3, param.shape[:2])
    param[rng.random(param.shape) < 0.03] = np.nan
    param[rng.random(param.shape) < 0.01] = np.inf
    return meshes, shards, pcols, param


def test_a_job_sharding_every_parameter_alike_combines_every_row_in_place_of_a_gather():
    """Every rank shards every parameter: the entries are all rows in order (no gather, no copy
    of ``param`` kept), with the definition's numbers, ``param`` itself untouched."""
    from gradwatch.aggregator.shards import combine_groups, shard_groups

    rng = np.random.default_rng(21)
    for dims in ((1,), (0,), (0, 1)):
        meshes = [wire.Mesh(("dp", "tp"), (2, 4), (k // 4, k % 4)) for k in range(8)]
        shards = [tuple(dims for _ in range(5))] * 8
        pcols = [np.arange(5, dtype=np.int64)] * 8
        param = rng.standard_normal((8, 5, 3))
        param[..., 2] = rng.integers(0, 3, param.shape[:2])
        param[rng.random(param.shape) < 0.05] = np.nan
        before = param.copy()
        got = combine_groups(meshes, shards, pcols, param)
        np.testing.assert_array_equal(got, _ref_combine(meshes, shards, pcols, param))
        assert np.array_equal(param, before, equal_nan=True) and not np.shares_memory(got, param)
        assert shard_groups(meshes, shards, pcols).placed(8, 5) is None  # the rows, in order
        # one rank, one parameter: a one-element column is contiguous, and still not squared in place
        one = [wire.Mesh(("tp",), (1,), (0,))], [((0,),)], [np.arange(1, dtype=np.int64)]
        row = np.array([[[3.0, 4.0, 1.0]]])
        got = combine_groups(*one, row)
        assert row.tolist() == [[[3.0, 4.0, 1.0]]] and got.tolist() == [[[3.0, 4.0, 1.0]]]
        # a rank without a mesh: the entries no longer cover every row (gathered, the rest kept)
        meshes[3] = None
        assert shard_groups(meshes, shards, pcols).placed(8, 5) is not None
        got = combine_groups(meshes, shards, pcols, param)
        np.testing.assert_array_equal(got, _ref_combine(meshes, shards, pcols, param))
        assert np.array_equal(got[3], param[3], equal_nan=True)


@pytest.mark.parametrize("staged", [False, True])
def test_vectorised_groups_match_the_definition(staged):
    from gradwatch.aggregator.shards import combine_groups, holders

    rng = np.random.default_rng(7 + staged)
    combined = normed = 0
    for _ in range(80):
        meshes, shards, pcols, param = _random_job(rng, staged)
        got = combine_groups(meshes, shards, pcols, param)
        np.testing.assert_array_equal(got, _ref_combine(meshes, shards, pcols, param))  # bit for bit
        combined += int((np.isfinite(got) & (got != param)).sum())
        h = holders(meshes, shards, pcols, 12)
        sets = {}
        for k, j in zip(*np.nonzero(h)):
            sets.setdefault((int(j), int(h[k, j])), set()).add(int(k))
        assert sorted((j, frozenset(m)) for (j, _), m in sets.items()) == _ref_holders(meshes, shards, pcols, 12)
        entries = {}
        for k, m in enumerate(meshes):
            if m is None:
                continue
            classes = sorted(set(shards[k]))
            entries[10 * k + 1] = (m, tuple((d, float(rng.random()) if rng.random() > 0.02 else math.nan)
                                            for d in classes))
        want = _ref_global(entries)
        got = global_norms(entries)
        assert got.keys() == want.keys()
        assert all(got[r] == want[r] or (math.isnan(got[r]) and math.isnan(want[r])) for r in want)
        normed += sum(math.isfinite(x) for x in want.values())
    assert combined > 100 and normed > 50  # the draws make complete groups, not only NaN


def test_a_jobs_released_steps_share_one_set_of_norm_groups_whatever_order_their_records_come_in():
    """Records.released asks norms_of in rank order: steps whose records arrive in another order each
    time reuse the groups of the first (they are kept by position), and every rank's gauge is the
    sqrt of its tp group's summed squares, in float64."""
    from gradwatch.aggregator import shards
    from gradwatch.aggregator.state import State

    dp, tp = 2, 4
    world = dp * tp
    st = State(clock=lambda: 0.0)
    job = FakeJob(st.apply, "j", world, Model((("w", (8, 4), "float32"),), (("fc1", "", "Linear", "float32"),)), every=1,
                  host="n", clock=lambda: 0.0, boots=[f"b{r}" for r in range(world)], key="k")
    job.coord = {r: (r // tp, r % tp) for r in range(world)}
    (sch,) = job.schema(0, local_rank=lambda r: 0, mesh=wire.Mesh(("dp", "tp"), (dp, tp)), shard=((1,),))
    job.schema(range(1, world), local_rank=lambda r: 0, mesh=sch.mesh, shard=sch.shard)
    shards._NORM_GROUPS.clear()
    rng = np.random.default_rng(3)
    for step in range(6):
        sums = rng.uniform(0.1, 4.0, world)
        for r in rng.permutation(world).tolist():
            job.report(r, step, math.sqrt(sums[r]), step_time=0.01, grad_sq=(((1,), float(sums[r])),))
        held = st.jobs["j"]
        for r in range(world):
            group = [k for k in range(world) if k // tp == r // tp]
            assert held.ranks[r].grad_norm == math.sqrt(sum(float(sums[k]) for k in group))  # summed in rank order
    assert len(shards._NORM_GROUPS) == 1


def test_parts_cache_keeps_a_digest_of_the_parameter_names_not_the_names():
    """shards.part numbers each schema's parameter names; its process-wide cache kept the names
    themselves, past their schemas and outside every schema bound (an attack grew it ~0.5 MB a
    new schema). It keeps 16 bytes per distinct set of names, and tells sets apart exactly."""
    from gradwatch.aggregator import shards

    shards._PARTS.clear()
    shards._NAMES.clear()

    def schema(names, width=2):
        return wire.Schema(wire.Header("j", 0, 1, "b", 0, 0.0), "n", 0, 1, tuple((n, (width,), "float32") for n in names), ())

    long = [f"model.layers.{i}.{'x' * 200}.weight" for i in range(2000)]
    a, b = schema(long), schema(long, width=3)  # the same names, another hash
    assert a.hash != b.hash and shards.part(a) == shards.part(b)
    assert shards.part(schema(long[:-1] + ["other"])) != shards.part(a)
    assert shards.part(schema(["a\0b", "c"])) != shards.part(schema(["a", "b\0c"]))  # names containing the separator
    assert all(isinstance(k, bytes) and len(k) == 16 for k in shards._NAMES) and len(shards._NAMES) == 4
