"""The fused statistics kernel (``Reducer``, ``fused="on"``) never compiles on the caller's (the
training) thread: it runs only on devices it was compiled and checked on (a tensor of another
device is reduced eagerly while that device's kernel compiles in the background), and always in
the grad mode and autocast state it was compiled in.

A CUDA model under ``fused="on"`` had its kernel compiled for the CPU at attach, and its first
probed step then recompiled it for CUDA inside the training step; and a kernel called inside the
forward's ``torch.autocast`` recompiled there for each autocast state (bench/gpu's truth part found
it on the CPU). Without a GPU here, the other device is ``meta``, the autocast the CPU's.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gradwatch.agent.stats import Reducer, _eager_moments

pytestmark = pytest.mark.timeout(240)


def _compiles_settled(timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(t.name == "gradwatch-compile" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the background compile did not finish"
        time.sleep(0.05)


@pytest.mark.slow  # compiles the kernel with inductor: ~15 s on a cold cache
def test_fused_kernel_is_used_only_on_devices_it_was_compiled_for_and_never_compiles_on_the_caller():
    from torch._dynamo.utils import counters

    red = Reducer("on")
    _compiles_settled()
    assert red.ready_for("cpu") and red.fused_ready, "the fused kernel did not compile for the CPU"
    x = torch.linspace(-3, 5, 10_001)
    assert torch.allclose(red.moments(x), _eager_moments(x), rtol=1e-5, atol=1e-4)

    graphs = counters["stats"]["unique_graphs"]
    # inside a training forward's autocast (bf16 here; fp16 on CUDA), under no_grad (a checkpointed
    # forward), with autocast's cache off: the kernel's guards hold, nothing compiles here
    for ctx in (torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", dtype=torch.float16),
                torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), torch.no_grad()):
        with ctx:
            got = red.moments(x)
        assert torch.allclose(got, _eager_moments(x), rtol=1e-5, atol=1e-4), ctx
    assert counters["stats"]["unique_graphs"] == graphs, "a graph was compiled on the caller's thread"
    m = torch.linspace(-1, 1, 1000, device="meta")
    out = red.moments(m)  # another device: eager here, its compile (if any) in the background
    assert out.device.type == "meta" and out.shape == (6,)
    assert counters["stats"]["unique_graphs"] == graphs, "a graph was compiled on the caller's thread"
    assert not red.ready_for("meta")
    _compiles_settled()  # meta has no values to check the kernel against: it stays eager there
    assert not red.ready_for("meta") and red.ready_for("cpu")
    assert red.moments(m).device.type == "meta"


def test_off_never_compiles_and_auto_waits_for_a_cuda_tensor():
    for mode in ("off", "auto"):
        red = Reducer(mode)
        x = torch.randn(5000)
        assert torch.equal(red.moments(x), _eager_moments(x))
        assert not any(t.name == "gradwatch-compile" and t.is_alive() for t in threading.enumerate()), mode
        assert not red.fused_ready and not red.ready_for("cpu")


@pytest.mark.slow  # compiles the kernel for bfloat16 with inductor
def test_half_precision_is_read_as_it_is_without_a_float32_copy():
    """A bf16 activation (a Linear's output under autocast) went through the fused kernel as a
    float32 copy made first: twice its own size allocated on every probed step, and three passes
    over memory instead of one. The kernel reads it as it is: no allocation the tensor's size."""
    from torch.profiler import ProfilerActivity, profile

    red = Reducer("on")
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(red.moments(x), _eager_moments(x.float()))  # eager meanwhile; starts its compile
    deadline = time.monotonic() + 180
    while not red.ready_for("cpu", torch.bfloat16):
        assert time.monotonic() < deadline, "the fused kernel did not compile for bfloat16"
        time.sleep(0.05)
    assert torch.allclose(red.moments(x), _eager_moments(x.float()), rtol=1e-5, atol=1e-4)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        red.moments(x)
    allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events())
    assert allocated < x.numel(), f"{allocated} bytes allocated for a {x.numel()}-element bf16 tensor"
    assert not red.ready_for("cpu", torch.float16)  # a dtype not seen yet: not compiled
    _compiles_settled()
