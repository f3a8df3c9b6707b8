"""Every statistic the agent reports, checked against an independent float64 reference.

Each test trains a small, awkward model with the agent attached (``every=1``: every step is
probed), receives the real wire messages on a ZeroMQ ROUTER socket bound here, and compares every
number with a reference computed in this file: the same forward pass run again on an identical
copy of the model *without* the agent, with ``retain_grad`` / ``torch.autograd.grad`` for output
gradients, and the statistics taken in float64.

The optimizers use ``lr=0`` so the parameters (and therefore the reference) stay the same across
steps; the statistics do not depend on the learning rate.

Tolerances: float32 values are compared with ``rtol=1e-5``. Means additionally get an absolute
slack of ``1e-5 * mean(|x|)``: a float32 sum's rounding error is bounded relative to the sum of
absolute values, not to the (possibly near-zero) mean. Min, max and counts are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from gradwatch import agent, wire

if TYPE_CHECKING:
    from .conftest import Collector

pytestmark = pytest.mark.timeout(120)

RTOL = 1e-5


# --- harness: a real ROUTER socket and a view on the received messages -----------------------------




@dataclass
class Probe:
    """One probed step's report, addressable by module path and parameter name."""

    report: wire.Report
    schema: wire.Schema

    def slot(self, module: str, suffix: str = "") -> int:
        for i, s in enumerate(self.schema.slots):
            if s[0] == module and s[1] == suffix:
                return i
        raise AssertionError(f"no slot ({module!r}, {suffix!r}) in {self.schema.slots}")

    def slots_of(self, module: str) -> list[str]:
        return [s[1] for s in self.schema.slots if s[0] == module]

    def act(self, module: str, suffix: str = "") -> np.ndarray:
        return self.report.act[self.slot(module, suffix)]

    def act_grad(self, module: str, suffix: str = "") -> np.ndarray:
        return self.report.act_grad[self.slot(module, suffix)]

    def param(self, name: str) -> np.ndarray:
        names = [p[0] for p in self.schema.params]
        return self.report.param[names.index(name)]


