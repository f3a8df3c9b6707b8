"""The aggregator as a black box: a real process on loopback, real ZeroMQ DEALER sockets, /metrics.

Fake ranks are built from :mod:`gradwatch.wire` messages alone (no torch): a :class:`FakeRank`
keeps a rank's header (job, rank, world, boot id, sequence number) and sends encoded frames.
Frames that must arrive in order share one socket (ZeroMQ keeps a socket's order).
Cases: C28 (sequence gaps), C30 (malformed input), C34 (label cardinality), C36 (NaN/Inf), C38
(start-up errors, one exporter).
"""

from __future__ import annotations

import collections
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from gradwatch import wire

from .conftest import ROOT, free_port, samples, start_aggregator, wait_for
from .fakejob import NET, Model, Rank, to_socket

PARAMS, SLOTS = NET.params, NET.slots
LAYERS = list(NET.layers)
MODULES = ["emb", "fc1", "fc2"]
OWNER = [0, 1, 1, 2, 2]  # index into MODULES of each parameter's module


class FakeRank(Rank):
    """One rank's agent reduced to its wire messages (:class:`~tests.fakejob.Rank`), each sent
    encoded on ``sock``; ``key``: the job key in its headers."""

    def __init__(self, sock, job: str, rank: int, world: int, params=PARAMS, slots=SLOTS, every: int = 5,
                 key: str = ""):
        super().__init__(to_socket(sock), job, rank, world, Model(params, slots), every=every, host="node-0", key=key)
        self.sock = sock

    def send(self, msg) -> None:
        self.fake.send(msg)

    def schema(self) -> None:
        super().schema(local_rank=lambda r: r % 8)

    def mesh_schema(self, mesh: wire.Mesh, shard: tuple) -> None:
        """Its schema on ``mesh`` (its place: :attr:`coord`), whose hash its reports then name."""
        super().schema(local_rank=lambda r: r, every=5, mesh=mesh, shard=shard)

    def heartbeat(self, step: int = -1) -> None:
        super().heartbeat(step)

    def report(self, step: int, grad_norm: float = 1.0, grad_nonfinite: int = 0, probe: dict | None = None,
               probe_interval: int = 0) -> None:
        arrays = None
        if probe is not None:
            n = len(self.model.params)
            arrays = dict(probe=True, fp_grad=np.zeros(n, np.uint64), fp_weight=np.zeros(n, np.uint64), **probe)
        super().report(step, grad_norm, grad_nonfinite, arrays=arrays, probe_interval=probe_interval)

    def restart(self, params=None, slots=None) -> None:
        """A new agent instance: the old one says goodbye (as at process exit), then a new boot id,
        sequence numbers from 0 again; of another model with ``params`` or ``slots``."""
        self.goodbye("exit")
        super().restart(model=Model(params or self.model.params, slots or self.model.slots))


def probe_arrays(n_slots: int, n_params: int, seed: int) -> dict:
    """Random but plausible per-layer statistics; counts are small whole numbers."""
    rng = np.random.default_rng(seed)
    act = rng.standard_normal((n_slots, 6)).astype(np.float32)
    act[:, 5] = rng.integers(0, 4, n_slots)
    act_grad = np.abs(rng.standard_normal((n_slots, 2))).astype(np.float32)
    act_grad[:, 1] = rng.integers(0, 3, n_slots)
    param = np.abs(rng.standard_normal((n_params, 3))).astype(np.float32)
    param[:, 2] = rng.integers(0, 2, n_params)
    return {"act": act, "act_grad": act_grad, "param": param}


def value(text: str, name: str, **labels) -> float | None:
    """The value of one sample of a scrape, or None; parses only the lines of ``name``."""
    lines = [line for line in text.splitlines() if line.startswith((name + "{", name + " "))]
    return samples("\n".join(lines) + "\n", name).get(tuple(sorted(labels.items())))


def scrape_until(agg, name: str, want, **labels) -> str:
    """Scrape until ``name{labels}`` equals ``want``; return that scrape."""

    def check():
        text = agg.scrape()
        return text if value(text, name, **labels) == want else None

    return wait_for(check, 20, interval=0.05, what=f"{name}{labels} == {want}")


def counter_samples(text: str):
    """``(sample name, labels, value)`` of every counter and summary sample in a scrape."""
    for fam in text_string_to_metric_families(text):
        if fam.type in ("counter", "summary", "histogram"):
            for s in fam.samples:
                yield s.name, s.labels, s.value


# --- (a) C30: a burst of malformed frames -------------------------------------------------------


def malformed_burst(good: FakeRank, limits: wire.Limits) -> list[tuple[bytes, str]]:
    """``(frame, expected reason)`` for every kind of bad frame; reasons checked locally first."""
    bad = FakeRank(good.sock, good.job, 1, good.world)  # rank 1 sends nothing valid before the burst
    base_hb = msgpack.unpackb(wire.encode(wire.Heartbeat(bad.header(), 3, 3, 0, 0)))
    arrays = probe_arrays(len(SLOTS), len(PARAMS), 0)
    base_rep = msgpack.unpackb(
        wire.encode(wire.Report(bad.header(), good.digest, 0, 0.1, 1.0, 0, probe=True,
                                fp_grad=np.zeros(len(PARAMS), np.uint64), fp_weight=np.zeros(len(PARAMS), np.uint64), **arrays))
    )

    def hb(**change):
        m = dict(base_hb, **change)
        for k in [k for k, v in change.items() if v is None]:
            del m[k]
        return msgpack.packb(m, use_bin_type=True)

    def hdr(**change):  # a heartbeat whose header is changed (None: the field left out)
        h = {k: v for k, v in dict(base_hb["header"], **change).items() if v is not None}
        return msgpack.packb(dict(base_hb, header=h), use_bin_type=True)

    def rep(**change):
        return msgpack.packb(dict(base_rep, **change), use_bin_type=True)

    one = wire.encode(wire.Heartbeat(bad.header(), 4, 4, 0, 0))
    frames = [
        (b"\xdd\xff\xff\xff\xff", "malformed"),  # a 2**32-1 element array header
        (b"\xc6" + (200 * 2**20).to_bytes(4, "big") + b"x" * 10, "malformed"),  # 200 MB bin, 10 bytes
        (b"\x91" * 50_000 + b"\x00", "malformed"),
        (b"", "malformed"),
        (b"\x00" * (limits.max_message_bytes + 1), "too_large"),
        (b"\x00" * (2 * limits.max_message_bytes), "too_large"),
        (one + one, "extra_data"),  # two messages in one frame
        (msgpack.packb([1, 2]), "not_a_map"),
        (hb(v=1), "version"),  # the protocol before this one
        (hb(kind="metrics"), "unknown_kind"),
        (hdr(seq=None), "missing_field"),
        (hdr(seq=True), "bad_field"),  # bool where int
        (hdr(seq=-1), "bad_field"),
        (hdr(rank=2), "bad_field"),  # rank >= world
        (rep(act=base_rep["act"][:-24]), "bad_array"),  # one slot short of the schema
        (rep(param=base_rep["param"][:-4]), "bad_array"),  # not a multiple of the row width
        # consistent with each other, one slot short of the schema the aggregator holds
        (rep(act=base_rep["act"][:-24], act_grad=base_rep["act_grad"][:-8]), "bad_array"),
    ]
    sch = msgpack.unpackb(wire.encode(wire.Schema(bad.header(), "h", 1, 5, PARAMS, SLOTS)))
    frames.append((msgpack.packb(dict(sch, hash="0" * 16), use_bin_type=True), "bad_field"))  # hash mismatch
    for seed in range(200):  # random bytes: the reason is whatever decode says, counted exactly
        rnd = np.random.default_rng(seed).bytes(1 + seed)
        try:
            wire.decode(rnd, limits)
        except wire.WireError as e:
            frames.append((rnd, e.reason))

    known = {good.digest: (len(PARAMS), len(SLOTS))}
    for frame, want in frames:
        with pytest.raises(wire.WireError) as e:
            wire.decode(frame, limits, lambda h, d: known.get(d, (None, None)))
        assert e.value.reason == want, (frame[:40], want)
    return frames


