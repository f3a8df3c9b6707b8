"""The wire format (gradwatch.wire): round trips of every message kind, and malformed input.

Pure functions, no sockets: the aggregator-side view of the same frames is in test_aggregator.py.
Cases: C30 (untrusted or oversized input), C32 (NaN/Inf transmitted as floats).
"""

from __future__ import annotations

import math
import random
import tracemalloc

import msgpack
import numpy as np
import pytest

from gradwatch import wire

PARAMS = (
    ("emb.weight", (16, 4), "float32"),
    ("fc.weight", (8, 4), "float32"),
    ("fc.bias", (8,), "float32"),
)
SLOTS = (
    ("emb", "", "Embedding", "float32"),
    ("fc", "", "Linear", "float32"),
    ("lstm", "[0]", "LSTM", "bfloat16"),
)
N_PARAMS, N_SLOTS = len(PARAMS), len(SLOTS)


def header(rank: int = 1, world: int = 4, seq: int = 7, **kw) -> wire.Header:
    return wire.Header(**{"job": "j1", "rank": rank, "world": world, "boot": "b" * 16, "seq": seq, "time": 1.7e9 + 0.25, **kw})


def schema(**kw) -> wire.Schema:
    return wire.Schema(header(), "node-1", 1, 10, kw.pop("params", PARAMS), kw.pop("slots", SLOTS), **kw)


def probe_arrays(n_slots=N_SLOTS, n_params=N_PARAMS, seed=0) -> dict:
    """Every array a probe report carries, with the shapes and dtypes the wire module documents."""
    rng = np.random.default_rng(seed)
    return dict(
        act=rng.standard_normal((n_slots, 6)).astype(np.float32),
        act_grad=rng.standard_normal((n_slots, 2)).astype(np.float32),
        param=rng.standard_normal((n_params, 3)).astype(np.float32),
        # fingerprints use all 64 bits: values above 2**63 must survive too
        fp_grad=rng.integers(0, 2**64, n_params, dtype=np.uint64, endpoint=False),
        fp_weight=rng.integers(0, 2**64, n_params, dtype=np.uint64, endpoint=False),
    )


def report(probe=True, **kw) -> wire.Report:
    base = dict(
        header=header(), schema=schema().hash, step=20, step_time=0.125, grad_norm=3.5,
        grad_nonfinite=0, micro=4, drops=2, probe=probe, local_grad_norm=2.25, compute_time=0.0625,
        batch=32, burst=True, loss=1.75, loss_scale=65536.0, skipped=1,
        agent_cost=0.0078125, probe_interval=64, over_budget=True,
    )
    if probe:
        base.update(probe_arrays())
    base.update(kw)
    return wire.Report(**base)


def heartbeat(**kw) -> wire.Heartbeat:
    return wire.Heartbeat(**{"header": header(), "step": 41, "sent": 100, "drops": 3, "errors": 1, "closing": True, **kw})


def sizes(n_params=N_PARAMS, n_slots=N_SLOTS):
    """A ``schema_sizes`` callable that knows one schema, as the aggregator's state does."""
    digest = schema().hash

    def f(h, d):
        return (n_params, n_slots) if d == digest else (None, None)

    return f


def raw(msg) -> dict:
    """The msgpack map of an encoded message, for crafting bad frames field by field."""
    return msgpack.unpackb(wire.encode(msg), raw=False)


def pack(m) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def reason_of(frame: bytes, limits: wire.Limits = wire.Limits(), schema_sizes=None) -> str:
    with pytest.raises(wire.WireError) as e:
        wire.decode(frame, limits, schema_sizes)
    assert e.value.reason in wire.REJECT_REASONS
    return e.value.reason


def same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# --- round trips -----------------------------------------------------------------------------


def test_schema_round_trip():
    s = schema()
    got = wire.decode(wire.encode(s))
    assert isinstance(got, wire.Schema)
    assert got == s
    assert got.params == PARAMS and got.slots == SLOTS  # shapes come back as tuples of ints
    assert len(got.hash) == 16 and got.hash == wire.schema_hash(PARAMS, SLOTS)


