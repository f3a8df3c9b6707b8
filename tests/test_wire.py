"""The wire format (gradwatch.wire, protocol 2): round trips of every message kind, plain msgpack
both ways, the per-step columns declared once, and malformed input.

Pure functions, no sockets: the aggregator-side view of the same frames is in test_aggregator.py.
Cases: C30 (untrusted or oversized input), C32 (NaN/Inf transmitted as floats).
"""

from __future__ import annotations

import math
import random
import tracemalloc

import msgpack
import msgspec
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
        compute_wait=0.015625, batch=32, burst=True, loss=1.75, loss_scale=65536.0, skipped=1,
        agent_cost=0.0078125, probe_interval=64, over_budget=True,
    )
    if probe:
        base.update(probe_arrays())
    base.update(kw)
    return wire.Report(**base)


def steps(n=5, first=20, **kw) -> wire.Steps:
    """``n`` unprobed records of consecutive steps from ``first``, every column set."""
    reps = [report(probe=False, step=first + i, grad_norm=3.5 + i, step_time=0.125 * (i + 1), grad_nonfinite=i % 2,
                   local_grad_norm=2.25 + i, skipped=i, **kw) for i in range(n)]
    return wire.Steps.of(reps)


ARRAY_FIELDS = frozenset(wire.PROBE_ARRAYS) | {"grad_norms", "grad_sq"}


def scalars(msg) -> dict:
    """A message's fields without its arrays (reports compare by identity: they hold numpy arrays)."""
    return {k: v for k, v in msgspec.structs.asdict(msg).items() if k not in ARRAY_FIELDS
            and not isinstance(v, np.ndarray)}


def same(a: dict, b: dict) -> bool:
    """Equal field by field, NaN equal to NaN."""
    return a.keys() == b.keys() and all(same_float(a[k], b[k]) if isinstance(a[k], float) else a[k] == b[k] for k in a)


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
    assert same(scalars(got), scalars(r))  # the scalar fields; arrays are compared below
    for name, want in probe_arrays().items():
        a = getattr(got, name)
        assert a.dtype == want.dtype.newbyteorder("<") and a.shape == want.shape, name
        np.testing.assert_array_equal(a, want)


def test_sentinel_report_round_trip_has_no_arrays():
    r = report(probe=False)
    frame = wire.encode(r)
    assert all(msgpack.unpackb(frame)[k] is None for k in ("act", "act_grad", "param", "fp_grad", "fp_weight"))
    got = wire.decode(frame, schema_sizes=sizes())
    assert same(scalars(got), scalars(r))
    assert got.act is None and got.act_grad is None and got.param is None and got.fp_grad is None
    # arrays a report that is not a probe carries anyway are not read
    m = raw(r)
    m.update(act=b"\x00" * 5)
    assert wire.decode(pack(m), schema_sizes=sizes()).act is None


def test_heartbeat_round_trip():
    hb = heartbeat(run_s=3.5)
    assert wire.decode(wire.encode(hb)) == hb
    before_first = heartbeat(step=-1)  # -1: no step seen yet; run_s unknown (NaN)
    assert same(scalars(wire.decode(wire.encode(before_first))), scalars(before_first))


def test_heartbeat_run_s_and_schema_round_trip_and_are_optional():
    hb = msgspec.structs.replace(heartbeat(), run_s=12.5, schema=schema().hash)
    got = wire.decode(wire.encode(hb))
    assert got.run_s == 12.5 and got.schema == schema().hash
    m = raw(heartbeat())
    del m["run_s"], m["schema"]  # unknown, and before the first probe
    got = wire.decode(pack(m))
    assert math.isnan(got.run_s) and got.schema == ""


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
    assert type(m["grad_norm"]) is float
    for key in ("grad_norm", "step_time", "local_grad_norm", "compute_time"):
        assert type(m[key]) is float, key
    assert type(m["grad_nonfinite"]) is int and m["grad_nonfinite"] == 3
    got = wire.decode(frame)
    assert same_float(got.grad_norm, float(grad_norm))
    assert same_float(got.local_grad_norm, float(grad_norm))
    assert same_float(got.step_time, float(step_time))
    assert math.isnan(got.compute_time)
    assert math.copysign(1, got.grad_norm) == math.copysign(1, float(grad_norm)) or math.isnan(got.grad_norm)