def train(collector: Collector, model: nn.Module, step_fn, steps: int = 1, every: int = 1, between=None, opt=None):
    """Attach the agent, run ``steps`` optimizer steps (``step_fn(step)`` does forward and
    backward), and return ``(monitor, {step: Probe or Report})`` once every report arrived."""
    opt = opt or torch.optim.SGD([p for p in model.parameters()], lr=0.0)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=every, heartbeat_s=0.2)
    assert isinstance(monitor, agent.Monitor)
    try:
        for step in range(steps):
            step_fn(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if between is not None:
                between(step)
        reports = collector.wait_steps(steps)
    finally:
        monitor.close()
    assert monitor.errors == 0, "the agent counted internal errors"
    out = {}
    for step, r in reports.items():
        out[step] = Probe(r, collector.schema(r.schema)) if r.probe else r
    return monitor, out


def seeded(seed: int, cls, *args):
    """A factory building ``cls(*args)`` from ``seed``: the model and its reference start equal."""

    def make() -> nn.Module:
        torch.manual_seed(seed)
        return cls(*args)

    return make


def twin(model, factory) -> nn.Module:
    """A fresh, never-hooked copy of ``model`` (or of a saved state dict) with the same values."""
    ref = factory()
    ref.load_state_dict(model if isinstance(model, dict) else model.state_dict())
    return ref


def snapshot(model: nn.Module) -> dict:
    """Parameter values before training: a step with lr=0 still turns NaN/Inf gradients into
    NaN parameters (0 * inf), so tests with non-finite gradients take their reference from here."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- references (float64) -------------------------------------------------------------------------


def ref_act(tensors) -> dict:
    x = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    fin = torch.isfinite(x)
    return dict(
        mean=x.mean().item(),
        std=x.std(correction=0).item(),
        min=x.min().item(),
        max=x.max().item(),
        zero_ratio=(x == 0).double().mean().item(),
        nonfinite=int((~fin).sum()),
        scale=x[fin].abs().mean().item() if fin.any() else 0.0,
    )


def assert_act(row: np.ndarray, tensors, what: str = "") -> None:
    """``row`` (mean, std, min, max, zero ratio, nonfinite) against the concatenation of ``tensors``."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    want = ref_act(tensors)
    mean, std, mn, mx, zr, nf = (float(v) for v in row)
    assert nf == want["nonfinite"], (what, "nonfinite", nf, want)
    assert zr == pytest.approx(want["zero_ratio"], abs=1e-7), (what, "zero_ratio", zr, want)
    if want["nonfinite"]:
        assert not math.isfinite(mean), (what, "mean of a tensor with NaN/Inf", mean)
        return
    assert abs(mean - want["mean"]) <= RTOL * abs(want["mean"]) + 1e-5 * want["scale"], (what, "mean", mean, want)
    assert std == pytest.approx(want["std"], rel=RTOL, abs=1e-6 * want["scale"]), (what, "std", std, want)
    # min and max are elements of the float32 tensor: exact
    assert mn == want["min"], (what, "min", mn, want)
    assert mx == want["max"], (what, "max", mx, want)


def ref_norm(tensors) -> tuple[float, int]:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    x = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    return x.norm().item(), int((~torch.isfinite(x)).sum())


def assert_norm(row: np.ndarray, tensors, what: str = "") -> None:
    """``row`` = (norm, nonfinite count) of a gradient, against the float64 reference."""
    norm, nf = ref_norm(tensors)
    assert float(row[1]) == nf, (what, "nonfinite", row, nf)
    if nf:
        assert not math.isfinite(float(row[0])), (what, "norm with NaN/Inf", row)
    else:
        assert float(row[0]) == pytest.approx(norm, rel=RTOL), (what, "norm", row, norm)


def assert_not_observed(row: np.ndarray, what: str = "") -> None:
    assert math.isnan(float(row[-1])), (what, "expected a NaN count (not observed)", row)


def assert_params(p: Probe, ref_model: nn.Module, frozen: tuple = (), after: Optional[nn.Module] = None) -> None:
    """Per-parameter grad norm, weight norm and grad non-finite count, and the sentinel.

    Gradients come from ``ref_model``; weight norms are taken after the optimizer step, so they
    come from ``after`` (the trained model) when given, else from ``ref_model`` (lr=0: the same)."""
    present = []
    weights = dict((after or ref_model).named_parameters())
    for name, param in ref_model.named_parameters():
        row = p.param(name)
        w = weights[name].detach().double().norm().item()
        if math.isnan(w):
            assert math.isnan(float(row[1])), (name, "weight norm", row)
        else:
            assert float(row[1]) == pytest.approx(w, rel=RTOL), (name, "weight norm", row)
        if param.grad is None:
            assert name in frozen, (name, "reference has no grad")
            assert math.isnan(float(row[0])) and math.isnan(float(row[2])), (name, "grad should be 'not observed'", row)
            continue
        present.append(param.grad)
        assert_norm(row[[0, 2]], param.grad, name)
    norm, _ = ref_norm(present)
    n_bad = sum(int(not torch.isfinite(g).all()) for g in present)
    assert p.report.grad_nonfinite == n_bad
    if n_bad:
        assert not math.isfinite(p.report.grad_norm)
    else:
        assert p.report.grad_norm == pytest.approx(norm, rel=RTOL)


# --- (a) C04: dict, list/tuple, dataclass, None and float outputs ---------------------------------


@dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "not a tensor"


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 6) / 3)
        self.v = nn.Parameter(torch.randn(5, 4) / 3)

    def forward(self, x):
        return {"logits": x @ self.w, "aux": torch.tanh(x @ self.v), "count": 3, "mask": x > 0}


class ListOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, h, x):
        # [i] items, a nested tuple, an int tensor (skipped) and a float tensor that does not
        # require grad (its gradient is never observed)
        return [h @ self.w, (torch.relu(h), x * 2.0), torch.arange(3)]


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 3) / 3)

    def forward(self, h):
        y = h @ self.w
        return Out(logits=y, hidden=torch.sigmoid(y))


class NoneOut(nn.Module):
    def forward(self, h):
        self.seen = h.shape
        return None