def test_schema_hash_depends_on_names_shapes_and_order():
    h = wire.schema_hash(PARAMS, SLOTS)
    assert wire.schema_hash(PARAMS, SLOTS) == h
    assert wire.schema_hash(PARAMS[::-1], SLOTS) != h
    assert wire.schema_hash(((PARAMS[0][0], (16, 5), "float32"),) + PARAMS[1:], SLOTS) != h
    assert wire.schema_hash(PARAMS, SLOTS[:2]) != h


def test_empty_schema_round_trip():
    s = schema(params=(), slots=())
    assert wire.decode(wire.encode(s)) == s


@pytest.mark.parametrize("with_sizes", [False, True])
def test_probe_report_round_trip(with_sizes):
    r = report(probe=True)
    got = wire.decode(wire.encode(r), schema_sizes=sizes() if with_sizes else None)
    assert isinstance(got, wire.Report)
    assert got == r  # the scalar fields; arrays are compared below
    for name, want in probe_arrays().items():
        a = getattr(got, name)
        assert a.dtype == want.dtype.newbyteorder("<") and a.shape == want.shape, name
        np.testing.assert_array_equal(a, want)


def test_sentinel_report_round_trip_has_no_arrays():
    r = report(probe=False)
    frame = wire.encode(r)
    assert not {"act", "act_grad", "param", "fp_grad", "fp_weight"} & set(msgpack.unpackb(frame))
    got = wire.decode(frame, schema_sizes=sizes())
    assert got == r
    assert got.act is None and got.act_grad is None and got.param is None and got.fp_grad is None


def test_heartbeat_round_trip():
    hb = heartbeat()
    assert wire.decode(wire.encode(hb)) == hb
    before_first = heartbeat(step=-1)  # -1: no step seen yet
    assert wire.decode(wire.encode(before_first)) == before_first


def test_heartbeat_run_s_round_trips_and_is_optional():
    from dataclasses import replace

    hb = replace(heartbeat(), run_s=12.5)
    assert wire.decode(wire.encode(hb)).run_s == 12.5
    # unknown (NaN) is left off the wire, and a heartbeat without it decodes as unknown
    assert b"run_s" not in wire.encode(heartbeat())
    assert math.isnan(wire.decode(wire.encode(heartbeat())).run_s)


def test_arrays_keep_nan_and_inf_bit_for_bit():
    arrays = probe_arrays()
    act, param = arrays["act"], arrays["param"]
    act[0, 0] = np.nan  # a real NaN mean, with its finite count
    act[1, :] = np.nan  # a slot that was not observed
    act[2, 3] = np.inf
    param[1, 0] = -np.inf
    got = wire.decode(wire.encode(report(**arrays)), schema_sizes=sizes())
    assert got.act.tobytes() == act.tobytes()
    assert got.param.tobytes() == param.tobytes()


@pytest.mark.parametrize(
    "grad_norm, step_time",
    [(math.nan, 0.5), (math.inf, 0.5), (-math.inf, math.inf), (np.float32("nan"), np.float64("inf")), (np.float64("nan"), np.float32("inf"))],
)
def test_nan_and_inf_scalars_are_transmitted_as_floats_C32(grad_norm, step_time):
    """C32: NaN/Inf are sent as msgpack floats (not strings, not dropped), also from numpy scalars."""
    r = report(
        probe=False, grad_norm=grad_norm, step_time=step_time, grad_nonfinite=np.int64(3),
        local_grad_norm=grad_norm, compute_time=math.nan,
    )
    frame = wire.encode(r)
    m = msgpack.unpackb(frame)
    for key in ("grad_norm", "step_time", "local_grad_norm", "compute_time"):
        assert type(m[key]) is float, key
    assert type(m["grad_nonfinite"]) is int and m["grad_nonfinite"] == 3
    got = wire.decode(frame)
    assert same_float(got.grad_norm, float(grad_norm))
    assert same_float(got.local_grad_norm, float(grad_norm))
    assert same_float(got.step_time, float(step_time))
    assert math.isnan(got.compute_time)
    assert math.copysign(1, got.grad_norm) == math.copysign(1, float(grad_norm)) or math.isnan(got.grad_norm)


