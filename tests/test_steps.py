"""The aggregator's step table (aggregator/steps.py): every rank's records lined up by step,
released once each, in order, whatever order and batch sizes the ranks' records come in."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch.aggregator.steps import COLUMNS, MIN_ROWS, WAIT_S, StepTable


def records(steps, rank: int = 0, **cols) -> tuple[np.ndarray, dict]:
    s = np.asarray(steps, np.int64)
    values = {name: np.asarray(cols.get(name, s * 10.0 + rank), np.float64) for name in COLUMNS}
    values["probe"] = np.asarray(cols.get("probe", np.zeros(len(s))), np.float64)
    return s, values


def add(t: StepTable, rank: int, steps, **kw):
    s, v = records(steps, rank)
    return t.add(rank, s, v, **kw)


def test_a_step_is_released_once_every_rank_reported_it_with_each_ranks_values():
    t = StepTable(3)
    assert add(t, 0, [0, 1, 2]) == [] and add(t, 2, [0, 1]) == []
    out = add(t, 1, [0, 1, 2, 3])
    assert [v.step for v in out] == [0, 1]  # rank 2 has not reported 2 yet
    v = out[1]
    assert v.ranks.tolist() == [0, 1, 2] and v.grad_norm.tolist() == [10.0, 11.0, 12.0]
    assert v.probe.dtype == bool and not v.probe.any()
    assert [v.step for v in add(t, 2, [2, 3])] == [2] and t.pending == 1  # rank 0 has not sent 3


def test_a_later_complete_step_releases_the_older_incomplete_ones_first():
    t = StepTable(2)
    add(t, 0, [5])
    add(t, 0, [6])
    out = add(t, 1, [6])  # rank 1 never sends 5: a lost record
    assert [(v.step, v.ranks.tolist()) for v in out] == [(5, [0]), (6, [0, 1])]
    assert add(t, 1, [5]) == [] and t.pending == 0  # too late: judged already


def test_an_incomplete_step_is_released_wait_s_after_it_was_first_seen():
    t = StepTable(2)
    add(t, 0, [0, 1])
    assert t.tick(100.0) == []  # first seen now
    assert t.tick(100.0 + WAIT_S / 2) == []
    add(t, 0, [2])
    out = t.tick(100.0 + WAIT_S)
    assert [v.step for v in out] == [0, 1] and t.pending == 1
    assert [v.step for v in t.tick(100.0 + 3 * WAIT_S)] == [2]


def test_batches_longer_than_the_table_grow_it_and_lose_nothing():
    t = StepTable(2)
    n = 5 * MIN_ROWS
    add(t, 0, range(n))
    assert t.rows >= n and t.pending == n
    out = add(t, 1, range(n))
    assert [v.step for v in out] == list(range(n)) and all(len(v) == 2 for v in out)


def test_memory_is_bounded_per_job_the_oldest_steps_go_first():
    t = StepTable(1024, max_cells=1024 * MIN_ROWS)
    assert t.max_rows == MIN_ROWS
    out = add(t, 0, range(3 * MIN_ROWS))  # one rank races ahead; nobody else reports
    assert t.pending <= MIN_ROWS and t.rows == MIN_ROWS
    assert [v.step for v in out] == list(range(2 * MIN_ROWS))  # released incomplete, in order
    add(t, 1, [2 * MIN_ROWS + 1])
    out = add(t, 0, [4 * MIN_ROWS])  # the steps waiting would span more rows than it holds
    assert [v.step for v in out] == list(range(2 * MIN_ROWS, 3 * MIN_ROWS))
    assert out[1].ranks.tolist() == [0, 1]
    assert t.have.nbytes + sum(a.nbytes for a in t.cols.values()) <= 1024 * MIN_ROWS * (1 + 8 * len(COLUMNS))


def test_a_batch_older_than_the_steps_waiting_never_shares_their_rows():
    # rank 0 is ahead (steps 100..130 wait); rank 1's batch of 36..99 comes: a step's row is
    # step % rows, so 36 and 100 would share one of 64 rows. The table grows to span them all.
    t = StepTable(2)
    add(t, 0, range(100, 131))
    assert add(t, 1, range(36, 100)) == []
    out = add(t, 1, range(100, 131)) + t.tick(0.0) + t.tick(10 * WAIT_S)
    assert [v.step for v in out] == list(range(36, 131))
    for v in out:
        assert v.ranks.tolist() == ([1] if v.step < 100 else [0, 1])
        assert v.grad_norm.tolist() == [v.step * 10.0 + k for k in v.ranks.tolist()]
    # at its largest, records a table's rows or more behind the newest step waiting are late
    t = StepTable(1024, max_cells=1024 * MIN_ROWS)
    add(t, 0, range(100, 131))
    assert add(t, 1, range(36, 100)) == [] and t.released == 130 - MIN_ROWS
    out = add(t, 1, range(100, 131)) + t.tick(0.0) + t.tick(10 * WAIT_S)
    assert [v.step for v in out] == list(range(67, 131))
    for v in out:
        assert v.ranks.tolist() == ([1] if v.step < 100 else [0, 1])
        assert v.grad_norm.tolist() == [v.step * 10.0 + k for k in v.ranks.tolist()]


@pytest.mark.parametrize("seed", range(5))
def test_ranks_far_apart_in_a_table_at_its_largest_never_mix_steps(seed):
    """Ranks first heard at steps far apart (an aggregator restarted mid-run) drift further
    apart, in batches of random length: every step released once, ascending, each value the
    record of its own step and rank."""
    rng = np.random.default_rng(seed)
    world = 4
    t = StepTable(world, max_cells=world * MIN_ROWS)
    nxt, released = rng.integers(0, 3 * MIN_ROWS, world).tolist(), []
    for _ in range(3000):
        k = int(rng.integers(world))
        if rng.random() < 0.3 * (k + 1) / world:  # the higher ranks run ahead
            continue
        m = int(rng.integers(1, 20))
        released += add(t, k, range(nxt[k], nxt[k] + m))
        nxt[k] += m
    released += t.tick(0.0) + t.tick(10 * WAIT_S)
    steps = [v.step for v in released]
    assert steps == sorted(set(steps)) and max(nxt) - min(nxt) > 2 * MIN_ROWS
    for v in released:
        assert v.grad_norm.tolist() == [v.step * 10.0 + k for k in v.ranks.tolist()]


def test_a_restarted_ranks_waiting_records_are_forgotten():
    t = StepTable(2)
    add(t, 0, [0, 1])
    add(t, 1, [0])  # released 0
    t.forget_rank(0)
    assert t.count.max() == 0 and t.pending == 1
    out = add(t, 1, [1])
    assert out == [] and t.pending == 1  # step 1 waits for rank 0's new boot
    out = add(t, 0, [1])
    assert [(v.step, v.ranks.tolist()) for v in out] == [(1, [0, 1])]


def test_a_rank_resending_a_step_counts_once_and_keeps_its_latest_values():
    t = StepTable(2)
    s, v = records([3], 0, grad_norm=[1.0])
    t.add(0, s, v)
    s, v = records([3], 0, grad_norm=[2.0])
    assert t.add(0, s, v) == []
    out = add(t, 1, [3])
    assert out[0].grad_norm.tolist() == [2.0, 31.0]


def test_norms_and_sums_of_squares_travel_with_their_step():
    t = StepTable(2)
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    add(t, 0, [0, 1], norms=("h", rows), grad_sq=[(((), 1.0),), (((), 2.0),)])
    out = add(t, 1, [0, 1])
    assert out[1].norms[0][0] == "h" and out[1].norms[0][1].tolist() == [3.0, 4.0, 5.0] and 1 not in out[1].norms
    assert out[0].grad_sq == {0: (((), 1.0),)}


@pytest.mark.parametrize("seed", range(5))
def test_random_interleavings_release_every_step_once_in_order(seed):
    """Ranks send batches of random length at random moments; a few records are lost: every
    step is released exactly once, ascending, with exactly the ranks whose records came in time."""
    rng = np.random.default_rng(seed)
    world, n = 4, 300
    t = StepTable(world)
    nxt = [0] * world
    lost = {(int(rng.integers(n)), int(rng.integers(world))) for _ in range(10)}
    released = []
    now = 0.0
    while min(nxt) < n:
        k = int(rng.integers(world))
        if nxt[k] >= n:
            continue
        m = int(rng.integers(1, 40)) if rng.random() < 0.7 else 1
        steps = [s for s in range(nxt[k], min(n, nxt[k] + m)) if (s, k) not in lost]
        nxt[k] = min(n, nxt[k] + m)
        if len(steps) == 1 and rng.random() < 0.5:  # one record at a time, as at one step per second
            s0 = steps[0]
            released += t.add_one(k, s0, {name: (0.0 if name == "probe" else s0 * 10.0 + k) for name in COLUMNS})
        elif steps:
            released += add(t, k, steps)
        now += 0.01
        released += t.tick(now)
    released += t.tick(now + 10 * WAIT_S)
    assert [v.step for v in released] == list(range(n))
    for v in released:
        assert set(v.ranks.tolist()) <= {k for k in range(world) if (v.step, k) not in lost}
        assert all(math.isclose(g, v.step * 10.0 + k) for g, k in zip(v.grad_norm, v.ranks))


def test_the_cpu_wait_column_reaches_the_step_view_from_the_wire():
    """A steps batch and a probe's report through the aggregator's state: each rank's
    ``compute_wait`` beside its ``compute_time`` in the released step's view, NaN from an agent
    without it."""
    from gradwatch import wire
    from gradwatch.aggregator.checks import Check, Thresholds
    from gradwatch.aggregator.runner import Runner
    from gradwatch.aggregator.state import State

    seen = []

    class Views(Check):
        name = "views"

        def on_steps(self, job, views):
            seen.extend(views)

    runner = Runner([], Thresholds())
    runner.checks = {"views": Views(Thresholds())}
    state = State(grace_s=5.0, clock=lambda: 1000.0, runner=runner, proof_steps=0)  # judged as it comes
    params, slots = (("w", (2,), "float32"),), (("fc", "", "Linear", "float32"),)
    digest = wire.schema_hash(params, slots)

    def rec(rank, step, wait):
        return wire.Report(wire.Header("j", rank, 2, f"b{rank}", step, 1000.0), digest, step, 0.1, 1.0, 0,
                           compute_time=0.05, compute_wait=wait)

    state.apply(wire.Steps.of([rec(0, s, 0.01 * s) for s in (1, 2)]))
    state.apply(wire.Steps.of([rec(1, s, math.nan) for s in (1, 2)]))
    state.apply(rec(0, 3, 0.004))
    state.apply(rec(1, 3, 0.002))
    by_step = {v.step: v for v in seen}
    assert sorted(by_step) == [1, 2, 3]
    assert by_step[2].compute_wait[0] == 0.02 and math.isnan(by_step[2].compute_wait[1])
    assert by_step[3].compute_wait.tolist() == [0.004, 0.002] and by_step[3].compute_time.tolist() == [0.05, 0.05]


def test_the_nan_guards_slots_reach_the_step_view_from_the_wire_and_only_where_it_saw_one():
    """``nonfinite_slot`` through the aggregator's state, in a steps batch and in one report:
    the released step's view holds ``{rank: (schema, slot)}`` for the ranks whose guard saw a
    non-finite output there, nothing for -1 or an agent without the guard; the table keeps
    nothing once the step is released, and a restarted rank's waiting slots go with its records."""
    from gradwatch import wire
    from gradwatch.aggregator.checks import Check, Thresholds
    from gradwatch.aggregator.runner import Runner
    from gradwatch.aggregator.state import State

    seen = []

    class Views(Check):
        name = "views"

        def on_steps(self, job, views):
            seen.extend(views)

    runner = Runner([], Thresholds())
    runner.checks = {"views": Views(Thresholds())}
    state = State(grace_s=5.0, clock=lambda: 1000.0, runner=runner, proof_steps=0)  # judged as it comes
    digest = "0123456789abcdef"

    def rec(rank, step, slot):
        return wire.Report(wire.Header("j", rank, 2, f"b{rank}", step, 1000.0), digest, step, 0.1, 1.0, 0, nonfinite_slot=slot)

    state.apply(wire.Steps.of([rec(0, s, x) for s, x in ((1, -1), (2, 4), (3, None))]))
    state.apply(wire.Steps.of([rec(1, s, None) for s in (1, 2, 3)]))
    state.apply(rec(0, 4, 0))
    state.apply(rec(1, 4, 2))
    by_step = {v.step: v for v in seen}
    assert sorted(by_step) == [1, 2, 3, 4]
    assert [by_step[s].guard for s in (1, 2, 3)] == [{}, {0: (digest, 4)}, {}]
    assert by_step[4].guard == {0: (digest, 0), 1: (digest, 2)}
    assert not state.jobs["j"].table.guard

    t = StepTable(2)
    s, v = records([7, 8], 0)
    t.add(0, s, v, guard=("h", np.array([3, -1], np.int32)))
    assert t.guard == {7: {0: ("h", 3)}}
    t.forget_rank(0)
    assert add(t, 1, [7, 8]) == [] and not t.guard[7]