@pytest.mark.ddp
def test_C30_burst_of_malformed_frames_is_counted_by_reason_and_valid_traffic_still_flows(tmp_path, push):
    agg = start_aggregator(tmp_path, "--max-message-bytes", str(2**20), "--publish-interval-s", "0.05", "--round-grace-s", "30")
    try:
        sock = push(agg.endpoint)
        r0 = FakeRank(sock, "burst", 0, 2)
        r0.schema()  # the aggregator must know the schema to check probe row counts
        burst = malformed_burst(r0, wire.Limits(max_message_bytes=2**20))
        for frame, _ in burst:
            sock.send(frame)
        want = collections.Counter(reason for _, reason in burst)
        assert set(want) == {"malformed", "too_large", "extra_data", "not_a_map", "version", "unknown_kind", "missing_field", "bad_field", "bad_array"}

        def all_counted():
            text = agg.scrape()
            got = samples(text, "gradwatch_messages_rejected_total")
            return text if sum(got.values()) >= len(burst) else None

        text = wait_for(all_counted, 20, what="every bad frame counted")
        counted = {k: v for k, v in samples(text, "gradwatch_messages_rejected_total").items() if v}  # every reason shows, 0 until seen
        assert counted == {(("reason", r),): float(n) for r, n in want.items()}
        assert requests.get(agg.metrics_url.replace("/metrics", "/healthz"), timeout=5).json() == {"ok": True}
        assert agg.proc.poll() is None
        # nothing of the bad frames reached state: rank 1 is unknown, rank 0 saw only its schema
        assert value(text, "gradwatch_rank_messages_received_total", job_id="burst", rank="1") is None
        assert samples(text, "gradwatch_messages_received_total") == {(("kind", "schema"),): 1.0}

        # valid traffic afterwards, on the same connection
        r1 = FakeRank(sock, "burst", 1, 2)
        r1.schema()
        for step in range(3):
            for r in (r0, r1):
                r.report(step, probe=probe_arrays(len(SLOTS), len(PARAMS), step) if step == 2 else None)
        text = scrape_until(agg, "gradwatch_rounds_total", 1.0, job_id="burst", outcome="complete")
        for rank in ("0", "1"):
            assert value(text, "gradwatch_rank_steps_total", job_id="burst", rank=rank) == 3
            assert value(text, "gradwatch_rank_messages_lost_total", job_id="burst", rank=rank) == 0
        assert samples(text, "gradwatch_messages_received_total") == {(("kind", "schema"),): 2.0, (("kind", "report"),): 6.0}
        assert sum(samples(text, "gradwatch_messages_rejected_total").values()) == len(burst)
    finally:
        agg.stop()
    assert "Traceback" not in agg.log.read_text()


# --- (b) C28: sequence gaps and restarts --------------------------------------------------------


@pytest.fixture
def as_it_comes(tmp_path):
    """A real aggregator process (round grace 3 s) that exports a job from its first message
    (``--proof-steps 0``): the tests below read what one or two reports show; admission is
    tests/test_admission.py's and tests/test_series_cap.py's."""
    agg = start_aggregator(tmp_path, "--round-grace-s", "3", "--publish-interval-s", "0.05", "--proof-steps", "0")
    yield agg
    agg.stop()


@pytest.mark.ddp
def test_C28_sequence_gaps_count_lost_messages_and_a_new_boot_counts_a_restart(as_it_comes, push):
    aggregator = as_it_comes
    t0 = time.time()
    r = FakeRank(push(aggregator.endpoint), "gaps", 0, 1)
    r.heartbeat()  # seq 0
    r.report(0)  # 1
    r.report(1)  # 2
    r.seq += 2  # 3 and 4 lost in flight
    r.report(2)  # 5
    r.heartbeat(2)  # 6
    text = scrape_until(aggregator, "gradwatch_rank_messages_received_total", 5.0, job_id="gaps", rank="0")
    assert value(text, "gradwatch_rank_messages_lost_total", job_id="gaps", rank="0") == 2
    assert value(text, "gradwatch_rank_restarts_total", job_id="gaps", rank="0") == 0
    last_seen = value(text, "gradwatch_rank_last_seen_timestamp_seconds", job_id="gaps", rank="0")
    assert t0 - 1 <= last_seen <= time.time() + 1

    # the rank restarts: a new boot id and sequence numbers from 0 are no gap ...
    r.restart()
    r.schema()  # seq 0 of the new boot
    r.report(3)  # 1
    text = scrape_until(aggregator, "gradwatch_rank_messages_received_total", 8.0, job_id="gaps", rank="0")
    assert value(text, "gradwatch_rank_restarts_total", job_id="gaps", rank="0") == 1
    assert value(text, "gradwatch_rank_messages_lost_total", job_id="gaps", rank="0") == 2
    # ... while a gap within the new boot is one, counted from the new boot's numbers
    r.seq += 1
    r.report(4)  # 3: message 2 lost
    text = scrape_until(aggregator, "gradwatch_rank_messages_received_total", 9.0, job_id="gaps", rank="0")
    assert value(text, "gradwatch_rank_messages_lost_total", job_id="gaps", rank="0") == 3
    assert value(text, "gradwatch_rank_restarts_total", job_id="gaps", rank="0") == 1
    assert value(text, "gradwatch_rank_steps_total", job_id="gaps", rank="0") == 5


