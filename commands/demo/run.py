"""``gradwatch demo``: an aggregator plus an N-rank gloo DDP job training :class:`~.model.GPT`.

Each rank is a process started with ``torch.multiprocessing`` and given torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_RUN_ID, MASTER_ADDR/PORT), so the agent finds its
identity exactly as it would under torchrun. Tests use :func:`train_rank` directly.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import time
import traceback
from typing import Optional

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gradwatch import settings

from .inject import kinds_help


class DemoConfig(BaseSettings):
    """Train a small character-level transformer on the standard library's source with gradwatch attached."""

    model_config = SettingsConfigDict(
        env_prefix="GRADWATCH_DEMO_", extra="forbid", frozen=True, cli_kebab_case=True,
        cli_prog_name="gradwatch demo", cli_implicit_flags=True,
    )

    ranks: int = Field(2, ge=1, le=16, description="DDP ranks (processes, gloo backend on CPU).")
    steps: int = Field(300, ge=1, description="Optimizer steps per rank.")
    every: int = Field(10, ge=1, description="Probe cadence of the agents, steps.")
    aggregator: str = Field("", description="Endpoint of a running aggregator; empty starts one in this process.")
    listen: str = Field("tcp://127.0.0.1:0", description="Where the demo's own aggregator listens (port 0: any free one).")
    metrics_port: int = Field(9400, ge=0, le=65535, description="HTTP port of the demo's own aggregator (/metrics).")
    job: str = Field("demo", description="Job id the ranks report under.")
    batch_size: int = Field(16, ge=1, description="Sequences per rank per step.")
    context: int = Field(64, ge=8, description="Sequence length, bytes.")
    width: int = Field(64, ge=8, description="Model width.")
    layers: int = Field(2, ge=1, description="Transformer blocks.")
    heads: int = Field(4, ge=1, description="Attention heads.")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate.")
    clip_grad_norm: float = Field(0.0, ge=0, allow_inf_nan=False, description="Clip the gradient norm to this before each optimizer step (torch.nn.utils.clip_grad_norm_, as most training loops do); 0: no clipping.")
    seed: int = Field(0, description="Seed of model initialisation and data order.")
    agent: bool = Field(True, description="Attach the gradwatch agent (--no-agent trains without it).")
    linger_s: float = Field(2.0, ge=0, description="Seconds the demo's aggregator keeps serving after training, before the summary.")
    progress: bool = Field(True, description="Show a progress bar on rank 0.")
    inject: list[str] = Field(
        default_factory=list,
        description="Fault to inject, KIND@STEP[:rank=R|all][:layer=L][:param=P][:scale=X][:seconds=S][:factor=F][:pass=P]; "
        f"repeatable. KIND (its defaults): {kinds_help()}; rank is the last one unless given or a default says all (see "
        "gradwatch.commands.demo.inject).",
    )
    events_path: str = Field("", description="JSON-lines file the demo's own aggregator appends findings to.")

    @field_validator("aggregator")
    @classmethod
    def _aggregator(cls, v: str) -> str:
        return settings.endpoint(v) if v else v  # else each spawned rank failed, naming agent.endpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rank(rank: int, cfg: DemoConfig, master_port: int, endpoint: str, results=None) -> dict:
    """Train one rank to the end; returns ``{"rank", "steps", "probes", "drops", "loss", "params"}``.

    Faults from ``cfg.inject`` are applied here, in the harness, never in the agent.
    """
    from .alloc import steady_allocator

    steady_allocator()  # the ranks' allocators alike: no rank refaults its activations every step
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(cfg.ranks), LOCAL_RANK=str(rank), TORCHELASTIC_RUN_ID=cfg.job,
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.ranks)
    try:
        try:
            out = _train(rank, cfg, endpoint)
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)  # the failed step's DDP freed too, the group still here
            gc.collect()
            raise
        # a DDP's Reducer frees its process group holding the GIL, and gloo's destructor joins worker
        # threads that may need the GIL for a finished collective (pytorch/pytorch#56297): the Reducer
        # must not hold the group's last reference. Free it (cycles too) while the group is registered;
        # freed after destroy_process_group, it can hang a rank (seen in CI, with the agent switched off)
        gc.collect()
    finally:
        dist.destroy_process_group()
    if results is not None:
        results.put({k: v for k, v in out.items() if k != "params"})
    return out