class FloatOut(nn.Module):
    def forward(self, h):
        return float(h.detach().abs().max())


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = DictOut()
        self.l = ListOut()
        self.dc = DataclassOut()
        self.none = NoneOut()
        self.flt = FloatOut()

    def forward(self, x):
        d = self.d(x)
        assert isinstance(d, dict) and set(d) == {"logits", "aux", "count", "mask"}
        l = self.l(d["logits"], x)
        assert isinstance(l, list) and isinstance(l[1], tuple)
        dc = self.dc(l[0] + l[1][0])
        assert type(dc) is Out and dc.note == "not a tensor"
        assert self.none(dc.hidden) is None
        assert isinstance(self.flt(dc.hidden), float)
        return (dc.logits * dc.hidden).sum() + d["aux"].square().sum() + l[1][1].sum()


_containers = seeded(1, Containers)


def test_c04_dict_list_tuple_dataclass_none_and_float_outputs(collector):
    """C04: every floating tensor leaf of dict / list / nested tuple / dataclass outputs gets
    activation and output-gradient stats under a path suffix; None, floats, ints and bools get
    no statistics (a module with none of its own only counts its call); the user's output objects come back unchanged (asserted inside forward)."""
    model = _containers()
    x = torch.randn(7, 5)
    _, probes = train(collector, model, lambda s: model(x).backward(), steps=2)

    ref = twin(model, _containers)
    d = ref.d(x)
    for t in (d["logits"], d["aux"]):
        t.retain_grad()
    l = ref.l(d["logits"], x)
    for t in (l[0], l[1][0]):
        t.retain_grad()
    dc = ref.dc(l[0] + l[1][0])
    dc.logits.retain_grad()
    dc.hidden.retain_grad()
    ((dc.logits * dc.hidden).sum() + d["aux"].square().sum() + l[1][1].sum()).backward()

    for step in (0, 1):
        p = probes[step]
        assert p.slots_of("d") == [".logits", ".aux"]
        assert p.slots_of("l") == ["[0]", "[1][0]", "[1][1]"]
        assert p.slots_of("dc") == [".logits", ".hidden"]
        # a module without a floating output still counts its call, on a slot "" with
        # no statistics (its act row is "not observed")
        assert p.slots_of("none") == [""] and p.slots_of("flt") == [""]
        for m in ("none", "flt"):
            assert np.isnan(p.act(m)).all() and p.report.act_count[p.slot(m)].tolist() == [1, 0]
        for mod, suffix, t in [
            ("d", ".logits", d["logits"]), ("d", ".aux", d["aux"]),
            ("l", "[0]", l[0]), ("l", "[1][0]", l[1][0]),
            ("dc", ".logits", dc.logits), ("dc", ".hidden", dc.hidden),
        ]:
            assert_act(p.act(mod, suffix), t, f"{mod}{suffix}")
            assert_norm(p.act_grad(mod, suffix), t.grad, f"grad {mod}{suffix}")
        # x * 2 does not require grad: activation stats, but its gradient is "not observed"
        assert_act(p.act("l", "[1][1]"), l[1][1], "l[1][1]")
        assert_not_observed(p.act_grad("l", "[1][1]"), "l[1][1]")
        assert_params(p, ref)


# --- (b) C04: LSTM tuples and PackedSequence -----------------------------------------------------


class Recurrent(nn.Module):
    def __init__(self, packed: bool):
        super().__init__()
        self.packed = packed
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x, lengths):
        if self.packed:
            inp = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out, (h, c) = self.lstm(inp)
            assert type(out) is PackedSequence  # never rebuilt as a plain tuple
            out, _ = pad_packed_sequence(out, batch_first=True)
        else:
            out, (h, c) = self.lstm(x)
        return self.head(out).square().sum() + (h * c).sum()