# --- (c) C36: NaN and Inf -----------------------------------------------------------------------


def assert_counters_finite(text: str) -> None:
    bad = [(n, l, v) for n, l, v in counter_samples(text) if not math.isfinite(v)]
    assert bad == [], bad


@pytest.mark.ddp
def test_C36_nan_and_inf_grad_norms_reach_gauges_never_counters(as_it_comes, push):
    aggregator = as_it_comes
    sock = push(aggregator.endpoint)
    ranks = [FakeRank(sock, "nan", r, 2) for r in range(2)]
    for r in ranks:
        r.schema()
    ranks[0].report(0, grad_norm=math.nan, grad_nonfinite=3)
    ranks[1].report(0, grad_norm=math.inf, grad_nonfinite=0)  # finite gradients whose norm overflowed
    text = scrape_until(aggregator, "gradwatch_rank_steps_total", 1.0, job_id="nan", rank="1")
    text = scrape_until(aggregator, "gradwatch_rank_steps_total", 1.0, job_id="nan", rank="0")
    assert math.isnan(value(text, "gradwatch_rank_grad_norm", job_id="nan", rank="0"))
    assert value(text, "gradwatch_rank_grad_norm", job_id="nan", rank="1") == math.inf
    assert "+Inf" in [line.split()[-1] for line in text.splitlines() if line.startswith('gradwatch_rank_grad_norm{') and 'rank="1"' in line]
    assert value(text, "gradwatch_rank_nonfinite_steps_total", job_id="nan", rank="0") == 1
    assert value(text, "gradwatch_rank_nonfinite_steps_total", job_id="nan", rank="1") == 1
    assert value(text, "gradwatch_rank_grad_nonfinite_params", job_id="nan", rank="0") == 3
    assert_counters_finite(text)

    # a probed step whose statistics hold NaN and Inf: layer gauges carry them, counters do not
    for r in ranks:
        p = probe_arrays(len(SLOTS), len(PARAMS), r.rank)
        p["act"][1, 0] = np.nan  # a real NaN mean on fc1 (its count stays finite)
        p["act"][1, 5] = 7
        p["act"][3, 3] = np.inf
        p["param"][1, 0] = np.inf
        r.report(5, grad_norm=math.nan if r.rank == 0 else 2.0, grad_nonfinite=1, probe=p)
    text = scrape_until(aggregator, "gradwatch_rounds_total", 1.0, job_id="nan", outcome="complete")
    assert math.isnan(value(text, "gradwatch_layer_activation_mean", job_id="nan", layer="fc1", agg="median"))
    assert value(text, "gradwatch_layer_activation_max", job_id="nan", layer="fc2", agg="max") == math.inf
    assert value(text, "gradwatch_layer_grad_norm", job_id="nan", layer="fc1", agg="max") == math.inf
    assert value(text, "gradwatch_rank_nonfinite_steps_total", job_id="nan", rank="0") == 2
    assert value(text, "gradwatch_rank_nonfinite_steps_total", job_id="nan", rank="1") == 2
    assert_counters_finite(text)

    # recovery: a finite step brings the gauge back, the counter keeps its count
    for r in ranks:
        r.report(6, grad_norm=0.5)
    text = scrape_until(aggregator, "gradwatch_rank_grad_norm", 0.5, job_id="nan", rank="0")
    assert value(text, "gradwatch_rank_nonfinite_steps_total", job_id="nan", rank="0") == 2
    assert_counters_finite(text)
    promtool_clean(text)


# --- (d) rounds: complete, incomplete, aggregates against numpy ----------------------------------


def expected_aggregates(probes: dict[int, dict]) -> dict[tuple[str, str, str], float]:
    """(metric, layer, agg) -> value, computed here from the raw arrays with numpy."""
    ranks = sorted(probes)
    act = np.stack([probes[r]["act"].astype(np.float64) for r in ranks])  # [R, L, 6]
    act_grad = np.stack([probes[r]["act_grad"].astype(np.float64) for r in ranks])  # [R, L, 2]
    param = np.stack([probes[r]["param"].astype(np.float64) for r in ranks])  # [R, P, 3]
    out = {}

    def put(metric, names, values, observed):
        for i, name in enumerate(names):
            v = values[observed[:, i], i]
            if v.size:
                out[(metric, name, "min")], out[(metric, name, "median")], out[(metric, name, "max")] = v.min(), np.median(v), v.max()

    act_seen = ~np.isnan(act[..., 5])
    for col, stat in enumerate(("mean", "std", "min", "max", "zero_ratio", "nonfinite")):
        put(f"gradwatch_layer_activation_{stat}", LAYERS, act[..., col], act_seen)
    grad_seen = ~np.isnan(act_grad[..., 1])
    put("gradwatch_layer_output_grad_norm", LAYERS, act_grad[..., 0], grad_seen)
    put("gradwatch_layer_output_grad_nonfinite", LAYERS, act_grad[..., 1], grad_seen)
    # per module: L2 over its parameters' norms, counts summed, over parameters that had a gradient
    R = len(ranks)
    g2, w2, nf = np.zeros((R, 3)), np.zeros((R, 3)), np.zeros((R, 3))
    has = np.zeros((R, 3), bool)
    for k in range(R):
        for p, m in enumerate(OWNER):
            w2[k, m] += param[k, p, 1] ** 2
            if not np.isnan(param[k, p, 2]):
                g2[k, m] += param[k, p, 0] ** 2
                nf[k, m] += param[k, p, 2]
                has[k, m] = True
    put("gradwatch_layer_grad_norm", MODULES, np.sqrt(g2), has)
    put("gradwatch_layer_weight_norm", MODULES, np.sqrt(w2), np.ones_like(has))
    put("gradwatch_layer_grad_nonfinite", MODULES, nf, has)
    for k, r in enumerate(ranks):
        out[("gradwatch_rank_activation_nonfinite", str(r), "")] = np.nansum(act[k, :, 5])
        out[("gradwatch_rank_output_grad_nonfinite", str(r), "")] = np.nansum(act_grad[k, :, 1])
        out[("gradwatch_rank_param_grad_nonfinite", str(r), "")] = np.nansum(param[k, :, 2])
    return out