def _train(rank: int, cfg: DemoConfig, endpoint: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwatch import agent

    from .inject import Injector, parse
    from .model import GPT, GPTConfig, batch, stdlib_text

    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(context=cfg.context, width=cfg.width, layers=cfg.layers, heads=cfg.heads))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr)
    monitor = agent.attach(ddp, opt, endpoint=endpoint, every=cfg.every) if cfg.agent else agent.NullMonitor()
    text = stdlib_text()
    faults = Injector([parse(s, cfg.ranks) for s in cfg.inject], rank)
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc="training", unit="step", file=sys.stderr)
    with monitor:
        for step in range(cfg.steps):
            loss = faults.train_step(step, model, ddp, opt,
                                     *batch(text, cfg.seed, rank, step, cfg.batch_size, cfg.context),
                                     lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), monitor,
                                     clip=cfg.clip_grad_norm)
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update()
        out = {
            "rank": rank, "steps": monitor.step, "probes": monitor.probes,
            "drops": getattr(getattr(monitor, "sender", None), "drops", 0), "loss": loss.item(),
            "connected": getattr(getattr(monitor, "sender", None), "connected", None),  # None: no agent
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    if bar is not None:
        bar.close()
    return out


def _spawned(rank, cfg, master_port, endpoint, results):
    train_rank(rank, cfg, master_port, endpoint, results)
    # done: results sent (a SimpleQueue writes at once), process group destroyed, agent closed.
    # torch 2.13's gloo teardown at interpreter exit now and then aborts the process ("terminate
    # called without an active exception", also without the agent), which would fail a finished
    # demo: leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stop_by_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds run(): its finally stops the ranks


def run(cfg: DemoConfig) -> int:
    import torch.multiprocessing as mp

    from .inject import check, parse
    from .model import GPT, GPTConfig

    model = GPT(GPTConfig(context=cfg.context, width=cfg.width, layers=cfg.layers, heads=cfg.heads))
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    for spec in cfg.inject:
        try:
            check(parse(spec, cfg.ranks), spec, modules, params, cfg.steps)
        except ValueError as e:
            print(f"gradwatch: demo.inject: {e}", file=sys.stderr)
            return 2
    del model, modules, params
    from gradwatch.agent import switched_off

    # the agent's own settings (GRADWATCH_*: keys, ...) fail here, not in every spawned rank; not
    # read when GRADWATCH_ENABLED switches it off (attach() would not read them either)
    if cfg.agent and not switched_off({}):
        import warnings

        from gradwatch.agent.config import load as agent_settings
        from gradwatch.errors import ConfigError

        try:
            with warnings.catch_warnings():  # an unknown variable: each rank warns about it
                warnings.simplefilter("ignore")
                agent_settings(endpoint=cfg.aggregator or "tcp://127.0.0.1:1", every=cfg.every)
        except ConfigError as e:
            print(f"gradwatch: {e}", file=sys.stderr)
            return 2

    agg = None
    endpoint = cfg.aggregator
    if not endpoint:
        from gradwatch.aggregator import Aggregator, load

        from gradwatch.aggregator.checks import Thresholds

        # every rank of the demo shares this machine's few cores: a rank the scheduler starves for
        # a few milliseconds is not the straggler the demo's faults inject (0.2 s per step)
        checks = Thresholds(straggler_min_s=0.05)
        agg = Aggregator(load(
            listen=cfg.listen, metrics_port=cfg.metrics_port, metrics_host="127.0.0.1",
            events_path=cfg.events_path, checks=checks,
        )).start()
        endpoint = agg.endpoint
        print(f"gradwatch demo: aggregator at {endpoint}; metrics at {agg.metrics_url}", flush=True)
    else:
        print(f"gradwatch demo: sending to the aggregator at {endpoint}", flush=True)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    t0 = time.perf_counter()
    ranks = mp.start_processes(_spawned, args=(cfg, free_port(), endpoint, results), nprocs=cfg.ranks,
                               start_method="spawn", join=False)
    # a scheduler or a user stopping the demo (SIGTERM) stops its ranks too: they were left
    # training, orphaned, when the demo's process died by the signal's default action
    previous = signal.signal(signal.SIGTERM, _stop_by_signal)
    try:
        while not ranks.join():
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in ranks.processes:
            if p.is_alive():
                p.terminate()
    wall = time.perf_counter() - t0
    per_rank = sorted((results.get() for _ in range(cfg.ranks)), key=lambda r: r["rank"])
    print(f"\ntrained {cfg.steps} steps on {cfg.ranks} ranks in {wall:.1f} s")
    if agg is not None:
        time.sleep(cfg.linger_s)
        agg.stop()  # its writer publishes once more as it stops: the summary reads that snapshot
        _summary(per_rank, agg.snapshot, cfg.job, cfg.events_path)
    else:
        for r in per_rank:
            # "sent": handed to ZeroMQ; an agent whose handshake never completed reached no aggregator
            reached = " (never connected: none reached an aggregator)" if r["connected"] is False else ""
            print(f"rank {r['rank']}: steps {r['steps']}, probes sent {r['probes']}{reached}, drops {r['drops']}, "
                  f"final loss {r['loss']:.3f}")
    return 0


def _summary(per_rank, snap, job: str, events_path: str = "") -> None:
    jv = next((j for j in snap.jobs if j.job == job), None)
    seen = {r.rank: r for r in jv.ranks} if jv else {}
    print("\nper rank                steps  probes  drops  lost  final loss")
    for r in per_rank:
        a = seen.get(r["rank"])
        print(
            f"  rank {r['rank']:<16} {r['steps']:>5}  {r['probes']:>6}  {r['drops']:>5}  "
            f"{a.lost if a else '-':>4}  {r['loss']:.3f}   (aggregator saw {a.steps if a else 0} steps, {a.probes if a else 0} probes)"
        )
    events = [e for e in (snap.checks.events if snap.checks else ()) if e.job == job and e.event == "raised"]
    keep = f"; they are in {events_path}" if events_path else "; --events-path keeps them in a file"
    print(f"\nfindings raised: {len(events)}" + (f" (the demo's aggregator stops with it{keep})" if events else ""))
    for e in events:
        print(f"  [{e.severity}] {e.check} at step {e.step}: {e.summary}")
    rr = jv.last_round if jv else None
    if rr is None:
        print("\nno probed step reached the aggregator")
        return
    grad, _ = rr.agg["grad_norm"]
    zero, _ = rr.agg["activation_zero_ratio"]
    gidx = {m: i for i, m in enumerate(rr.modules)}
    print(f"\nper layer at probed step {rr.step} ({'complete' if rr.complete else 'incomplete'} round, median over ranks)")
    print(f"  {'layer':<28} {'grad norm':>10} {'zero ratio':>11}")
    for i, layer in enumerate(rr.layers):
        g = f"{grad[1, gidx[layer]]:>10.4g}" if layer in gidx else f"{'-':>10}"  # no parameters
        print(f"  {layer:<28} {g} {zero[1, i]:>11.3f}")


def main(argv: Optional[list[str]] = None) -> int:
    """``gradwatch demo [FLAGS]`` (flags: the fields of :class:`DemoConfig`); the exit status."""
    from gradwatch.commands.cli import main as gradwatch

    return gradwatch(["demo", *(sys.argv[1:] if argv is None else argv)])