@pytest.mark.parametrize("msg", [schema(), report(), report(probe=False), heartbeat()], ids=["schema", "probe", "report", "heartbeat"])
def test_every_message_carries_the_protocol_version_and_header(msg):
    m = raw(msg)
    assert m["v"] == wire.PROTOCOL_VERSION
    assert m["kind"] in ("schema", "report", "heartbeat")
    assert {"job", "rank", "world", "boot", "seq", "time"} <= set(m)


def test_encode_rejects_arrays_of_the_wrong_shape():
    a = probe_arrays()
    with pytest.raises(ValueError):
        wire.encode(report(act=a["act"][:, :5]))
    with pytest.raises(ValueError):
        wire.encode(report(param=a["param"].reshape(-1)))
    with pytest.raises(ValueError):
        wire.encode(report(fp_grad=a["fp_grad"][:-1]))
    with pytest.raises(TypeError):
        wire.encode({"v": 1})


# --- malformed input (C30) --------------------------------------------------------------------


def assert_rejected_without_allocating(frame: bytes, want: str, limits=wire.Limits()):
    tracemalloc.start()
    try:
        assert reason_of(frame, limits) == want
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"decoding a {len(frame)}-byte frame allocated {peak} bytes"


def test_C30a_header_announcing_huge_array_is_rejected_unallocated():
    assert_rejected_without_allocating(b"\xdd\xff\xff\xff\xff", "malformed")  # array32, 2**32-1 elements
    assert_rejected_without_allocating(b"\xdf\xff\xff\xff\xff", "malformed")  # map32, 2**32-1 pairs
    # the same claim inside an otherwise plausible message
    assert_rejected_without_allocating(b"\x82\xa1v\x01\xa6params\xdd\xff\xff\xff\xff" + b"\x00" * 8, "malformed")
    # raising the frame cap does not reopen the hole: the element caps still hold
    big = wire.Limits(max_message_bytes=1 << 30)
    assert_rejected_without_allocating(b"\xdd\xff\xff\xff\xff", "malformed", big)


def test_C30b_200MB_bin_header_with_10_bytes_of_body_is_rejected_unallocated():
    claim = (200 * 2**20).to_bytes(4, "big")
    assert_rejected_without_allocating(b"\xc6" + claim + b"x" * 10, "malformed")
    inside_a_map = b"\x83\xa1v\x01\xa4kind\xa6report\xa3act\xc6" + claim + b"x" * 10
    assert_rejected_without_allocating(inside_a_map, "malformed")
    assert_rejected_without_allocating(inside_a_map, "malformed", wire.Limits(max_message_bytes=1 << 30))


def test_C30c_valid_5MB_probe_message_accepted_by_default_and_too_large_under_smaller_limits():
    n_slots, n_params = 80_000, 80_000
    arrays = probe_arrays(n_slots, n_params, seed=3)
    frame = wire.encode(report(**arrays))
    assert 4.5 * 2**20 < len(frame) < 6 * 2**20
    got = wire.decode(frame, schema_sizes=sizes(n_params, n_slots))
    assert got.act.shape == (n_slots, 6) and got.param.shape == (n_params, 3)
    np.testing.assert_array_equal(got.act_grad, arrays["act_grad"])
    np.testing.assert_array_equal(got.fp_weight, arrays["fp_weight"])
    assert reason_of(frame, wire.Limits(max_message_bytes=4 * 2**20)) == "too_large"
    assert reason_of(frame, wire.Limits(max_message_bytes=len(frame) - 1)) == "too_large"
    assert isinstance(wire.decode(frame, wire.Limits(max_message_bytes=len(frame))), wire.Report)


def test_C30d_random_bytes_only_ever_raise_WireError():
    reasons = set()
    for seed in range(3000):
        rng = random.Random(seed)
        frame = rng.randbytes(rng.randint(0, 200))
        try:
            wire.decode(frame)
        except wire.WireError as e:
            assert e.reason in wire.REJECT_REASONS
            reasons.add(e.reason)
        # anything but WireError propagates and fails the test
    assert {"malformed", "extra_data"} <= reasons