@pytest.mark.parametrize("msg", [schema(), report(), report(probe=False), steps(), heartbeat()],
                         ids=["schema", "probe", "report", "steps", "heartbeat"])
def test_every_message_carries_the_protocol_version_and_header(msg):
    m = raw(msg)
    assert m["v"] == wire.PROTOCOL_VERSION == 4
    assert m["kind"] in ("schema", "steps", "report", "heartbeat")
    assert set(m["header"]) == {"job", "rank", "world", "boot", "seq", "time", "key", "coord"}


def test_encode_rejects_arrays_of_the_wrong_shape():
    a = probe_arrays()
    with pytest.raises(ValueError):
        wire.encode(report(act=a["act"][:, :5]))
    with pytest.raises(ValueError):
        wire.encode(report(param=a["param"].reshape(-1)))
    with pytest.raises(ValueError):
        wire.encode(report(fp_grad=a["fp_grad"][:-1]))
    with pytest.raises(ValueError):
        wire.encode(report(act=None))  # a probe carries its arrays
    with pytest.raises(ValueError):
        wire.encode(msgspec.structs.replace(steps(), records=np.zeros((2, 2), wire.RECORD)))  # one record per step
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
    frames = [wire.encode(m) for m in (schema(), report(), report(probe=False), steps(), heartbeat())]
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
            assert isinstance(msg, (wire.Schema, wire.Report, wire.Steps, wire.Heartbeat))
    assert {"malformed", "missing_field", "bad_field", "bad_array"} <= reasons


def test_C30d_deep_nesting_and_odd_top_level_values():
    assert reason_of(b"\x91" * 100_000 + b"\x00") == "malformed"  # stack depth, not recursion in Python
    assert reason_of(b"") == "malformed"
    assert reason_of(b"\xc1") == "malformed"  # the one never-used msgpack byte
    assert reason_of(pack([1, 2, 3])) == "not_a_map"
    assert reason_of(pack(3.5)) == "not_a_map"
    assert reason_of(pack({1: 2})) == "malformed"  # non-string map key
    # a string that is not UTF-8 inside a ``kind`` of the wrong type (found by bench/fuzz.py)
    assert reason_of(b"\x82\xa1v\x02\xa4kind\x81\xa1\xff\x01") == "malformed"
    assert reason_of(b"\x82\xa1v\x02\xa4kind\x91\xa1\xff") == "malformed"
    m = raw(heartbeat())
    m["x"] = msgpack.ExtType(1, b"ab")  # an unknown key is not read, whatever it holds
    assert isinstance(wire.decode(pack(m)), wire.Heartbeat)
    m["step"] = msgpack.ExtType(1, b"ab")
    assert reason_of(pack(m)) == "bad_field"


def test_C30e_two_concatenated_messages_in_one_frame_are_extra_data():
    one = wire.encode(heartbeat())
    assert reason_of(one + one) == "extra_data"
    assert reason_of(one + b"\x00") == "extra_data"
    assert isinstance(wire.decode(one), wire.Heartbeat)


def test_oversized_strings_and_name_lists_are_capped():
    long_name = (("x" * 4097, (1,), "float32"),)  # module paths: at most 4096 characters
    assert reason_of(wire.encode(schema(params=long_name))) == "bad_field"
    limits = wire.Limits(max_names=10)
    many = tuple((f"p{i}", (1,), "float32") for i in range(11))
    assert reason_of(wire.encode(schema(params=many)), limits) == "bad_field"
    assert isinstance(wire.decode(wire.encode(schema(params=many[:10])), limits), wire.Schema)
    m = raw(schema())
    m["params"] = [["p", [1], "float32"]] * (wire.MAX_NAMES + 1)  # past the fixed cap, whatever the limits
    assert reason_of(pack(m), wire.Limits(max_names=10**6, max_message_bytes=1 << 30)) == "bad_field"
    # a shape's dims: one byte each on the wire, 8 held, so capped (a 16 MiB frame was ~130 MB held)
    deep = (("p", (1,) * wire.MAX_DIMS, "float32"),)
    assert wire.decode(wire.encode(schema(params=deep))).params == deep
    m = raw(schema(params=deep))
    m["params"][0][1] = [1] * (wire.MAX_DIMS + 1)
    assert reason_of(pack(m)) == "bad_field"
    m = raw(schema())
    m["shard"] = [[]] * (wire.MAX_NAMES + 1)  # per parameter: never more than the names' cap
    assert reason_of(pack(m), wire.Limits(max_names=10**6, max_message_bytes=1 << 30)) == "bad_field"