@pytest.mark.parametrize("packed", [False, True], ids=["tensor", "packed"])
def test_c04_lstm_tuple_outputs_and_packed_sequence(collector, packed):
    """C04: nn.LSTM returns ``(output, (h_n, c_n))``; with a PackedSequence input ``output`` is a
    named tuple whose ``.data`` is the only floating leaf. Stats for each leaf match the reference."""
    factory = seeded(2, Recurrent, packed)
    model = factory()
    x = torch.randn(3, 5, 3)
    lengths = torch.tensor([5, 2, 4])
    _, probes = train(collector, model, lambda s: model(x, lengths).backward())

    ref = twin(model, factory)
    if packed:
        out, (h, c) = ref.lstm(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        leaf = out.data
        padded, _ = pad_packed_sequence(out, batch_first=True)
    else:
        out, (h, c) = ref.lstm(x)
        leaf = padded = out
    for t in (leaf, h, c):
        t.retain_grad()
    y = ref.head(padded)
    y.retain_grad()
    (y.square().sum() + (h * c).sum()).backward()

    p = probes[0]
    first = "[0].data" if packed else "[0]"
    assert p.slots_of("lstm") == [first, "[1][0]", "[1][1]"]
    for suffix, t in [(first, leaf), ("[1][0]", h), ("[1][1]", c)]:
        assert_act(p.act("lstm", suffix), t, f"lstm{suffix}")
        assert_norm(p.act_grad("lstm", suffix), t.grad, f"grad lstm{suffix}")
    assert_act(p.act("head"), y, "head")
    assert_norm(p.act_grad("head"), y.grad, "grad head")
    assert_params(p, ref)


# --- (c) C01: in-place ReLU and in-place residual after a hooked Linear ---------------------------


class LinReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.act(self.lin(x)))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        out = self.lin(x)
        out += x  # in-place residual on the hooked Linear's output
        return self.out(out)


def test_c01_linear_then_inplace_relu(collector):
    """C01: Linear followed by ReLU(inplace=True): no crash; the Linear's activation stats are of
    its output *before* the ReLU overwrote it (it has negatives), and its output-gradient norm is
    the gradient with respect to the pre-ReLU output."""
    factory = seeded(3, LinReLU)
    model = factory()
    x = torch.randn(8, 6)
    g = torch.randn(8, 3)
    _, probes = train(collector, model, lambda s: model(x).backward(g), steps=2)

    ref = twin(model, factory)
    h = ref.lin(x)
    h.retain_grad()
    a = torch.relu(h)  # out of place here: same values, and h keeps its pre-ReLU content
    a.retain_grad()
    y = ref.out(a)
    y.retain_grad()
    y.backward(g)
    assert h.min() < 0 and a.min() == 0  # the in-place op does change the tensor

    for step in (0, 1):
        p = probes[step]
        assert_act(p.act("lin"), h, "lin (pre in-place)")
        assert float(p.act("lin")[2]) < 0
        assert_norm(p.act_grad("lin"), h.grad, "grad lin")
        assert_act(p.act("act"), a, "relu")
        assert_norm(p.act_grad("act"), a.grad, "grad relu")
        assert_act(p.act("out"), y, "out")
        assert_norm(p.act_grad("out"), y.grad, "grad out")
        assert_params(p, ref)


def test_c01_inplace_residual_add(collector):
    """C01 variant: ``out = lin(x); out += x`` inside a block: no crash, Linear stats taken
    before the add, its output-gradient equals the reference gradient of the Linear output."""
    factory = seeded(4, Residual)
    model = factory()
    x = torch.randn(6, 5, requires_grad=True)
    _, probes = train(collector, model, lambda s: model(x).square().sum().backward())

    ref = twin(model, factory)
    h = ref.lin(x)
    h.retain_grad()
    y = ref.out(h + x)
    y.retain_grad()
    y.square().sum().backward()

    p = probes[0]
    assert_act(p.act("lin"), h, "lin (pre residual)")
    assert_norm(p.act_grad("lin"), h.grad, "grad lin")
    assert_act(p.act("out"), y, "out")
    assert_norm(p.act_grad("out"), y.grad, "grad out")
    assert_params(p, ref)


# --- (d) C19: frozen parameters, unfrozen mid-training --------------------------------------------


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.backbone(x))


