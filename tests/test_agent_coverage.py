"""What a new user's model does that the agent must cover, each against float64 references.

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
from gradwatch.agent.stats import CPU_SPLIT_MAX, NORM_CHUNK, SPLIT_MAX, chunk_norms, chunks_of, combine_chunks, l2_norms, Reducer
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


@pytest.mark.parametrize("split", [SPLIT_MAX, CPU_SPLIT_MAX, 1], ids=["accelerator", "cpu", "rows"])
@pytest.mark.parametrize("log2", [10, 13, 14, 20, 24])
def test_chunk_norms_combined_on_the_host_within_1e6_of_float64(log2, split):
    """The sentinel's pair: chunk norms on the device (views of tensors up to ``split`` chunks in
    one foreach, larger ones by rows, the latter at the end: the CPU's split takes a tensor of 5
    chunks or more by rows), float64 across chunks on the host; each tensor's norm within rel
    1e-6 of float64, in the tensors' order, non-finite values kept."""
    g = torch.Generator().manual_seed(log2)
    x = torch.randn(1 << log2, generator=g) + 0.5
    small = torch.randn(7, 3, generator=g)
    parts = torch.randn(3 * NORM_CHUNK + 11, generator=g)  # views but with split 1, with a short last chunk
    six = torch.randn(5 * NORM_CHUNK + 3, generator=g)  # views on an accelerator, by rows on the CPU
    nan = torch.full((NORM_CHUNK + 5,), float("nan"))
    inf = torch.tensor([1.0] * NORM_CHUNK + [float("inf")])
    ts = [x, small, parts, six, x[:-3], nan, inf, x.reshape(-1, 1 << (log2 // 2))]
    rows = [chunks_of(t.numel()) for t in ts]
    assert rows[1:4] == [1, 4, 6] and (max(rows) > SPLIT_MAX) == (log2 > 19)
    flat = chunk_norms(ts, rows, split)
    assert flat.dtype == torch.float32 and flat.shape == (sum(rows),)
    got = combine_chunks(flat.numpy(), rows, split)
    assert got.dtype == np.float64 and got.shape == (len(ts),)
    for t, n in zip(ts, got):
        if torch.isfinite(t).all():
            assert n == pytest.approx(ref64(t), rel=1e-6)
    assert np.isnan(got[5]) and np.isinf(got[6])
    with pytest.raises(ValueError, match="chunk norms"):
        combine_chunks(flat.numpy()[:-1], rows, split)
    if split != SPLIT_MAX:  # the same values in another order: read with another split, wrong norms
        assert not np.allclose(combine_chunks(flat.numpy(), rows, SPLIT_MAX), got, equal_nan=True)


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


@pytest.mark.slow  # a quarter-GiB parameter
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


# --- outputs: complex, empty, integer and bool; calls ---------------------------------------------


class Outputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.relu = nn.ReLU()  # called three times per forward
        self.spec = Spectrum()
        self.pick = Pick()
        self.skip = nn.Linear(4, 4)  # never called

    def forward(self, x, empty):
        h = self.relu(self.lin(x))
        h = self.relu(h - 0.1) + self.relu(h - 0.2)
        z = self.spec(h)
        e = self.lin(empty)  # a zero-size batch: lin's call counts, its elements do not
        idx = self.pick(h)
        return h.sum() + z.abs().sum() + e.sum() + idx.float().sum() * 0


class Spectrum(nn.Module):
    def forward(self, h):
        return torch.fft.rfft(h, dim=-1)  # complex64


class Pick(nn.Module):
    def forward(self, h):
        return h.argmax(dim=-1)  # int64: no statistics, but the call counts


_outputs = seeded(5, Outputs)


def test_complex_empty_integer_outputs_and_call_counts(collector):
    model = _outputs()
    x, empty = torch.randn(5, 4), torch.randn(0, 4)
    _, probes = train(collector, model, lambda s: model(x, empty).backward(), steps=2)
    ref = twin(model, _outputs)
    h1 = ref.relu(ref.lin(x))
    h2, h3 = ref.relu(h1 - 0.1), ref.relu(h1 - 0.2)
    z = ref.spec(h2 + h3)
    for step in (0, 1):
        p = probes[step]
        counts = {s[0] + s[1]: p.report.act_count[i].tolist() for i, s in enumerate(p.schema.slots)}
        assert counts["relu"] == [3, 3 * 30] and counts["lin"] == [2, 30] and counts["spec"] == [1, 5 * 4]
        assert counts["pick"] == [1, 0] and "skip" not in counts  # never ran: no slot at all
        assert p.schema.slots[p.slot("spec")][3] == "complex64" and p.schema.slots[p.slot("pick")][3] == "int64"
        assert_act(p.act("relu"), [h1, h2, h3], "relu, three calls pooled")
        assert_act(p.act("lin"), [ref.lin(x)], "lin: the empty call adds nothing")
        assert_act(p.act("spec"), [z.abs()], "complex by magnitude")
        assert np.isnan(p.act("pick")).all()  # no statistics: not observed, nothing exported


def test_empty_output_counts_zero_and_exports_no_min_max(collector):
    """An empty last batch: calls 1, elements 0, and its act row is "not observed" (the
    aggregator exports no NaN mean/std/min/max gauges for it)."""
    from gradwatch import columns
    from gradwatch.aggregator import reductions

    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(0, 3)
    _, probes = train(collector, model, lambda s: (model(x).sum() + sum(p.sum() for p in model.parameters()) * 0).backward())
    p = probes[0]
    assert p.report.act_count[p.slot("0")].tolist() == [1, 0]
    row = p.act("0")
    assert np.isnan(row).all()
    for s in columns.of("act"):
        assert not reductions.observed(s, row[None])[0]


# --- keyword-only roots --------------------------------------------------------------------------


class KwModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.head = nn.Linear(4, 20)

    def forward(self, *, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_keyword_only_root_counts_its_batch(collector):
    torch.manual_seed(0)
    model = KwModel()
    ids = torch.randint(0, 20, (6, 5))
    _, probes = train(collector, model, lambda s: model(input_ids=ids, labels=ids).backward(), steps=2)
    assert probes[0].report.batch == 6 and probes[0].report.micro == 1


# --- activation checkpointing ----------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(6, 1)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            if self.reentrant is None:
                h = b(h)
            else:
                h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_records_each_call_once_in_forward_order(collector, reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    ref = Checkpointed(None)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")  # a non-finite count that must not double
    bad = torch.randn(8, 4)

    def step(s):
        model(x if s == 0 else bad).square().mean().backward()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, probes = train(collector, model, step, steps=2, opt=opt)
    order = ["inp", "blocks.0.fc", "blocks.0.act", "blocks.1.fc", "blocks.1.act", "out"]
    for s, inp in ((0, x), (1, bad)):
        p = probes[s]
        assert [m for m, _, _, _ in p.schema.slots] == order
        outs = {}
        h = ref.inp(inp)
        outs["inp"] = h
        for i, b in enumerate(ref.blocks):
            outs[f"blocks.{i}.fc"] = b.fc(h)
            h = outs[f"blocks.{i}.act"] = b.act(outs[f"blocks.{i}.fc"])
        outs["out"] = ref.out(h)
        for t in outs.values():
            t.retain_grad()
        ref.zero_grad()
        outs["out"].square().mean().backward()
        for name, t in outs.items():
            assert p.report.act_count[p.slot(name)].tolist() == [1, t.numel()], name
            assert_act(p.act(name), t, name)
            assert_norm(p.act_grad(name), t.grad, name)
        with torch.no_grad():
            for q in ref.parameters():
                q -= 0.1 * q.grad
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        # same values bit for bit where the gradients are finite (step 0 poisons every weight
        # with NaN alike in both)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), n


def test_training_with_checkpointing_is_bit_identical_with_and_without_the_agent(collector):
    torch.manual_seed(1)
    model = Checkpointed(False)
    plain = Checkpointed(False)
    plain.load_state_dict(model.state_dict())
    xs = [torch.randn(8, 4) for _ in range(3)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(collector, model, lambda s: model(xs[s]).square().mean().backward(), steps=3, opt=opt)
    popt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for s in range(3):
        plain(xs[s]).square().mean().backward()
        popt.step()
        popt.zero_grad(set_to_none=True)
    for (n, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n


# --- fused fast paths ------------------------------------------------------------------------------


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.layer(x))


@pytest.mark.parametrize("every", [1, 2])
def test_fused_encoder_fast_path_runs_in_evaluation_with_the_agent(collector, monkeypatch, every):
    """Evaluation under no_grad between probed training steps takes PyTorch's fused
    ``_transformer_encoder_layer_fwd`` as it does without the agent, returning the same bits; the
    training step records ``self_attn`` (a MultiheadAttention, not a leaf) as one layer."""
    calls = []
    fused = torch._transformer_encoder_layer_fwd

    def counting(*a, **k):
        calls.append(1)
        return fused(*a, **k)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    torch.manual_seed(0)
    model = Encoder()
    plain = Encoder()
    plain.load_state_dict(model.state_dict())
    x, xe = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    plain.eval()
    with torch.no_grad():
        want = plain(xe)
    assert len(calls) == 1, "the fused path should run without the agent"
    evals = []

    def evaluate(step):
        model.eval()
        before = len(calls)
        with torch.no_grad():
            evals.append((len(calls), torch.equal(model(xe), want)))
        evals[-1] = (evals[-1][1], len(calls) - before)
        model.train()

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _, probes = train(collector, model, lambda s: model(x).sum().backward(), steps=4, every=every, opt=opt, between=evaluate)
    assert evals == [(True, 1)] * 4  # every evaluation, in and out of probe windows, was fused
    p = probes[0]
    assert "layer.self_attn" in [s[0] for s in p.schema.slots]
    assert "layer.self_attn.out_proj" not in [s[0] for s in p.schema.slots]
    plain.train()
    attn = plain.layer.self_attn(x, x, x, need_weights=False)[0]
    assert_act(p.act("layer.self_attn", "[0]"), attn, "self_attn output")


# --- torch.compile ---------------------------------------------------------------------------------


def _compiled_run(collector, with_agent: bool, compile_first: bool):
    """Six steps of a compiled MLP (probing starts at 0, stops at 1, starts at 3, ...): the
    FX graphs dynamo produced, its graph-break count, and the trained parameters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def backend(gm, example_inputs):
        # the graph's operations in order and its inputs as a set (the agent's pre-hook, which
        # sees the root's arguments, may make dynamo list the input before the parameters)
        nodes = gm.graph.nodes
        graphs.append((sorted(n.name for n in nodes if n.op == "placeholder"),
                       [(n.op, str(n.target), str(n.args)) for n in nodes if n.op != "placeholder"]))
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(4, 8) for _ in range(6)]
    cm = torch.compile(model, backend=backend)
    mon = None
    if with_agent:
        mon = agent.attach(cm if compile_first else model, opt, endpoint=collector.endpoint, every=3)
    try:
        for s in range(6):
            cm(xs[s]).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if mon is not None:
            reports = collector.wait_steps(6)
            assert [s for s, r in sorted(reports.items()) if r.probe] == [0, 3]
            assert all(math.isfinite(r.grad_norm) for r in reports.values())  # the sentinel still measures
    finally:
        if mon is not None:
            mon.close()
    breaks = sum(counters["graph_break"].values())
    return graphs, breaks, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("compile_first", [False, True])
def test_compiled_model_has_the_same_graphs_and_never_recompiles(collector, compile_first):
    """torch.compile with the agent attached (before or after compiling): the graphs dynamo builds
    are those without it, no graph break, no recompile when probing starts and stops (any
    recompile raises), the same trained bits; the hooks step aside while dynamo traces."""
    with torch._dynamo.config.patch(error_on_recompile=True):  # any recompile raises
        want_graphs, want_breaks, want_params = _compiled_run(collector, False, compile_first)
        graphs, breaks, params = _compiled_run(collector, True, compile_first)
    assert len(want_graphs) == 1 and want_breaks == 0
    assert graphs == want_graphs and breaks == want_breaks
    for a, b in zip(params, want_params):
        assert torch.equal(a, b)


# --- training stays bit-identical ------------------------------------------------------------------


def _kw_step(m, s):
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(0, 20, (6, 5), generator=g)
    return m(input_ids=ids, labels=ids)


def _outputs_step(m, s):
    g = torch.Generator().manual_seed(s)
    return m(torch.randn(5, 4, generator=g), torch.randn(0, 4))


def _encoder_step(m, s):
    g = torch.Generator().manual_seed(s)
    return m(torch.randn(3, 5, 8, generator=g)).square().mean()


@pytest.mark.parametrize("factory,step", [
    (seeded(7, KwModel), _kw_step), (_outputs, _outputs_step), (seeded(8, Encoder), _encoder_step),
    (seeded(9, Checkpointed, True), lambda m, s: m(torch.randn(8, 4, generator=torch.Generator().manual_seed(s))).sum()),
], ids=["keyword-root", "complex-empty-int-outputs", "transformer-layer", "reentrant-checkpoint"])
def test_training_is_bit_identical_with_the_agent(collector, factory, step):
    """Adam, lr 1e-2, four steps (probed every second): the parameters with the agent equal those
    without it bit for bit."""
    model, plain = factory(), factory()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(collector, model, lambda s: step(model, s).backward(), steps=4, every=2, opt=opt)
    popt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for s in range(4):
        step(plain, s).backward()
        popt.step()
        popt.zero_grad(set_to_none=True)
    for (n, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n
