"""Issue 11: what a new user's model does that the agent must cover, each against float64 references.

Sparse gradients, activation checkpointing, PyTorch's fused fast paths, torch.compile, large
tensors' norms, empty / complex / integer outputs, modules called several times, keyword-only
roots. Each test trains with the agent attached (``every=1``) and receives the real wire messages
(harness of ``tests/test_agent_stats.py``), compares with a reference computed in float64 on an
agent-free twin, and checks that training stays bit-identical and runs the same kernels.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from gradwatch import agent
from gradwatch.agent.stats import NORM_CHUNK, l2_norms, Reducer
from gradwatch.agent.measure import dense_values

from .test_agent_stats import Probe, assert_act, assert_norm, ref_norm, seeded, twin, train  # noqa: F401

pytestmark = pytest.mark.timeout(180)


def ref64(t: torch.Tensor) -> float:
    return t.detach().double().norm().item()


# --- sparse gradients --------------------------------------------------------------------------


class SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.emb(ids))


_sparse = seeded(3, SparseModel)
_IDS = torch.tensor([[1, 2, 1, 7], [3, 1, 2, 49], [7, 7, 7, 0]])  # duplicates: uncoalesced gradient


def _sparse_step(model, ids=_IDS):
    return model(ids).square().mean()


def _sparse_opts(model):
    return [torch.optim.SparseAdam([model.emb.weight], lr=1e-2), torch.optim.Adam(model.head.parameters(), lr=1e-2)]


def test_dense_values_sums_duplicates_without_densifying():
    """Uncoalesced COO: the values equal ``coalesce().values()`` (zero rows past the last index)."""
    i = torch.tensor([[3, 1, 3, 0, 1, 3], [0, 2, 0, 1, 2, 1]])
    v = torch.randn(6, 4)
    g = torch.sparse_coo_tensor(i, v, (5, 3, 4))
    assert not g.is_coalesced()
    got = dense_values(g)
    want = g.coalesce().values()
    assert got.shape == v.shape  # never the dense [5, 3, 4]
    assert torch.equal(got[: len(want)], want) and not got[len(want):].any()
    assert torch.equal(dense_values(g.coalesce()), want)
    csr = torch.randn(4, 5).relu().to_sparse_csr()
    assert torch.equal(dense_values(csr), csr.values())


def test_sparse_embedding_gradients_against_float64(collector):
    """nn.Embedding(sparse=True) with SparseAdam and a dense head with Adam: every gradient norm
    (sparse and dense) and the global norm match float64; the sentinel never fails."""
    model = _sparse()
    ref = twin(model, _sparse)
    opts = _sparse_opts(model)

    class Both(torch.optim.Optimizer):  # one optimizer object the agent attaches to, stepping both
        def __init__(self):
            super().__init__([p for o in opts for g in o.param_groups for p in g["params"]], {})

        def step(self, closure=None):
            for o in opts:
                o.step()

    opt = Both()
    _, probes = train(collector, model, lambda s: _sparse_step(model).backward(), steps=3, opt=opt)
    ref_opts = _sparse_opts(ref)
    for step in range(3):
        for o in ref_opts:
            o.zero_grad(set_to_none=True)
        _sparse_step(ref).backward()
        p = probes[step]
        dense_ref = {n: q.grad.to_dense() if q.grad.is_sparse else q.grad for n, q in ref.named_parameters()}
        for name, g in dense_ref.items():
            assert_norm(p.param(name)[[0, 2]], g, name)
        norm, _ = ref_norm(list(dense_ref.values()))
        assert p.report.grad_norm == pytest.approx(norm, rel=1e-6)
        assert p.report.grad_nonfinite == 0
        for o in ref_opts:
            o.step()
    # training with the agent is bit-identical to training without it
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n


# --- norm precision ----------------------------------------------------------------------------


@pytest.mark.parametrize("log2", [10, 13, 14, 20, 24])
def test_l2_norms_within_1e6_of_float64(log2):
    g = torch.Generator().manual_seed(log2)
    x = torch.randn(1 << log2, generator=g) + 0.5
    small = torch.randn(7, 3, generator=g)
    for t, n in zip((x, small, x[:-3]), l2_norms([x, small, x[:-3]])):
        assert n.dtype == torch.float32 and n.shape == ()
        assert n.item() == pytest.approx(ref64(t), rel=1e-6)
    assert torch.isnan(l2_norms([torch.full((NORM_CHUNK + 5,), float("nan"))])[0])
    assert torch.isinf(l2_norms([torch.tensor([1.0] * NORM_CHUNK + [float("inf")])])[0])


def test_output_grad_norm_of_complex_is_by_magnitude():
    z = torch.randn(1000, dtype=torch.complex64)
    sq, nf = Reducer.sumsq_nonfinite(z).tolist()
    assert sq == pytest.approx(z.abs().double().square().sum().item(), rel=1e-6) and nf == 0


class Big(nn.Module):
    """One 2^26-element parameter (an LM head's size): its gradient and weight norms."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1 << 13, 1 << 13) * 0.01 + 0.003)

    def forward(self, x):
        return (x @ self.w).square().mean()


def test_norms_of_a_2_26_element_parameter_against_float64(collector):
    torch.manual_seed(0)
    model = Big()
    x = torch.randn(2, 1 << 13)
    _, probes = train(collector, model, lambda s: model(x).backward(), steps=1)
    model.zero_grad()
    model(x).backward()
    row = probes[0].param("w")
    assert float(row[0]) == pytest.approx(ref64(model.w.grad), rel=1e-6)
    assert float(row[1]) == pytest.approx(ref64(model.w), rel=1e-6)
    assert probes[0].report.grad_norm == pytest.approx(ref64(model.w.grad), rel=1e-6)