def test_C30d_mutated_valid_messages_only_ever_raise_WireError():
    """Bit flips, cuts and insertions in real frames reach the field checks, not just msgpack."""
    frames = [wire.encode(m) for m in (schema(), report(), report(probe=False), heartbeat())]
    reasons = set()
    for seed in range(4000):
        rng = random.Random(seed)
        f = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 3)):
            i, op = rng.randrange(len(f)), rng.random()
            if op < 0.5:
                f[i] = rng.randrange(256)
            elif op < 0.75:
                del f[i : i + rng.randint(1, 8)]
            else:
                f[i:i] = rng.randbytes(rng.randint(1, 8))
        try:
            msg = wire.decode(bytes(f), schema_sizes=sizes())
        except wire.WireError as e:
            reasons.add(e.reason)
        else:
            assert isinstance(msg, (wire.Schema, wire.Report, wire.Heartbeat))
    assert {"malformed", "missing_field", "bad_field"} <= reasons


def test_C30d_deep_nesting_and_odd_top_level_values():
    assert reason_of(b"\x91" * 100_000 + b"\x00") == "malformed"  # stack depth, not recursion in Python
    assert reason_of(b"") == "malformed"
    assert reason_of(b"\xc1") == "malformed"  # the one never-used msgpack byte
    assert reason_of(pack([1, 2, 3])) == "not_a_map"
    assert reason_of(pack(3.5)) == "not_a_map"
    assert reason_of(pack({1: 2})) == "malformed"  # non-string map key
    assert reason_of(pack({"v": 1, "x": msgpack.ExtType(1, b"ab")})) == "malformed"


def test_C30e_two_concatenated_messages_in_one_frame_are_extra_data():
    one = wire.encode(heartbeat())
    assert reason_of(one + one) == "extra_data"
    assert reason_of(one + b"\x00") == "extra_data"
    assert isinstance(wire.decode(one), wire.Heartbeat)


def test_oversized_strings_and_name_lists_are_capped():
    limits = wire.Limits(max_names=10, max_str_bytes=64)
    long_name = (("x" * 65, (1,), "float32"),)
    assert reason_of(wire.encode(schema(params=long_name)), limits) == "malformed"
    many = tuple((f"p{i}", (1,), "float32") for i in range(11))
    assert reason_of(wire.encode(schema(params=many)), limits) == "malformed"
    assert isinstance(wire.decode(wire.encode(schema(params=many[:10])), limits), wire.Schema)


@pytest.mark.parametrize(
    "change, want",
    [
        (lambda m: m.update(v=2), "version"),
        (lambda m: m.update(v="1"), "version"),
        (lambda m: m.pop("v"), "version"),
        (lambda m: m.update(kind="metrics"), "unknown_kind"),
        (lambda m: m.pop("kind"), "unknown_kind"),
        (lambda m: m.pop("seq"), "missing_field"),
        (lambda m: m.pop("job"), "missing_field"),
        (lambda m: m.pop("sent"), "missing_field"),
        (lambda m: m.update(seq=True), "bad_field"),  # bool where int
        (lambda m: m.update(rank=False), "bad_field"),
        (lambda m: m.update(seq=-1), "bad_field"),
        (lambda m: m.update(seq=1.0), "bad_field"),  # float where int
        (lambda m: m.update(rank=4), "bad_field"),  # rank >= world (4)
        (lambda m: m.update(rank=-1), "bad_field"),
        (lambda m: m.update(world=0), "bad_field"),
        (lambda m: m.update(job=""), "bad_field"),
        (lambda m: m.update(job="j" * 257), "bad_field"),
        (lambda m: m.update(job=7), "bad_field"),
        (lambda m: m.update(boot="b" * 65), "bad_field"),
        (lambda m: m.update(time=math.nan), "bad_field"),
        (lambda m: m.update(time=True), "bad_field"),
        (lambda m: m.update(time="now"), "bad_field"),
        (lambda m: m.update(sent=-5), "bad_field"),
        (lambda m: m.update(errors=None), "bad_field"),
        (lambda m: m.update(closing=1), "bad_field"),
    ],
)
def test_bad_header_and_heartbeat_fields_are_rejected_with_reason(change, want):
    m = raw(heartbeat())
    change(m)
    assert reason_of(pack(m)) == want