def test_c19_frozen_parameters_and_unfreezing(collector):
    """C19: frozen parameters do not crash attach or the step; their gradient stats are "not
    observed" (NaN count) while their weight norm is still reported; a block unfrozen after step 1
    reports gradient stats from step 2 on."""
    factory = seeded(5, Frozen)
    model = factory()
    model.backbone.requires_grad_(False)
    x = torch.randn(5, 4)

    def unfreeze(step):
        if step == 1:
            model.backbone[2].requires_grad_(True)

    _, probes = train(collector, model, lambda s: model(x).square().sum().backward(), steps=3, between=unfreeze)

    # reference while frozen
    ref = twin(model, factory)
    ref.backbone.requires_grad_(False)
    h = ref.backbone(x)
    y = ref.head(h)
    y.retain_grad()
    y.square().sum().backward()
    frozen = tuple(n for n, _ in ref.backbone.named_parameters(prefix="backbone"))
    for step in (0, 1):
        p = probes[step]
        assert_params(p, ref, frozen=frozen)
        assert_norm(p.act_grad("head"), y.grad, "grad head")
        for m in ("backbone.0", "backbone.1", "backbone.2"):
            assert_not_observed(p.act_grad(m), m)  # outputs of frozen layers need no gradient
        assert_act(p.act("backbone.2"), h, "frozen layers still get activation stats")

    # reference after unfreezing backbone.2
    ref = twin(model, factory)
    ref.backbone.requires_grad_(False)
    ref.backbone[2].requires_grad_(True)
    h = ref.backbone(x)
    h.retain_grad()
    ref.head(h).square().sum().backward()
    p = probes[2]
    assert not math.isnan(float(p.param("backbone.2.weight")[2]))
    assert_params(p, ref, frozen=("backbone.0.weight", "backbone.0.bias"))
    assert_norm(p.act_grad("backbone.2"), h.grad, "grad backbone.2 after unfreezing")
    assert_not_observed(p.act_grad("backbone.0"))


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64) * 0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head((x.to(torch.complex64) @ self.w).abs())


@pytest.mark.parametrize("kind", ["float64", "complex"])
def test_float64_and_complex_models_are_monitored_with_exact_norms(collector, kind):
    """A float32 norm of a float64 or complex tensor is a narrowing torch refuses: the sentinel,
    the output-gradient hooks and the probe raised every step until the agent switched itself
    off. Both are monitored: each parameter's gradient norm (complex by magnitude) and the global
    norm against float64 references."""
    factory = seeded(3, lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()) if kind == "float64" \
        else seeded(3, Complex)
    model = factory()
    x = torch.randn(5, 4, dtype=torch.float64 if kind == "float64" else torch.float32)
    monitor, probes = train(collector, model, lambda s: model(x).square().sum().backward(), steps=2)
    assert not monitor.disabled  # (train asserts no error was counted)
    ref = twin(model, factory)
    ref(x).square().sum().backward()
    grads = {n: p.grad.detach() for n, p in ref.named_parameters()}
    magnitude = {n: (g.abs() if g.is_complex() else g).double() for n, g in grads.items()}
    for step in (0, 1):
        p = probes[step]
        for name, g in magnitude.items():
            assert float(p.param(name)[0]) == pytest.approx(g.norm().item(), rel=RTOL), (step, name)
        assert p.report.grad_norm == pytest.approx(torch.cat([g.reshape(-1) for g in magnitude.values()]).norm().item(), rel=RTOL)


def test_per_parameter_gradient_norms_of_weights_of_many_chunks_before_one_chunk_biases(collector):
    """Each parameter's gradient norm, through the monitor and its sender, against float64, in a
    model whose weights of 2 and 8 chunks (views and rows on the CPU) come before their biases of
    one: the sentinel's layout (which tensors went by rows, at the end) must reach the sender's
    combination, or per-parameter norms trade places while the global norm stays right."""
    from gradwatch.agent.stats import CPU_SPLIT_MAX, NORM_CHUNK, chunks_of

    factory = seeded(5, lambda: nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 300), nn.ReLU(), nn.Linear(300, 3)))
    model = factory()
    chunks = [chunks_of(p.numel()) for p in model.parameters()]
    assert chunks == [2, 1, 8, 1, 1, 1] and 1 < chunks[0] <= CPU_SPLIT_MAX < chunks[2]
    assert NORM_CHUNK < 64 * 200 < 2 * NORM_CHUNK
    x = torch.randn(4, 64)
    _, probes = train(collector, model, lambda s: model(x).square().mean().backward())
    ref = twin(model, factory)
    ref(x).square().mean().backward()
    for name, g in ref.named_parameters():
        assert float(probes[0].param(name)[0]) == pytest.approx(g.grad.double().norm().item(), rel=1e-6), name


# --- (e) C06: identity module and a multi-input module with a constant mask ------------------------


class Masked(nn.Module):
    def forward(self, mask, x):
        return mask * x


class IdentityAndMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.id = nn.Identity()
        self.lin = nn.Linear(4, 4)
        self.mask = Masked()
        self.identity_held = []

    def forward(self, x, mask):
        y = self.id(x)
        self.identity_held.append(y is x)
        return self.mask(mask, self.lin(y))


def test_c06_identity_keeps_object_identity_and_constant_mask_input(collector):
    """C06: ``id(x) is x`` with and without the agent (also inside a probed training step); a
    module whose first input is a constant mask (no grad) works and gets correct stats."""
    factory = seeded(6, IdentityAndMask)
    model = factory()
    x = torch.randn(5, 4, requires_grad=True)
    mask = (torch.rand(5, 4) > 0.5).float()
    assert not mask.requires_grad
    assert model.id(x) is x  # without the agent

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = agent.attach(model, opt, endpoint=collector.endpoint, every=1)
    try:
        assert model.id(x) is x  # with the agent (a probe is armed for step 0)
        assert model.id._forward_hooks, "the probe should hook the identity module"
    finally:
        monitor.close()
    model.identity_held.clear()
    collector.msgs.clear()

    _, probes = train(collector, model, lambda s: model(x, mask).sum().backward(), steps=2)
    assert model.identity_held == [True, True]

    ref = twin(model, factory)
    xr = x.detach().clone().requires_grad_(True)
    h = ref.lin(xr)
    h.retain_grad()
    y = mask * h
    y.retain_grad()
    y.sum().backward()
    p = probes[0]
    assert_act(p.act("id"), x, "identity")
    assert_norm(p.act_grad("id"), xr.grad, "grad identity = grad of x")
    assert_act(p.act("mask"), y, "masked")
    assert_norm(p.act_grad("mask"), y.grad, "grad masked")
    assert_norm(p.act_grad("lin"), h.grad, "grad lin")
    assert_params(p, ref)


# --- (f) C10: half precision without overflow -----------------------------------------------------


class HalfScale(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1_000_000, dtype=dtype))

    def forward(self, x):
        return self.w * x