def assert_aggregates(text: str, job: str, probes: dict[int, dict]) -> None:
    want = expected_aggregates(probes)
    layer_keys = [k for k in want if k[2]]
    assert len(layer_keys) > 3 * 40
    for (metric, name, agg), v in want.items():
        if agg:
            got = value(text, metric, job_id=job, layer=name, agg=agg)
        else:
            got = value(text, metric, job_id=job, rank=name)
        assert got == pytest.approx(v, rel=1e-9, abs=1e-12), (metric, name, agg)
    # an activation slot no rank observed is not exported at all
    for metric in {k[0] for k in layer_keys}:
        exported = {dict(k)["layer"] for k in samples(text, metric) if dict(k)["job_id"] == job}
        assert exported == {k[1] for k in layer_keys if k[0] == metric}, metric


@pytest.mark.ddp
def test_rounds_complete_when_every_rank_reports_and_close_incomplete_after_grace(tmp_path, push):
    grace = 2.0
    agg = start_aggregator(tmp_path, "--round-grace-s", str(grace), "--publish-interval-s", "0.05", "--proof-steps", "0")
    try:
        sock = push(agg.endpoint)  # one socket: the three reports arrive back to back
        ranks = [FakeRank(sock, "rounds", r, 3) for r in range(3)]
        probes = {r.rank: probe_arrays(len(SLOTS), len(PARAMS), 10 + r.rank) for r in ranks}
        probes[2]["act"][2, :5] = 0.0  # rank 2's ReLU did not run: a NaN count marks it not observed,
        probes[2]["act"][2, 5] = np.nan  # whatever the other columns hold
        for r in (0, 1, 2):
            probes[r]["act_grad"][0, :] = np.nan  # no rank sees the embedding's output gradient
        probes[1]["param"][0, [0, 2]] = np.nan  # rank 1's embedding had no gradient
        probes[0]["act"][4, 5] = 5  # non-finite elements count into the rank totals
        for r in ranks:
            r.schema()
        for r in ranks:
            r.report(0, probe=probes[r.rank])
        text = scrape_until(agg, "gradwatch_job_probe_step", 0.0, job_id="rounds")
        assert value(text, "gradwatch_rounds_total", job_id="rounds", outcome="complete") == 1
        assert value(text, "gradwatch_rounds_total", job_id="rounds", outcome="incomplete") == 0
        assert value(text, "gradwatch_job_world_size", job_id="rounds") == 3
        assert_aggregates(text, "rounds", probes)
        assert "emb" not in {dict(k)["layer"] for k in samples(text, "gradwatch_layer_output_grad_norm")}

        # step 5: rank 2 never reports; the round waits out its grace period, then closes incomplete
        late = {r: probe_arrays(len(SLOTS), len(PARAMS), 20 + r) for r in (0, 1)}
        t_sent = time.monotonic()
        for r in ranks[:2]:
            r.report(5, probe=late[r.rank])
        text = scrape_until(agg, "gradwatch_rank_probes_total", 2.0, job_id="rounds", rank="1")
        if time.monotonic() - t_sent < grace / 2:  # seen well within the grace period: still open
            assert value(text, "gradwatch_rounds_total", job_id="rounds", outcome="incomplete") == 0
            assert value(text, "gradwatch_job_probe_step", job_id="rounds") == 0
        text = scrape_until(agg, "gradwatch_rounds_total", 1.0, job_id="rounds", outcome="incomplete")
        assert time.monotonic() - t_sent >= grace
        assert value(text, "gradwatch_job_probe_step", job_id="rounds") == 5
        assert value(text, "gradwatch_rounds_total", job_id="rounds", outcome="complete") == 1
        assert_aggregates(text, "rounds", late)
        assert value(text, "gradwatch_rank_activation_nonfinite", job_id="rounds", rank="2") is None
    finally:
        agg.stop()


class _Kept:
    """A stand-in socket that keeps the frames sent (fed to a State by hand, no timing)."""

    def __init__(self):
        self.frames: list = []

    def send(self, frame: bytes) -> None:
        self.frames.append(frame)

    def feed(self, st) -> None:
        """Decode the frames kept into State ``st``, as the daemon's writer does, and forget them."""
        for f in self.frames:
            st.apply(wire.decode(f, schema_sizes=st.schema_sizes, known_schema=st.known_schema))
        self.frames.clear()


def test_a_round_closes_once_every_missing_rank_went_past_its_step():
    """A rank's messages come in step order: once every rank missing from a round has sent a record
    of its step or a later one (its report dropped by its agent, shed by the aggregator's intake, or
    not probed), the round waits no longer: it closes incomplete at once, not after round_grace_s."""
    from gradwatch.aggregator.state import State

    st = State(clock=lambda: 100.0)  # the clock stands still: no grace period runs out
    out = _Kept()
    ranks = [FakeRank(out, "passed", r, 3) for r in range(3)]

    def probe(r, step):
        r.report(step, probe=probe_arrays(len(SLOTS), len(PARAMS), 10 * step + r.rank))

    for r in ranks:
        r.schema()
        r.report(0)
    out.feed(st)
    job = st.jobs["passed"]
    probe(ranks[0], 5)
    probe(ranks[1], 5)
    ranks[2].report(4)  # before the probed step: its report may still come
    out.feed(st)
    assert list(job.rounds) == [5] and job.rounds_incomplete == 0
    ranks[2].report(5)  # its record of the step, without the arrays: they will not come
    out.feed(st)
    assert not job.rounds and job.rounds_incomplete == 1 and job.last_round.step == 5
    assert st.rejected == {}
    probe(ranks[0], 10)
    probe(ranks[1], 10)
    probe(ranks[2], 15)  # a later probe passes the round before it, and opens its own
    out.feed(st)
    assert list(job.rounds) == [15] and job.rounds_incomplete == 2 and job.last_round.step == 10
    probe(ranks[0], 15)
    probe(ranks[1], 15)
    out.feed(st)
    assert not job.rounds and job.rounds_complete == 1 and job.rounds_incomplete == 2


