"""The step frame: pack (torch, training thread) and unpack (numpy, sender thread) are inverse.

A seeded random loop over layouts like the monitor's (sentinel steps, probe steps, with and
without gradients, fingerprints, DDP buckets, losses, a loss scale, records; empty sections),
values including NaN, +-Inf and fingerprints whose bytes read as NaN floats. Then the measuring
functions of a real model through the frame, against torch computed directly.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from gradwatch.agent import frame, measure
from gradwatch.agent.fingerprint import Fingerprints, fingerprint
from gradwatch.agent.hooks import ProbeRecorder
from gradwatch.agent.stats import CPU_SPLIT_MAX, Reducer

SPECIAL = (float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 3.4e38)
# int64 whose float32 halves are NaNs (quiet and signalling), infinities, or extremes
SPECIAL_BITS = (0x7FC00000_7F800001, 0x7F800000_FF800000, -1, -(2**63), 2**63 - 1, 0, 0x00000001_7FA00000)


def floats(rng: random.Random, n: int, width: int) -> np.ndarray:
    v = np.array([rng.choice(SPECIAL) if rng.random() < 0.2 else rng.uniform(-1e6, 1e6) for _ in range(n * width)],
                 dtype=np.float32)
    return v if width == 1 else v.reshape(n, width)


def bits(rng: random.Random, n: int) -> np.ndarray:
    return np.array([rng.choice(SPECIAL_BITS) if rng.random() < 0.3 else rng.randint(-(2**63), 2**63 - 1)
                     for _ in range(n)], dtype=np.int64)


def random_layout(rng: random.Random) -> dict[str, np.ndarray]:
    """Sections the way the monitor fills them: gradient statistics only with gradients, the
    probe's only on probed steps, fingerprints only with replicas; any section may be empty."""
    n_params = rng.randint(0, 6)
    k = rng.randint(0, n_params)  # parameters with a gradient
    probe = rng.random() < 0.5
    replicas = rng.random() < 0.5
    out = {}
    if k:
        out["grad_norm"] = floats(rng, k, 1)
        out["bucket_norm"] = floats(rng, rng.randint(0, 4), 1)
        out["loss"] = floats(rng, rng.randint(0, 3), 1)
        out["loss_scale"] = floats(rng, rng.randint(0, 1), 1)
        if probe:
            out["grad_nonfinite"] = floats(rng, k, 1)
            if replicas:
                out["grad_fp"] = bits(rng, k)
    if probe:
        if n_params:
            out["weight_norm"] = floats(rng, n_params, 1)
            if replicas:
                out["weight_fp"] = bits(rng, n_params)
        out["act"] = floats(rng, rng.randint(0, 5), 6)
        out["out_grad"] = floats(rng, rng.randint(0, 5), 2)
    return out


def items(name: str, values: np.ndarray) -> list[torch.Tensor]:
    """What the monitor hands to pack: 0-d tensors, [width] records, 0-d int64 fingerprints."""
    return [torch.tensor(v) for v in values]


@pytest.mark.parametrize("seed", range(20))
def test_unpack_inverts_pack_over_random_layouts(seed):
    rng = random.Random(seed)
    for _ in range(25):
        want = random_layout(rng)
        flat, counts = frame.pack({name: items(name, v) for name, v in want.items()})
        assert flat.dtype == torch.float32 and flat.dim() == 1
        assert flat.numel() == frame.size(counts)
        got = frame.unpack(flat.numpy(), counts)
        assert set(got) == set(frame.NAMES)
        for s in frame.SECTIONS:
            v = want.get(s.name)
            if s.bits:
                expect = np.zeros(0, np.uint64) if v is None else v.view(np.uint64)
                assert got[s.name].dtype == np.uint64
                assert np.array_equal(got[s.name], expect), s.name
            else:
                shape = (0,) if s.width == 1 else (0, s.width)
                expect = np.zeros(shape) if v is None else v.astype(np.float64)
                assert got[s.name].dtype == np.float64 and got[s.name].shape == expect.shape, s.name
                # bit for bit, NaNs included (their payload survives float32 -> float64 -> float32)
                assert np.array_equal(got[s.name].astype(np.float32).view(np.uint32),
                                      expect.astype(np.float32).view(np.uint32)), s.name


def test_sections_are_packed_in_declaration_order():
    """One value per section, each section's index as its value: the flat tensor lists them in
    the order of SECTIONS (fingerprint bits as two float32 values)."""
    sections, want = {}, []
    for i, s in enumerate(frame.SECTIONS):
        if s.bits:
            t = torch.tensor(i, dtype=torch.int64)
            sections[s.name] = [t]
            want += list(t.reshape(1).view(torch.float32).tolist())
        else:
            sections[s.name] = [torch.full((s.width,), float(i)).reshape(()) if s.width == 1 else torch.full((s.width,), float(i))]
            want += [float(i)] * s.width
    flat, counts = frame.pack(sections)
    assert all(counts[n] == 1 for n in frame.NAMES)
    assert np.array_equal(flat.numpy().view(np.uint32), np.asarray(want, np.float32).view(np.uint32))