@pytest.mark.parametrize(
    "change, want",
    [
        (lambda m: m.update(hash="0" * 16), "bad_field"),  # schema hash mismatch
        (lambda m: m["params"].append(["extra.weight", [2], "float32"]), "bad_field"),  # contents no longer match the hash
        (lambda m: m.update(params=[["w", [2, True], "float32"]]), "bad_field"),  # bool dimension
        (lambda m: m.update(params=[["w", [-2], "float32"]]), "bad_field"),
        (lambda m: m.update(params=[["w", [2]]]), "bad_field"),
        (lambda m: m.update(slots=[["fc", "", "Linear"]]), "bad_field"),
        (lambda m: m.update(slots=[["fc", 0, "Linear", "float32"]]), "bad_field"),
        (lambda m: m.update(params={"w": 1}), "bad_field"),
        (lambda m: m.update(every=-1), "bad_field"),
        (lambda m: m.update(local_rank=True), "bad_field"),
        (lambda m: m.pop("slots"), "missing_field"),
        (lambda m: m.pop("hash"), "missing_field"),
        (lambda m: m.pop("host"), "missing_field"),
    ],
)
def test_bad_schema_fields_are_rejected_with_reason(change, want):
    m = raw(schema())
    change(m)
    assert reason_of(pack(m)) == want


@pytest.mark.parametrize(
    "change, want",
    [
        (lambda m: m.update(step=-1), "bad_field"),
        (lambda m: m.update(step=True), "bad_field"),
        (lambda m: m.update(probe=1), "bad_field"),  # int where bool
        (lambda m: m.update(grad_norm="nan"), "bad_field"),
        (lambda m: m.update(grad_nonfinite=-1), "bad_field"),
        (lambda m: m.update(micro=1.5), "bad_field"),
        (lambda m: m.update(schema=123), "bad_field"),
        (lambda m: m.update(act=list(range(12))), "bad_field"),  # array not sent as bytes
        (lambda m: m.pop("param"), "missing_field"),
        (lambda m: m.pop("step_time"), "missing_field"),
        (lambda m: m.update(act=m["act"][:-4]), "bad_array"),  # not a multiple of the row width (24 bytes)
        (lambda m: m.update(act_grad=m["act_grad"] + b"\x00" * 4), "bad_array"),
        (lambda m: m.update(param=m["param"][:-12]), "bad_array"),  # one row short of the schema
        (lambda m: m.update(act=m["act"] + m["act"][:24], act_grad=m["act_grad"] + m["act_grad"][:8]), "bad_array"),
        (lambda m: m.update(act_grad=m["act_grad"][:-8]), "bad_array"),  # rows disagree with act's
        (lambda m: m.update(fp_grad=m["fp_grad"][:-8]), "bad_array"),  # one fingerprint per parameter
        (lambda m: m.update(fp_weight=m["fp_weight"] + b"\x00" * 8), "bad_array"),
        (lambda m: m.update(fp_grad=[1, 2, 3]), "bad_field"),
        (lambda m: m.pop("fp_weight"), "missing_field"),
        (lambda m: m.update(batch=-1), "bad_field"),
        (lambda m: m.update(burst=0), "bad_field"),
        (lambda m: m.update(local_grad_norm=None), "bad_field"),
    ],
)
def test_bad_report_fields_are_rejected_with_reason(change, want):
    m = raw(report())
    change(m)
    assert reason_of(pack(m), schema_sizes=sizes()) == want


@pytest.mark.parametrize("probe", [False, True], ids=["sentinel", "probe"])
def test_grad_norms_round_trip_bit_for_bit_and_are_checked_against_the_schema(probe):
    norms = np.array([0.1, np.nan, np.inf, 3e-39, 1e30][:N_PARAMS] + [2.5] * max(0, N_PARAMS - 5), np.float32)
    r = report(probe=probe, grad_norms=norms)
    got = wire.decode(wire.encode(r), schema_sizes=sizes())
    assert got.grad_norms.dtype == np.dtype("<f4") and got.grad_norms.tobytes() == norms.tobytes()
    assert wire.decode(wire.encode(report(probe=probe)), schema_sizes=sizes()).grad_norms is None  # optional
    m = raw(r)
    m["grad_norms"] = m["grad_norms"][:-4]  # one parameter short of the schema
    assert reason_of(pack(m), schema_sizes=sizes()) == "bad_array"
    def unknown(h, d):
        return None, None

    if probe:  # without a schema the probe's param rows set the count
        assert reason_of(pack(m), schema_sizes=unknown) == "bad_array"
    else:  # unchecked here; the check leaves norms that do not match their schema out
        assert wire.decode(pack(m), schema_sizes=unknown).grad_norms.shape == (N_PARAMS - 1,)
    m["grad_norms"] = b"\x00" * 3  # not whole floats
    assert reason_of(pack(m)) == "bad_array"
    m["grad_norms"] = [1.0] * N_PARAMS  # not bytes
    assert reason_of(pack(m), schema_sizes=sizes()) == "bad_field"