def test_a_round_only_some_ranks_probe_by_their_interval_is_partial_not_incomplete():
    """Ranks choose their probe intervals within the budget each, powers of two: one at 64 probes
    step 64, which its peers at 128 skip. That round is partial (no report lost), not incomplete:
    counted as such it would make a healthy job's incomplete share 40 % and fire IncompleteRounds.
    A round a rank's interval does include, or one missing a rank of an older agent
    (interval 0) or one never heard, stays incomplete."""
    from gradwatch.aggregator.state import State

    st = State(clock=lambda: 100.0)
    out = _Kept()
    ranks = [FakeRank(out, "intervals", r, 3) for r in range(3)]
    interval = {0: 64, 1: 128, 2: 128}

    def report(r, step, probed):
        r.report(step, probe=probe_arrays(len(SLOTS), len(PARAMS), 10 * step + r.rank) if probed else None,
                 probe_interval=interval[r.rank])

    for r in ranks:
        r.schema()
        report(r, 0, True)
    out.feed(st)
    job = st.jobs["intervals"]
    assert (job.rounds_complete, job.rounds_partial, job.rounds_incomplete) == (1, 0, 0)
    for step in range(60, 130):
        for r in ranks:
            report(r, step, step % interval[r.rank] == 0)
    out.feed(st)
    assert (job.rounds_complete, job.rounds_partial, job.rounds_incomplete) == (2, 1, 0)  # 64 partial; 128 complete
    from gradwatch.aggregator.exporter import SnapshotCollector
    from gradwatch.aggregator.snapshot import snapshot

    snap = snapshot(st, 1000.0)
    (fam,) = [f for f in SnapshotCollector(lambda: snap).collect() if f.name == "gradwatch_rounds"]
    got = {s.labels["outcome"]: s.value for s in fam.samples if s.name.endswith("_total")}
    assert got == {"complete": 2.0, "partial": 1.0, "incomplete": 0.0}
    interval[2] = 64  # rank 2 now probes every 64th step too, but its report of 192 never comes
    for step in range(130, 200):
        for r in ranks:
            report(r, step, step % interval[r.rank] == 0 and not (r.rank == 2 and step == 192))
    out.feed(st)
    assert (job.rounds_complete, job.rounds_partial, job.rounds_incomplete) == (2, 1, 1)
    interval.update({1: 0, 2: 0})  # older agents: an interval unknown
    for step in range(200, 257):
        for r in ranks:
            report(r, step, step % 64 == 0 and r.rank == 0)
    out.feed(st)
    assert (job.rounds_complete, job.rounds_partial, job.rounds_incomplete) == (2, 1, 2)  # 256 incomplete


def test_mesh_ranks_share_one_schema_and_are_placed_by_their_headers():
    """The ranks of a device mesh send one schema under one hash (their coordinates travel in their
    headers, not in it): the state keeps that schema once, places each rank on its mesh by the
    coordinates its header gives (a placed copy sharing the schema's lists), keeps another stage's
    schema apart, drops a forgotten rank's place with it, and rejects a header whose coordinates
    the schema's mesh lacks (bad_coord) without changing anything."""
    from gradwatch.aggregator.state import State

    now = [100.0]
    st = State(clock=lambda: now[0], rank_ttl_s=30)
    out = _Kept()
    other = PARAMS[:-1] + (("fc2.bias", (5,), "float32"),)  # rank 3: another layout (another stage)
    ranks = [FakeRank(out, "mesh", r, 4, params=other if r == 3 else PARAMS) for r in range(4)]
    mesh, shard = wire.Mesh(("dp", "tp"), (2, 2)), tuple((1,) for _ in PARAMS)
    for r in ranks:
        r.coord = (r.rank // 2, r.rank % 2)
        r.mesh_schema(mesh, shard)
        r.report(0)

    out.feed(st)
    job = st.jobs["mesh"]
    assert st.rejected == {} and job.admitted
    assert ranks[0].digest == ranks[1].digest == ranks[2].digest != ranks[3].digest
    placed = [job.schemas[job.ranks[r.rank].schema] for r in ranks]
    assert [s.mesh.coord for s in placed] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s.hash for s in placed] == [f"{r.digest}@{r.rank // 2},{r.rank % 2}" for r in ranks]
    assert placed[0].params is placed[1].params is placed[2].params is job.schemas[ranks[0].digest].params
    assert placed[3].params == other
    assert sorted(job.schemas) == sorted([ranks[0].digest, ranks[3].digest] + [s.hash for s in placed])
    # a report whose header is off the mesh: rejected, nothing changes
    ranks[1].coord = (0, 2)
    before = (job.ranks[1].steps, job.ranks[1].received, dict(job.schemas))
    ranks[1].report(1)
    out.feed(st)
    assert st.rejected == {"bad_coord": 1}
    assert (job.ranks[1].steps, job.ranks[1].received, dict(job.schemas)) == before
    ranks[1].coord = (0, 1)
    now[0] += 20  # ranks 0-2 speak; rank 3 stays silent, 35 s by the second scan (rank_ttl_s 30)
    for r in ranks[:3]:
        r.heartbeat(0)
    out.feed(st)
    st.tick()  # the TTL scan
    assert sorted(job.ranks) == [0, 1, 2, 3]
    now[0] += 15
    for r in ranks[:3]:
        r.heartbeat(0)
    out.feed(st)
    st.tick()
    assert sorted(job.ranks) == [0, 1, 2]
    assert sorted(job.schemas) == sorted([ranks[0].digest] + [s.hash for s in placed[:3]])  # rank 3's went


def test_frames_naming_a_placed_key_or_off_the_mesh_change_nothing():
    """A placed schema's key (``<hash>@coords``) is the aggregator's own: a message naming one as
    its schema is rejected (unknown_schema), and never placed again; a frame whose coordinates
    its schema's mesh lacks is rejected (bad_coord) before it could vote for a restart, take a
    slot or keep a schema."""
    from gradwatch.aggregator.state import State

    st = State(clock=lambda: 100.0)
    out = _Kept()
    ranks = [FakeRank(out, "mesh", r, 2) for r in range(2)]
    mesh = wire.Mesh(("tp",), (2,))
    for r in ranks:
        r.coord = (r.rank,)
        r.mesh_schema(mesh, tuple((0,) for _ in PARAMS))
        r.report(0)

    out.feed(st)
    job = st.jobs["mesh"]
    key = job.ranks[1].schema
    assert key == f"{ranks[1].digest}@1" and st.rejected == {}
    assert st.known_schema(ranks[1].header(), key) is None and st.schema_sizes(ranks[1].header(), key) == (None, None)
    held = (sorted(job.schemas), job.ranks[1].schema, job.ranks[1].steps)
    ranks[1].digest = key  # a report, and a heartbeat, naming the placed key
    ranks[1].report(1)
    ranks[1].send(wire.Heartbeat(ranks[1].header(), 1, 9, 0, 0, schema=key))
    out.feed(st)
    assert st.rejected == {"unknown_schema": 2}
    assert (sorted(job.schemas), job.ranks[1].schema, job.ranks[1].steps) == held  # nothing nested, nothing moved
    # a new boot of another world, off the mesh: no vote, no restart
    ghost = FakeRank(out, "mesh", 3, 4)  # a rank the job has not heard (rank 1 would be a boot_conflict)
    ghost.coord, ghost.digest = (5,), ranks[0].digest
    ghost.report(0)
    out.feed(st)
    assert st.rejected["bad_coord"] == 1 and job.votes == {} and st.jobs["mesh"] is job and job.world == 2