def _h(change):
    """A change to a frame's header map."""
    return lambda m: change(m["header"])


@pytest.mark.parametrize(
    "change, want",
    [
        (lambda m: m.update(v=1), "version"),
        (lambda m: m.update(v="2"), "version"),
        (lambda m: m.pop("v"), "version"),
        (lambda m: m.update(kind="metrics"), "unknown_kind"),
        (lambda m: m.pop("kind"), "unknown_kind"),
        (lambda m: m.pop("header"), "missing_field"),
        (_h(lambda h: h.pop("seq")), "missing_field"),
        (_h(lambda h: h.pop("job")), "missing_field"),
        (lambda m: m.pop("sent"), "missing_field"),
        (_h(lambda h: h.update(seq=True)), "bad_field"),  # bool where int
        (_h(lambda h: h.update(rank=False)), "bad_field"),
        (_h(lambda h: h.update(seq=-1)), "bad_field"),
        (_h(lambda h: h.update(seq=1.0)), "bad_field"),  # float where int
        (_h(lambda h: h.update(rank=4)), "bad_field"),  # rank >= world (4)
        (_h(lambda h: h.update(rank=-1)), "bad_field"),
        (_h(lambda h: h.update(world=0)), "bad_field"),
        (_h(lambda h: h.update(world=(1 << 20) + 1)), "bad_field"),
        (_h(lambda h: h.update(job="")), "bad_field"),
        (_h(lambda h: h.update(job="j" * 257)), "bad_field"),
        (_h(lambda h: h.update(job=7)), "bad_field"),
        (_h(lambda h: h.update(boot="b" * 65)), "bad_field"),
        (_h(lambda h: h.update(time=math.nan)), "bad_field"),
        (_h(lambda h: h.update(time=True)), "bad_field"),
        (_h(lambda h: h.update(time="now")), "bad_field"),
        (lambda m: m.update(header=[1, 2]), "bad_field"),
        (lambda m: m.update(sent=-5), "bad_field"),
        (lambda m: m.update(errors=None), "bad_field"),
        (lambda m: m.update(closing=1), "bad_field"),
        (lambda m: m.update(step=-2), "bad_field"),
        (lambda m: m.update(schema="s" * 65), "bad_field"),
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


def test_heartbeat_key_and_goodbye_reason_round_trip_and_stay_bounded():
    h = wire.Header("j1", 0, 2, "b" * 16, 3, 1.7e9, "ab" * 8)
    hb = wire.Heartbeat(h, 5, 4, 0, 0, closing=True, reason="disabled", run_s=0.0)
    assert wire.decode(wire.encode(hb)) == hb
    m = msgpack.unpackb(wire.encode(hb))
    m["reason"] = "unheard-of"
    assert wire.decode(msgpack.packb(m)).reason == "other"
    del m["header"]["key"], m["reason"]  # optional: no key, not a goodbye's reason
    old = wire.decode(msgpack.packb(m))
    assert old.header.key == "" and old.reason == ""
    m["header"]["key"] = "k" * 65
    with pytest.raises(wire.WireError, match="bad_field"):
        wire.decode(msgpack.packb(m))


def test_report_without_the_optional_fields():
    """A report may leave out agent_cost, probe_interval and over_budget: they decode as NaN, 0
    and False; present ones are type-checked."""
    import msgpack

    m = msgpack.unpackb(wire.encode(report(probe=False)), raw=False)
    for k in ("agent_cost", "probe_interval", "over_budget"):
        del m[k]
    got = wire.decode(msgpack.packb(m, use_bin_type=True))
    assert math.isnan(got.agent_cost) and got.probe_interval == 0 and got.over_budget is False
    m["probe_interval"] = -1
    with pytest.raises(wire.WireError):
        wire.decode(msgpack.packb(m, use_bin_type=True))


# --- steps: coalesced per-step records ----------------------------------------------------------


def test_steps_round_trip_every_column_bit_for_bit():
    st = steps(n=7, grad_norms=np.linspace(0, 1, N_PARAMS).astype(np.float32))
    st.records["loss"] = [1.5, np.nan, np.inf, -0.0, 2.0, 3.0, 4.0]
    got = wire.decode(wire.encode(st), schema_sizes=sizes())
    assert isinstance(got, wire.Steps) and len(got) == 7
    assert got.records.dtype == wire.RECORD and got.records.tobytes() == st.records.tobytes()
    for c in wire.STEP_COLUMNS:
        a, want = getattr(got, c.name), np.asarray(getattr(st, c.name), c.dtype)
        assert a.dtype == np.dtype(c.dtype) and a.tobytes() == want.tobytes(), c.name
    assert got.grad_norms.shape == (7, N_PARAMS) and got.grad_norms.tobytes() == st.grad_norms.tobytes()
    assert same(scalars(got), scalars(st)) and got.grad_sq is None


def test_steps_of_reports_keeps_every_records_values():
    reps = [report(probe=False, step=s, grad_norm=0.5 * s, grad_nonfinite=s % 3, compute_time=0.01 * s, loss=float(s))
            for s in (4, 5, 9)]
    got = wire.decode(wire.encode(wire.Steps.of(reps)))
    for i, r in enumerate(reps):
        for c in wire.STEP_COLUMNS:
            assert same_float(float(getattr(got, c.name)[i]), float(getattr(r, c.name))), (i, c.name)
    assert (got.drops, got.probe_interval, got.over_budget) == (reps[-1].drops, reps[-1].probe_interval, True)
    with pytest.raises(ValueError):
        wire.Steps.of([])


def test_steps_from_columns_hold_the_defaults_of_the_columns_left_out():
    got = wire.decode(wire.encode(wire.Steps.columns(header(), "h", step=[3, 4], step_time=[0.1, 0.2], grad_norm=[1.0, 2.0],
                                                      grad_nonfinite=[0, 1])))
    assert got.step.tolist() == [3, 4] and got.grad_nonfinite.tolist() == [0, 1]
    assert np.isnan(got.loss).all() and np.isnan(got.compute_time).all() and (got.skipped == 0).all()
    assert np.isnan(got.compute_wait).all()  # an agent that does not measure it
    with pytest.raises(ValueError, match="grad_norm"):
        wire.Steps.columns(header(), "h", step=[3], step_time=[0.1], grad_nonfinite=[0])
    with pytest.raises(ValueError):  # records of another layout
        wire.encode(msgspec.structs.replace(steps(), records=np.zeros(3, [("step", "<i8")])))


def test_the_cpu_wait_within_the_compute_time_travels_in_reports_and_steps():
    got = wire.decode(wire.encode(report(probe=False, compute_wait=0.003)))
    assert got.compute_wait == 0.003 and type(msgpack.unpackb(wire.encode(got))["compute_wait"]) is float
    reps = [report(probe=False, step=s, compute_time=0.02 * s, compute_wait=w) for s, w in ((1, 0.0), (2, math.nan), (3, 0.0125))]
    got = wire.decode(wire.encode(wire.Steps.of(reps)))
    assert got.compute_wait.dtype == np.dtype("<f8")
    assert got.compute_wait[0] == 0.0 and math.isnan(got.compute_wait[1]) and got.compute_wait[2] == 0.0125
    old = raw(report(probe=False))
    del old["compute_wait"]  # a report from an agent before the column
    assert math.isnan(wire.decode(pack(old)).compute_wait)


MESH = wire.Mesh(("dp", "tp"), (4, 2))


def mesh_schema(coord=(3, 1), **kw) -> wire.Schema:
    h = header(coord=coord)
    return wire.Schema(h, "node-1", 1, 10, PARAMS, SLOTS, mesh=kw.pop("mesh", MESH),
                       shard=kw.pop("shard", tuple((1,) for _ in PARAMS)), **kw)


def test_ranks_of_a_mesh_share_their_schema_hash_and_carry_their_place_in_every_header():
    """A rank's coordinates are not in its schema (nor its hash): the ranks of one stage send one
    schema; each header says where its rank is, and decodes back as sent."""
    a, b = mesh_schema((0, 0)), mesh_schema((3, 1))
    assert a.hash == b.hash != schema().hash
    assert mesh_schema(mesh=wire.Mesh(("dp", "tp"), (2, 4))).hash != a.hash  # the mesh's shape counts
    assert mesh_schema(shard=tuple((0,) for _ in PARAMS)).hash != a.hash  # and how each parameter is split
    got = wire.decode(wire.encode(b))
    assert got == b and got.header.coord == (3, 1) and got.mesh.coord == ()
    rep = wire.Report(header(coord=(3, 1)), b.hash, 5, 0.1, 1.0, 0, grad_sq=(((1,), 0.25),))
    assert wire.decode(wire.encode(rep)).header.coord == (3, 1)
    assert raw(rep)["header"]["coord"] == [3, 1]


@pytest.mark.parametrize("bad, why", [
    (lambda m: m["mesh"].update(coord=[3, 1]), "travel in its header"),  # a rank's place is not in its schema
    (lambda m: m["header"].update(coord=[4, 1]), "not a point"),  # off the mesh
    (lambda m: m["header"].update(coord=[3]), "not a point"),  # one coordinate per dimension
    (lambda m: m["header"].update(coord=[0] * 9), "coord"),  # at most 8
    (lambda m: m["mesh"].update(sizes=[4]), "names and sizes"),  # they pair up
])
def test_a_schema_whose_mesh_and_header_coordinates_disagree_is_rejected(bad, why):
    m = raw(mesh_schema())
    bad(m)
    with pytest.raises(wire.WireError, match=why) as e:
        wire.decode(pack(m))
    assert e.value.reason == "bad_field"


def test_header_coordinates_without_a_mesh_are_rejected():
    m = raw(schema())
    m["header"]["coord"] = [0, 1]
    with pytest.raises(wire.WireError, match="without a mesh") as e:
        wire.decode(pack(m))
    assert e.value.reason == "bad_field"


def test_steps_carry_sharded_sums_of_squares_per_record():
    reps = [report(probe=False, step=s, grad_sq=(((), 1.0 + s), ((0,), 2.0 * s))) for s in range(3)]
    got = wire.decode(wire.encode(wire.Steps.of(reps)))
    assert got.grad_sq_dims == ((), (0,)) and got.grad_sq.tolist() == [[1.0, 0.0], [2.0, 2.0], [3.0, 4.0]]
    m = raw(wire.Steps.of(reps))
    m["grad_sq"] = m["grad_sq"][:-8]
    assert reason_of(pack(m)) == "bad_array"
    del m["grad_sq"]  # sets of dims without their sums
    assert reason_of(pack(m)) == "missing_field"


def test_the_nan_guards_slot_round_trips_in_reports_and_steps_and_is_bounded_by_the_schema():
    """``nonfinite_slot``: a report's optional int (-1: nothing non-finite; absent: no guard), a
    steps message's int32 [n] (-1 also for a record the guard did not watch); a slot the known
    schema does not list, or below -1, is rejected by reason."""
    for slot in (None, -1, 0, N_SLOTS - 1):
        assert wire.decode(wire.encode(report(probe=False, nonfinite_slot=slot)), schema_sizes=sizes()).nonfinite_slot == slot
    m = raw(report(probe=False, nonfinite_slot=N_SLOTS))  # past the schema's slots
    assert reason_of(pack(m), schema_sizes=sizes()) == "bad_field"
    assert wire.decode(pack(m)).nonfinite_slot == N_SLOTS  # an unknown schema: the check bounds it
    for bad in (-2, 1.5, "0", wire.MAX_NAMES):
        m["nonfinite_slot"] = bad
        assert reason_of(pack(m)) == "bad_field", bad
    st = wire.Steps.of([report(probe=False, step=s, nonfinite_slot=x) for s, x in ((1, -1), (2, None), (3, 2))])
    got = wire.decode(wire.encode(st), schema_sizes=sizes())
    assert got.nonfinite_slot.dtype == np.dtype("<i4") and got.nonfinite_slot.tolist() == [-1, -1, 2]
    assert wire.Steps.of([report(probe=False)]).nonfinite_slot is None  # no guard: not sent at all
    m = raw(st)
    for bad, known in (([0, 1, N_SLOTS], True), ([0, -2, 1], False), ([0, 1], False), ([0, 1, 2.5], False)):
        m["nonfinite_slot"] = np.array(bad, "<i4" if all(isinstance(x, int) for x in bad) else "<f4").tobytes()
        if len(bad) == 3 and isinstance(bad[2], float):
            m["nonfinite_slot"] += b"\x00"  # not whole int32s
        assert reason_of(pack(m), schema_sizes=sizes() if known else None) == "bad_array", bad
    m["nonfinite_slot"] = [0, 1, 2]  # not bytes
    assert reason_of(pack(m)) == "bad_field"


def _records(steps) -> bytes:
    r = np.zeros(len(steps), wire.RECORD)
    r["step"] = steps
    return r.tobytes()


@pytest.mark.parametrize(
    "change, want",
    [
        (lambda m: m.update(records=_records([3, 2, 5])), "bad_array"),  # not increasing
        (lambda m: m.update(records=_records([3, 3, 5])), "bad_array"),
        (lambda m: m.update(records=_records([-1, 2, 5])), "bad_array"),
        (lambda m: m.update(records=b""), "bad_array"),  # no record
        (lambda m: m.update(records=m["records"][:-1]), "bad_array"),  # not whole records
        (lambda m: m.update(records=m["records"] + b"\x00" * 8), "bad_array"),
        (lambda m: m.update(records=[1.0, 2.0, 3.0]), "bad_field"),  # not bytes
        (lambda m: m.pop("records"), "missing_field"),
        (lambda m: m.update(grad_norms=b"\x00" * 4 * (3 * N_PARAMS + 1)), "bad_array"),
        (lambda m: m.update(grad_norms=b"\x00" * 4 * (3 * N_PARAMS - 3)), "bad_array"),  # one parameter short
        (lambda m: m.update(drops=-1), "bad_field"),
        (lambda m: m.update(grad_sq_dims=[[9]]), "bad_field"),  # mesh dims are 0..7
    ],
)
def test_bad_steps_fields_are_rejected_with_reason(change, want):
    m = raw(steps(n=3, grad_norms=np.ones(N_PARAMS, np.float32)))
    change(m)
    assert reason_of(pack(m), schema_sizes=sizes()) == want


def test_steps_are_capped_in_records():
    m = raw(steps(n=1))
    m["records"] = _records(np.arange(wire.MAX_STEPS + 1))
    assert reason_of(pack(m)) == "bad_array"
    m["records"] = _records(np.arange(wire.MAX_STEPS))
    assert len(wire.decode(pack(m))) == wire.MAX_STEPS


# --- declared once, plain msgpack -----------------------------------------------------------------


def test_the_step_columns_are_declared_once_for_both_messages():
    """Every column of the per-step record is a scalar field of a report and an array of a steps
    message, under one name; a report's first six fields are its positional arguments."""
    report_fields = set(wire.Report.__struct_fields__)
    assert wire.RECORD.names == tuple(c.name for c in wire.STEP_COLUMNS)  # a steps message's records
    for c in wire.STEP_COLUMNS:
        assert c.name in report_fields and wire.RECORD[c.name] == np.dtype(c.dtype)
        assert isinstance(getattr(wire.Steps, c.name), property)
    assert wire.Report.__struct_fields__[:6] == ("header", "schema", "step", "step_time", "grad_norm", "grad_nonfinite")
    assert [c.name for c in wire.STEP_COLUMNS if c.default is wire.REQUIRED] == ["step", "step_time", "grad_norm", "grad_nonfinite"]
    for kind, cls in (("schema", wire.Schema), ("steps", wire.Steps), ("report", wire.Report), ("heartbeat", wire.Heartbeat)):
        assert cls.__struct_config__.tag == kind
        # every field is documented in the module docstring
        for f in cls.__struct_fields__:
            assert f"``{f}``" in wire.__doc__ or f in ("header", "v", "act", "act_grad", "param", "act_count",
                                                       "fp_grad", "fp_weight"), (kind, f)


def _guarded_steps() -> wire.Steps:
    return wire.Steps.of([report(probe=False, step=s, nonfinite_slot=x) for s, x in ((1, -1), (2, 1))])


@pytest.mark.parametrize("msg", [schema(), report(), report(probe=False), report(probe=False, nonfinite_slot=2), steps(),
                                 _guarded_steps(), heartbeat()],
                         ids=["schema", "probe", "report", "guarded-report", "steps", "guarded-steps", "heartbeat"])
def test_frames_are_plain_msgpack_both_ways(msg):
    """msgpack-python reads what the encoder writes, and the decoder reads what msgpack-python
    writes from the same map (its own encoder, its own key order)."""
    m = msgpack.unpackb(wire.encode(msg), raw=False)
    assert m["kind"] == type(msg).__struct_config__.tag
    again = msgpack.packb(dict(reversed(list(m.items()))), use_bin_type=True)
    got = wire.decode(again, schema_sizes=sizes())
    assert type(got) is type(msg) and same(scalars(got), scalars(msg))
    for k in ARRAY_FIELDS | {c.name for c in wire.STEP_COLUMNS} | {"nonfinite_slot"}:
        a, b = getattr(got, k, None), getattr(msg, k, None)
        if isinstance(b, np.ndarray):
            assert np.asarray(a).tobytes() == np.ascontiguousarray(b, a.dtype).tobytes(), k


def test_a_schema_without_its_hash_gets_the_one_its_lists_give():
    m = raw(schema())
    del m["hash"]
    assert wire.decode(pack(m)).hash == schema().hash


def test_peek_reads_the_job_identity_alone():
    h = header(key="k1")
    for msg in (heartbeat(header=h), steps(header=h), report(header=h)):
        assert wire.peek(wire.encode(msg)) == ("j1", "k1")
    for junk in (b"", b"\xc1", pack([1]), pack({"header": 5}), b"\x91" * 10_000):
        assert wire.peek(junk) is None


def test_shed_keeps_a_probe_reports_record_and_drops_its_arrays():
    """What the aggregator's intake keeps of a frame it has no room for the bulk of. A probe
    report: the same message as the agent's unprobed report of that step (every scalar,
    grad_norms, grad_sq and the NaN guard's slot byte for byte), a fraction of the bytes. A
    schema: nothing. Any other frame, junk included: itself."""
    extra = dict(grad_norms=np.arange(N_PARAMS, dtype=np.float32) + 0.5, grad_sq=(((0,), 2.5), ((), 0.25)),
                 nonfinite_slot=2)
    full = wire.encode(report(probe=True, **extra))
    out = wire.shed(full)
    assert len(out) < len(full) - wire.probe_bytes(N_PARAMS, N_SLOTS) + 16
    got = wire.decode(out, schema_sizes=sizes())
    want = wire.decode(wire.encode(report(probe=False, **extra)), schema_sizes=sizes())
    assert type(got) is wire.Report and not got.probe
    assert same(scalars(got), scalars(want))
    assert got.grad_norms.tobytes() == want.grad_norms.tobytes() and got.grad_sq == want.grad_sq
    assert all(getattr(got, k) is None for k in wire.PROBE_ARRAYS)
    # made with msgpack-python, keys in another order: still found
    m = raw(report(probe=True))
    assert len(wire.shed(pack(dict(reversed(list(m.items())))))) < len(pack(m)) - wire.probe_bytes(N_PARAMS, N_SLOTS) + 16
    assert wire.shed(wire.encode(schema())) == b"" == wire.shed(pack(raw(schema())))
    for other in (wire.encode(report(probe=False)), wire.encode(steps()), wire.encode(heartbeat()), b"", b"\xc1",
                  pack([1]), pack({"kind": "report", "probe": 1}), b"\x91" * 10_000):
        assert wire.shed(other) is other
    # a forged map is shed as it is and left to decode, which names its fault
    bad = raw(report(probe=True))
    bad["step"] = -5
    with pytest.raises(wire.WireError) as e:
        wire.decode(wire.shed(pack(bad)))
    assert e.value.reason == "bad_field"


def test_a_resent_schema_with_a_known_hash_is_not_parsed_again():
    """The aggregator passes the schemas it holds: a resend with a known hash takes their lists,
    which the bogus lists of this frame prove (they would be rejected if parsed), under its own
    header, host, local rank and cadence; an unknown hash is parsed and checked."""
    s = schema()
    m = raw(s)
    m.update(params=[["bogus"]], slots=[[1]], host="other-host", every=3)
    m["header"]["seq"] = 9
    frame = pack(m)
    assert reason_of(frame) == "bad_field"
    got = wire.decode(frame, known_schema=lambda h, digest: s if digest == s.hash else None)
    assert (got.params, got.slots, got.hash, got.mesh, got.shard) == (s.params, s.slots, s.hash, s.mesh, s.shard)
    assert got.header.seq == 9 and got.host == "other-host" and got.every == 3
    assert wire.decode(wire.encode(s), known_schema=lambda h, d: None) == s  # unknown: parsed
    m["header"]["rank"] = 99  # a bad header is never taken for a known schema's
    assert reason_of(pack(m)) == "bad_field"
    with pytest.raises(wire.WireError):
        wire.decode(pack(m), known_schema=lambda h, d: s)