def test_probe_row_counts_are_checked_only_against_a_known_schema():
    """Row counts come from the schema_sizes callable; an unknown schema leaves them unchecked here
    (the aggregator then counts the report as unknown_schema)."""
    frame = wire.encode(report(**probe_arrays(n_slots=N_SLOTS + 2, n_params=N_PARAMS + 1)))
    assert reason_of(frame, schema_sizes=sizes()) == "bad_array"
    assert wire.decode(frame, schema_sizes=lambda h, d: (None, None)).act.shape == (N_SLOTS + 2, 6)
    assert wire.decode(frame).param.shape == (N_PARAMS + 1, 3)
    # the callable is asked with the report's header and schema hash
    seen = []
    wire.decode(frame, schema_sizes=lambda h, d: seen.append((h.rank, h.job, d)) or (N_PARAMS + 1, N_SLOTS + 2))
    assert seen == [(1, "j1", schema().hash)]


def test_wire_error_is_a_value_error_with_bounded_reason():
    e = wire.WireError("bad_field", "seq < 0")
    assert isinstance(e, ValueError) and e.reason == "bad_field" and "seq < 0" in str(e)
    assert len(set(wire.REJECT_REASONS)) == len(wire.REJECT_REASONS)


def test_a_resent_schema_with_a_known_hash_is_not_parsed_again():
    """The aggregator passes the schemas it holds: a resend with a known hash reuses their lists,
    which the bogus lists of this frame prove (they would be rejected if parsed)."""
    s = schema()
    m = msgpack.unpackb(wire.encode(s))
    m.update(params=[["bogus"]], slots=[[1]], seq=9, host="other-host")
    frame = msgpack.packb(m, use_bin_type=True)
    with pytest.raises(wire.WireError):
        wire.decode(frame)
    got = wire.decode(frame, known_schema=lambda h, digest: s if digest == s.hash else None)
    assert (got.params, got.slots, got.hash) == (s.params, s.slots, s.hash)
    assert got.header.seq == 9 and got.host == "other-host"
    assert wire.decode(wire.encode(s), known_schema=lambda h, d: None) == s  # unknown: parsed


def test_heartbeat_key_and_goodbye_reason_round_trip_and_stay_bounded():
    h = wire.Header("j1", 0, 2, "b" * 16, 3, 1.7e9, "ab" * 8)
    hb = wire.Heartbeat(h, 5, 4, 0, 0, closing=True, reason="disabled")
    assert wire.decode(wire.encode(hb)) == hb
    m = msgpack.unpackb(wire.encode(hb))
    m["reason"] = "unheard-of"
    assert wire.decode(msgpack.packb(m)).reason == "other"
    del m["key"], m["reason"]  # an agent before the key and the reason
    old = wire.decode(msgpack.packb(m))
    assert old.header.key == "" and old.reason == ""
    m["key"] = "k" * 65
    with pytest.raises(wire.WireError, match="bad_field"):
        wire.decode(msgpack.packb(m))


def test_report_from_an_agent_without_the_budget_fields():
    """Reports of agents older than the budget lack agent_cost, probe_interval and over_budget:
    they decode with NaN, 0 and False; present ones are type-checked."""
    import msgpack

    m = msgpack.unpackb(wire.encode(report(probe=False)), raw=False)
    for k in ("agent_cost", "probe_interval", "over_budget"):
        del m[k]
    got = wire.decode(msgpack.packb(m, use_bin_type=True))
    assert math.isnan(got.agent_cost) and got.probe_interval == 0 and got.over_budget is False
    m["probe_interval"] = -1
    with pytest.raises(wire.WireError):
        wire.decode(msgpack.packb(m, use_bin_type=True))