def test_the_daemon_logs_a_job_once_when_admitted_and_once_when_gone(caplog):
    """On-call sees a job arrive and leave in the aggregator's log: one line when it is proven
    (its ranks showed steps), none for a pending id a stray frame made, one when its ranks
    went silent past rank_ttl_s."""
    import logging

    from gradwatch.aggregator.config import load
    from gradwatch.aggregator.daemon import Aggregator

    now = [100.0]
    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_host="127.0.0.1", metrics_port=0, rank_ttl_s=30),
                     clock=lambda: now[0])
    out = _Kept()
    ranks = [FakeRank(out, "train\nfake line", r, 2) for r in range(2)]
    caplog.set_level(logging.INFO, logger="gradwatch.aggregator")
    FakeRank(out, "stray", 0, 2).heartbeat()  # a pending job: never admitted, never logged
    for r in ranks:
        r.schema()
        for step in range(3):  # proven
            r.report(step)
    for f in out.frames:
        agg.handle(f)
    agg.publish()
    agg.publish()  # once
    def lines():
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("gradwatch aggregator: job")]

    assert lines() == ["gradwatch aggregator: job 'train\\nfake line' reporting, world 2"]  # a peer's text, quoted
    now[0] += 31
    agg.state.tick()
    agg.publish()
    assert lines()[1:] == ["gradwatch aggregator: job 'train\\nfake line' gone"]


def test_a_second_job_under_a_live_jobs_id_is_logged_with_its_label_and_why(caplog):
    """A relaunch after a crash (no goodbye, a new key) or another job with the same id reports as
    ID~xxxx: its admission line warns, naming the id, the label and GRADWATCH_JOB_KEY (the label
    alone would not say why)."""
    import logging

    from gradwatch.aggregator.config import load
    from gradwatch.aggregator.daemon import Aggregator

    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_host="127.0.0.1", metrics_port=0), clock=lambda: 100.0)
    out = _Kept()
    caplog.set_level(logging.INFO, logger="gradwatch.aggregator")
    for key in ("first-launch", "relaunch"):
        for r in [FakeRank(out, "train", k, 2, key=key) for k in range(2)]:
            r.schema()
            for step in range(3):  # proven
                r.report(step)
    for f in out.frames:
        agg.handle(f)
    agg.publish()
    (label,) = [j for j in agg.state.jobs if j != "train"]
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("gradwatch aggregator: job")]
    assert said[0] == ("INFO", "gradwatch aggregator: job 'train' reporting, world 2")
    assert said[1][0] == "WARNING" and f"job 'train' reporting, world 2, as {label!r}" in said[1][1]
    assert "GRADWATCH_JOB_KEY" in said[1][1] and len(said) == 2


@pytest.mark.ddp  # a process of its own
def test_the_daemon_says_which_signal_stopped_it(tmp_path):
    agg = start_aggregator(tmp_path)
    agg.stop()  # SIGTERM, as systemd and Kubernetes stop it
    assert agg.proc.returncode == 0
    assert "gradwatch aggregator: stopping on SIGTERM" in agg.log.read_text()


# --- (e) C38: start-up errors name the setting ----------------------------------------------------