def test_empty_frame():
    flat, counts = frame.pack({})
    assert flat.numel() == 0 and frame.size(counts) == 0
    got = frame.unpack(flat.numpy(), counts)
    assert got["act"].shape == (0, 6) and got["out_grad"].shape == (0, 2) and got["grad_fp"].shape == (0,)


def test_other_dtypes_become_float32():
    flat, counts = frame.pack({"loss": [torch.tensor(2.5, dtype=torch.float64), torch.tensor(1.5, dtype=torch.bfloat16)]})
    assert flat.dtype == torch.float32
    assert frame.unpack(flat.numpy(), counts)["loss"].tolist() == [2.5, 1.5]


def test_mismatches_are_refused():
    flat, counts = frame.pack({"grad_norm": [torch.tensor(1.0), torch.tensor(2.0)]})
    with pytest.raises(ValueError):
        frame.unpack(flat.numpy()[:1], counts)
    with pytest.raises(ValueError):
        frame.unpack(flat.numpy().astype(np.float64), counts)
    with pytest.raises(KeyError):
        frame.pack({"gradnorm": [torch.tensor(1.0)]})
    with pytest.raises(TypeError):  # a float would not keep its bits
        frame.pack({"grad_fp": [torch.tensor(1.0)]})


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.unused = nn.Linear(3, 3)  # no gradient: absent from the gradient sections
        self.fc2 = nn.Linear(7, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("probing,world_size", [(False, 1), (True, 1), (True, 2)])
def test_measured_sections_through_the_frame(probing, world_size):
    """measure.sentinel and measure.probe on a real model, packed and unpacked, give what torch
    computes directly: norms, counts and fingerprints land on the right parameters."""
    torch.manual_seed(0)
    net = Net()
    rec = ProbeRecorder(Reducer("off"), lambda where, e: pytest.fail(f"{where}: {e!r}"), net)
    if probing:
        rec.install()
    net(torch.randn(4, 5)).square().sum().backward()
    net.fc1.weight.grad[0, 0] = float("nan")
    params = list(net.parameters())
    fps = Fingerprints(world_size)
    losses, scale = [torch.tensor(0.25), torch.tensor(0.75)], torch.tensor(1024.0)
    present, sections, rows, split = measure.sentinel(params, [], losses, scale, probing, fps)
    if probing:
        sections.update(measure.probe(params, rec, fps))
        rec.remove()
    flat, counts = frame.pack(sections)
    got = frame.unpack(flat.numpy(), counts)

    with_grad = [p for p in params if p.grad is not None]
    assert [params[i] for i in present] == with_grad and len(with_grad) == 4
    assert rows == (1, 1, 1, 1)  # all within one chunk: one norm each (tests/test_agent_coverage.py: more)
    assert split == CPU_SPLIT_MAX  # CPU gradients: one of more chunks would be normed by rows, not as views
    assert np.array_equal(got["grad_norm"], [torch.linalg.vector_norm(p.grad).item() for p in with_grad], equal_nan=True)
    assert got["loss"].tolist() == [0.25, 0.75] and got["loss_scale"].tolist() == [1024.0]
    assert len(got["bucket_norm"]) == 0
    if not probing:
        assert all(counts[n] == 0 for n in ("grad_nonfinite", "grad_fp", "weight_norm", "weight_fp", "act", "out_grad"))
        return
    assert got["grad_nonfinite"].tolist() == [1, 0, 0, 0]
    assert np.allclose(got["weight_norm"], [torch.linalg.vector_norm(p).item() for p in params])
    assert got["act"].shape == (len(rec.act), 6) and len(rec.act) == 2  # fc1 and fc2 ran; unused did not
    assert got["out_grad"].shape == (len(rec.grad), 2) and len(rec.grad) == 2
    if world_size == 1:
        assert counts["grad_fp"] == counts["weight_fp"] == 0
    else:
        assert got["grad_fp"].tolist() == [fingerprint(p.grad).item() & (2**64 - 1) for p in with_grad]
        assert got["weight_fp"].tolist() == [fingerprint(p).item() & (2**64 - 1) for p in params]


def test_a_width1_section_may_come_stacked():
    """The sentinel hands ``grad_norm`` over as one 1-D tensor (stats.chunk_norms): it packs like
    the same items one by one, beside 0-d items of the neighbouring sections; a tensor for a
    wider or bit section is refused."""
    norms = torch.tensor([1.0, 2.0, 3.0])
    flat, counts = frame.pack({"grad_norm": norms, "loss": [torch.tensor(0.5)], "act": [torch.arange(6.0)]})
    same, same_counts = frame.pack({"grad_norm": list(norms), "loss": [torch.tensor(0.5)], "act": [torch.arange(6.0)]})
    assert torch.equal(flat, same) and counts == same_counts and counts["grad_norm"] == 3
    got = frame.unpack(flat.numpy(), counts)
    assert got["grad_norm"].tolist() == [1.0, 2.0, 3.0] and got["loss"].tolist() == [0.5]
    alone, _ = frame.pack({"grad_norm": norms})
    assert alone is norms  # an unprobed step's whole frame: no kernel at all
    with pytest.raises(TypeError, match="1-D run"):
        frame.pack({"act": torch.zeros(6)})