class Half(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.scale = HalfScale(dtype)  # the root is not a leaf: hooks go on its children

    def forward(self, x):
        return self.scale(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_c10_half_precision_norms_do_not_overflow(collector, dtype):
    """C10: a half-precision parameter of 10^6 ones with a gradient of 300 everywhere, and an
    activation of 10^6 ones: 300^2 and the sum of 10^6 ones overflow float16, yet every reported
    norm and moment is finite and within 1e-3 of the float64 reference."""
    model = Half(dtype)
    x = torch.ones((), dtype=dtype)
    g = torch.full((1_000_000,), 300.0, dtype=dtype)
    assert torch.isinf((g * g).sum()) or dtype == torch.bfloat16  # the trap exists in fp16

    def step(s):
        y = model(x)
        y.backward(g)

    _, probes = train(collector, model, step)
    p = probes[0]

    grad_ref = g.double().norm().item()  # 300 * 1000
    weight_ref = model.scale.w.detach().double().norm().item()  # 1000
    assert grad_ref == pytest.approx(3e5) and weight_ref == pytest.approx(1e3)
    mean, std, mn, mx, zr, nf = (float(v) for v in p.act("scale"))
    assert (mean, mn, mx, zr, nf) == (1.0, 1.0, 1.0, 0.0, 0.0)
    assert std == pytest.approx(0.0, abs=1e-3)
    for what, got, want in [
        ("output grad norm", float(p.act_grad("scale")[0]), grad_ref),
        ("param grad norm", float(p.param("scale.w")[0]), grad_ref),
        ("weight norm", float(p.param("scale.w")[1]), weight_ref),
        ("sentinel grad norm", p.report.grad_norm, grad_ref),
    ]:
        assert math.isfinite(got), what
        assert got == pytest.approx(want, rel=1e-3), what
    assert float(p.param("scale.w")[2]) == 0 and p.report.grad_nonfinite == 0
    assert float(p.act_grad("scale")[1]) == 0


# --- (g) a module called twice in one step ---------------------------------------------------------


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.out = nn.Linear(5, 1)

    def forward(self, x):
        return self.out(self.lin(torch.tanh(self.lin(x))))


def test_module_called_twice_combines_over_both_calls(collector):
    """Weight tying: ``lin`` runs twice per step; its activation stats are those of the
    concatenation of both outputs, its output-gradient norm that of both gradients together."""
    factory = seeded(7, Tied)
    model = factory()
    x = torch.randn(9, 5) * 3 + 1
    _, probes = train(collector, model, lambda s: model(x).square().sum().backward(), steps=2)

    ref = twin(model, factory)
    h1 = ref.lin(x)
    h1.retain_grad()
    h2 = ref.lin(torch.tanh(h1))
    h2.retain_grad()
    y = ref.out(h2)
    y.retain_grad()
    y.square().sum().backward()
    for step in (0, 1):
        p = probes[step]
        assert p.slots_of("lin") == [""]
        assert_act(p.act("lin"), [h1, h2], "lin over both calls")
        assert_norm(p.act_grad("lin"), [h1.grad, h2.grad], "grad lin over both calls")
        assert_act(p.act("out"), y, "out")
        assert_params(p, ref)
        assert p.report.micro == 1


# --- NaN and Inf: exact counts ----------------------------------------------------------------------


class Inject(nn.Module):
    def forward(self, h):
        h = h.clone()
        h[0, 0] = float("nan")
        h[1, 2] = float("inf")
        return h


class Poisoned(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 5)
        self.bad = Inject()
        self.l2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.l2(self.bad(self.l1(x)))


def test_injected_nan_and_inf_counted_exactly(collector):
    """A NaN and an Inf injected into one activation, and a NaN in the incoming gradient: each
    non-finite count (activation, output gradient, parameter gradient, sentinel) is exact, and
    layers upstream that stay finite keep exact statistics."""
    factory = seeded(8, Poisoned)
    model = factory()
    x = torch.randn(4, 4)
    g = torch.randn(4, 3)
    g[2, 1] = float("nan")
    before = snapshot(model)
    _, probes = train(collector, model, lambda s: model(x).backward(g))

    ref = twin(before, factory)
    h = ref.l1(x)
    h.retain_grad()
    b = ref.bad(h)
    b.retain_grad()
    y = ref.l2(b)
    y.retain_grad()
    y.backward(g)

    p = probes[0]
    assert_act(p.act("l1"), h, "l1")
    assert float(p.act("bad")[5]) == 2
    assert_act(p.act("bad"), b, "bad")
    assert_act(p.act("l2"), y, "l2")
    assert ref_act([y])["nonfinite"] > 0
    for mod, t in (("l2", y), ("bad", b), ("l1", h)):
        assert_norm(p.act_grad(mod), t.grad, f"grad {mod}")
    assert float(p.act_grad("l2")[1]) == 1
    assert_params(p, ref, after=model)  # lr=0 still makes weights NaN after a NaN gradient
    assert p.report.grad_nonfinite == sum(int(not torch.isfinite(q.grad).all()) for q in ref.parameters())
    assert p.report.grad_nonfinite >= 2


# --- the sentinel on steps that are not probed ----------------------------------------------------


def test_sentinel_on_unprobed_steps(collector):
    """Every step carries the global gradient norm and the number of parameters with non-finite
    gradients; a step whose gradient holds an Inf is counted; unprobed steps carry no arrays."""
    factory = seeded(9, LinReLU)
    model = factory()
    xs = [torch.randn(4, 6) for _ in range(4)]

    def step(s):
        y = model(xs[s])
        g = torch.ones_like(y)
        if s == 3:
            g[0, 0] = float("inf")
        y.backward(g)

    before = snapshot(model)
    _, reports = train(collector, model, step, steps=4, every=2)
    for s in range(4):
        r = reports[s]
        r = r.report if isinstance(r, Probe) else r
        assert r.probe == (s % 2 == 0)
        if not r.probe:
            assert r.act is None and r.param is None
        ref = twin(before, factory)
        y = ref(xs[s])
        g = torch.ones_like(y)
        if s == 3:
            g[0, 0] = float("inf")
        y.backward(g)
        grads = [q.grad for q in ref.parameters()]
        n_bad = sum(int(not torch.isfinite(q).all()) for q in grads)
        assert r.grad_nonfinite == n_bad
        if n_bad:
            assert s == 3 and not math.isfinite(r.grad_norm)
        else:
            assert r.grad_norm == pytest.approx(ref_norm(grads)[0], rel=RTOL)