def run_aggregator(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradwatch.aggregator", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.ddp
@pytest.mark.parametrize("args, says, not_said", [
    (["--metrics-port", "70000", "--listen", "tcp://127.0.0.1:{free}"], ["metrics_port"], ["Traceback"]),
    # C38: the HTTP port in use; the error says how to pick another
    (["--metrics-host", "127.0.0.1", "--metrics-port", "{taken}", "--listen", "tcp://127.0.0.1:{free}"],
     ["metrics_port", "--metrics-port"], ["Traceback"]),
    # 192.0.2.1: TEST-NET-1 (RFC 5737), never this host's: the host is named, not the port
    (["--metrics-host", "192.0.2.1", "--metrics-port", "{free}", "--listen", "tcp://127.0.0.1:{free}"],
     ["aggregator.metrics_host"], ["metrics_port", "Traceback"]),
    (["--listen", "tcp://127.0.0.1:{taken}", "--metrics-host", "127.0.0.1", "--metrics-port", "{free}"],
     ["listen"], ["Traceback"]),
], ids=["metrics-port-out-of-range", "C38-metrics-port-in-use", "metrics-host-not-this-hosts", "listen-in-use"])
def test_start_up_errors_name_the_setting(args, says, not_said):
    """``{free}``: a free port; ``{taken}``: a port another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = run_aggregator(*(a.format(free=free_port(), taken=taken.getsockname()[1]) for a in args))
    assert run.returncode == 2, run.stderr
    assert all(s in run.stderr for s in says) and not any(s in run.stderr for s in not_said), run.stderr


@pytest.mark.parametrize("args, setting", [(["--round-grace-s", "0"], "round_grace_s"), (["--listen", "localhost:5555"], "listen"),
                                           (["--listen", "tcp://127.0.0.1"], "listen")])
@pytest.mark.ddp
def test_invalid_settings_fail_naming_them(args, setting):
    run = run_aggregator(*args, "--metrics-port", str(free_port()))
    assert run.returncode == 2 and setting in run.stderr, run.stderr


def test_a_misspelled_aggregator_variable_is_warned_about(monkeypatch, caplog):
    """GRADWATCH_AGGREGATOR_LISTN was ignored without a word (the agent warns about its own)."""
    from gradwatch.aggregator.config import load
    from gradwatch.errors import ConfigError

    monkeypatch.setenv("GRADWATCH_AGGREGATOR_LISTN", "tcp://0.0.0.0:1")
    monkeypatch.setenv("GRADWATCH_AGGREGATOR_CHECKS__SKEW_STEPS", "7")  # a nested setting, known
    monkeypatch.setenv("GRADWATCH_AGGREGATOR_METRICS_PORT", "0")
    with caplog.at_level("WARNING", logger="gradwatch.aggregator"):
        cfg = load(listen="tcp://127.0.0.1:0")
    said = [r.getMessage() for r in caplog.records if "unknown setting" in r.getMessage()]
    assert len(said) == 1 and "GRADWATCH_AGGREGATOR_LISTN" in said[0]
    assert "did you mean GRADWATCH_AGGREGATOR_LISTEN?" in said[0]
    # a nested one misspelled fails (its model takes no extra field), and the warning says the one meant
    monkeypatch.setenv("GRADWATCH_AGGREGATOR_CHECKS__SKEW_STEP", "7")
    caplog.clear()
    with caplog.at_level("WARNING", logger="gradwatch.aggregator"), pytest.raises(ConfigError, match=r"checks\.skew_step"):
        load(listen="tcp://127.0.0.1:0")
    assert any("CHECKS__SKEW_STEP is ignored (did you mean GRADWATCH_AGGREGATOR_CHECKS__SKEW_STEPS?" in r.getMessage()
               for r in caplog.records)
    assert cfg.checks.skew_steps == 7 and cfg.metrics_port == 0


@pytest.mark.ddp  # a process of its own
def test_gradwatch_aggregator_warns_about_a_misspelled_variable_too():
    """``gradwatch aggregator`` (the command, as ``python -m gradwatch.aggregator``) warns about
    GRADWATCH_AGGREGATOR_METRIC_PORT, a misspelled variable it would otherwise ignore."""
    import threading

    env = dict(os.environ, GRADWATCH_AGGREGATOR_METRIC_PORT="1")
    p = subprocess.Popen([sys.executable, "-m", "gradwatch.commands", "aggregator", "--listen", "tcp://127.0.0.1:0",
                          "--metrics-host", "127.0.0.1", "--metrics-port", "0"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list = []
    threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True).start()
    try:
        said = wait_for(lambda: [x for x in lines if "unknown setting" in x], 60, what="the warning")
        assert "GRADWATCH_AGGREGATOR_METRIC_PORT is ignored (did you mean GRADWATCH_AGGREGATOR_METRICS_PORT?" in said[0]
    finally:
        p.terminate()
        p.wait(30)


@pytest.mark.ddp
def test_unknown_flag_fails():
    run = run_aggregator("--no-such-flag", "1", "--metrics-port", str(free_port()))
    assert run.returncode != 0
    assert "no-such-flag" in run.stderr


def test_gradwatch_aggregator_help_works():
    exe = shutil.which("gradwatch", path=str(Path(sys.executable).parent)) or ""
    cmd = [exe] if exe else [sys.executable, "-m", "gradwatch.commands"]
    run = subprocess.run([*cmd, "aggregator", "--help"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    for flag in ("--listen", "--metrics-port", "--round-grace-s", "--max-message-bytes"):
        assert flag in run.stdout
    assert "waits for missing ranks" in " ".join(run.stdout.split())  # the field's description is its help


# --- (f) the aggregator runs with torch unimportable ------------------------------------------------

NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, NoTorch())
"""


@pytest.mark.ddp
def test_aggregator_runs_without_torch(tmp_path, push):
    blocked = subprocess.run([sys.executable, "-c", NO_TORCH + "import torch"], capture_output=True, text=True, timeout=30)
    assert blocked.returncode != 0 and "torch is blocked" in blocked.stderr  # the blocker works

    code = NO_TORCH + "from gradwatch.commands.cli import main\nsys.exit(main(['aggregator', *sys.argv[1:]]))"
    agg = start_aggregator(tmp_path, "--publish-interval-s", "0.05", "--proof-steps", "0", command=[sys.executable, "-c", code], cwd=ROOT)
    try:
        r = FakeRank(push(agg.endpoint), "notorch", 0, 1)
        r.schema()
        r.report(0, probe=probe_arrays(len(SLOTS), len(PARAMS), 1))
        text = scrape_until(agg, "gradwatch_rounds_total", 1.0, job_id="notorch", outcome="complete")
        assert value(text, "gradwatch_layer_activation_std", job_id="notorch", layer="fc1", agg="max") is not None
    finally:
        agg.stop()
    assert agg.proc.returncode == 0, agg.tail()
    assert "Traceback" not in agg.log.read_text()


# --- (g) promtool lint on a real 2-rank demo run ------------------------------------------------------


def promtool_clean(text: str) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed")
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and lint.stdout.strip() == "" and lint.stderr.strip() == "", lint.stdout + lint.stderr


@pytest.mark.ddp
@pytest.mark.stack
def test_promtool_check_metrics_is_clean_after_a_real_demo_run(aggregator):
    """Two DDP ranks (child processes of the demo) report to the aggregator; only it serves HTTP
    (C38: that no rank opens an HTTP port is checked statically in test_layout.py)."""
    cmd = [sys.executable, "-m", "gradwatch.commands", "demo", "--aggregator", aggregator.endpoint, "--steps", "12",
           "--every", "5", "--no-progress", "--job", "lint", "--width", "32", "--context", "32", "--batch-size", "8", "--heads", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    text = scrape_until(aggregator, "gradwatch_job_probe_step", 10.0, job_id="lint")
    assert value(text, "gradwatch_rank_steps_total", job_id="lint", rank="1") == 12
    assert samples(text, "gradwatch_layer_grad_norm")  # per-layer series are in the linted text
    promtool_clean(text)


@pytest.mark.stack
def test_promtool_flags_a_bad_exposition():
    """The lint above can fail: promtool does flag a counter without _total."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed")
    bad = "# HELP gradwatch_things Things.\n# TYPE gradwatch_things counter\ngradwatch_things 1\n"
    lint = subprocess.run(["promtool", "check", "metrics"], input=bad, capture_output=True, text=True, timeout=60)
    assert lint.returncode != 0 or lint.stdout.strip() or lint.stderr.strip()


# --- (h) C34: label cardinality stays bounded ------------------------------------------------------


@pytest.mark.ddp
def test_C34_series_count_constant_across_steps_restarts_and_compiled_names(aggregator, push):
    """8 healthy ranks x 50 layers, every step reported, 30 probed steps; halfway, rank 3 restarts
    (new boot id) under torch.compile, its module paths normalised by the agent's own function.
    Once the checks have data, the set of series never changes, and nothing that grows (a step, a
    pid, an address, a boot id) is ever a label value. While the restarted rank rebuilds its history
    a per-rank check value may go missing for a while ("not enough data"), but no series appears."""
    from gradwatch.agent.hooks import normalise  # the agent's own normalisation of module paths

    n_ranks, n_blocks = 8, 25
    raw_modules = [f"blocks.{b}.{part}" for b in range(n_blocks) for part in ("attn", "mlp")]  # 50 layers

    def layout(prefix: str):
        names = [normalise(prefix + m) for m in raw_modules]
        params = tuple((f"{n}.{w}", (4, 4) if w == "weight" else (4,), "float32") for n in names for w in ("weight", "bias"))
        slots = tuple((n, "", "Linear", "float32") for n in names)
        return params, slots

    params, slots = layout("")
    compiled = layout("_orig_mod.")  # what a torch.compile'd model's named_modules() yields
    assert compiled == (params, slots), "normalise must strip torch.compile's _orig_mod. prefix"

    def healthy_probe(k: int, rank: int) -> dict:
        """Gradients and weights agree across ranks (after all-reduce); activations differ by 1%."""
        p = probe_arrays(len(slots), len(params), k)
        p["act"][:, :4] *= 1 + 0.01 * rank
        return p

    sock = push(aggregator.endpoint)
    ranks = [FakeRank(sock, "wide", r, n_ranks, params, slots, every=5) for r in range(n_ranks)]
    for r in ranks:
        r.schema()
        r.heartbeat()
    step0, every, n_probes, restart_at, warm, settle = 7_654_321, 5, 30, 15, 5, 5
    keys: list[frozenset] = []
    all_values: set[str] = set()
    label_names: set[str] = set()
    for k in range(n_probes):
        step = step0 + every * k
        if k == restart_at:  # rank 3 restarts (a new process, a new boot id), now under torch.compile
            ranks[3].restart(params=compiled[0], slots=compiled[1])
            ranks[3].schema()
        for s in range(step - every + 1, step):
            for r in ranks:
                r.report(s)
        for r in ranks:
            r.report(step, probe=healthy_probe(k, r.rank))
        text = scrape_until(aggregator, "gradwatch_job_probe_step", float(step), job_id="wide")
        now = set()
        for f in text_string_to_metric_families(text):
            for smp in f.samples:
                now.add((smp.name, tuple(sorted(smp.labels.items()))))
                label_names.update(smp.labels)
                all_values.update(smp.labels.values())
                assert not ("rank" in smp.labels and "layer" in smp.labels), smp  # never rank x layer
        keys.append(frozenset(now))

    assert value(text, "gradwatch_rank_restarts_total", job_id="wide", rank="3") == 1
    assert value(text, "gradwatch_rounds_total", job_id="wide", outcome="complete") == n_probes
    steady = keys[restart_at - 1]
    counts = [len(x) for x in keys]
    for k in [*range(warm, restart_at), *range(restart_at + settle, n_probes)]:
        assert keys[k] == steady, (
            f"series changed at probe {k}: added {sorted(keys[k] - steady)[:5]}, removed {sorted(steady - keys[k])[:5]}; counts {counts}"
        )
    new = frozenset().union(*keys[warm:]) - steady
    assert not new, f"series appeared after warm-up: {sorted(new)[:10]}"

    layer_values = {dict(labels)["layer"] for name, labels in steady if name.startswith("gradwatch_layer_")}
    assert layer_values == {n for n, _, _, _ in slots}
    assert not any("_orig_mod" in v for v in all_values)
    assert {v for v in all_values if v.isdigit()} <= {str(r) for r in range(n_ranks)}
    steps_sent = {str(s) for s in range(step0 - every, step0 + every * n_probes)}
    assert not any(s in v for v in all_values for s in steps_sent), "a step number in a label value"
    pids = {str(os.getpid()), str(aggregator.proc.pid)}
    boots = {r.boot for r in ranks}
    address = re.compile(r"0x[0-9a-f]{6,}|tcp://|\d+\.\d+\.\d+\.\d+|:\d{2,5}$")
    for v in all_values:
        assert v not in pids and v not in boots and not address.search(v), f"unbounded label value {v!r}"
    assert not label_names & {"step", "pid", "boot", "seq", "host", "address", "endpoint", "instance_id"}


def test_the_findings_api_says_when_it_cannot_answer_a_query():
    """?active=yes was ignored (every event came back, as if no filter), and so was a misspelled
    parameter: both now get a 400 naming what it takes; yes/true/1 and no/false/0 are understood."""
    import requests

    from gradwatch.aggregator import Aggregator, load
    from gradwatch.aggregator.checks import Finding
    from gradwatch.aggregator.runner import Event, RunnerView
    from gradwatch.aggregator.snapshot import Snapshot

    agg = Aggregator(load(listen="tcp://127.0.0.1:0", metrics_host="127.0.0.1", metrics_port=0))
    f = Finding("straggler", "j", 5, "slow", rank=1)
    events = tuple(Event(k, 1.0 + i, "straggler", "warning", "j", 5, 1, None, "slow", {}) for i, k in enumerate(("raised", "resolved")))
    agg._snapshot = Snapshot(checks=RunnerView(active=(f,), events=events))

    def ask(q):
        return [i.get("event", "active") for i in agg.api.findings({"QUERY_STRING": q})["findings"]]

    for q in ("active=yes", "active=1", "active=TRUE", "active=1&job_id=j&check=straggler"):
        assert ask(q) == ["active"], q
    for q in ("", "active=no", "active=0", "active="):
        assert ask(q) == ["resolved", "raised"], q
    assert ask("active=1&job_id=other") == [] and ask("check=rank_silent") == []
    # an active finding says since when (its raised event's time), and every item its job_id
    (a,) = agg.api.findings({"QUERY_STRING": "active=1"})["findings"]
    assert a["since"] == 1.0 and a["job_id"] == "j"
    assert [i["job_id"] for i in agg.api.findings({"QUERY_STRING": ""})["findings"]] == ["j", "j"]
    agg.start()  # over HTTP: a query it cannot answer is a 400 saying why
    try:
        base = agg.metrics_url.rsplit("/", 1)[0] + "/api/findings"
        for q, says in (("?active=maybe", "active='maybe'"), ("?jobid=x", "unknown parameter 'jobid'"),
                        ("?check=strag", "check='strag' names no check: ")):  # a typo read as "no findings"
            r = requests.get(base + q, timeout=5)
            assert r.status_code == 400 and says in r.json()["error"], (q, r.text)
        assert requests.get(base, timeout=5).status_code == 200
    finally:
        agg.stop()
