"""A tiny sharded training job for tests/test_sharded.py: real gloo processes on CPU.

``python -m tests.sharded_job MODE --ranks N --steps S --out DIR [--endpoint E --every K --job J]
[--flip STEP:RANK:PARAM[:BIT]] [--without DIR2]`` trains :func:`model` under ``MODE`` (fsdp2, fsdp1, fsdp1o (use_orig_params),
hsdp (2x2 mesh), tp (ColwiseParallel / RowwiseParallel and a replicated LayerNorm), pp (2 pipeline
stages, GPipe, FSDP2 over each stage's N/2 data-parallel ranks), ppdp (the same with plain
replicas, gradients all-reduced over dp by hand), pptp (2 stages x 2 tensor-parallel ranks),
ppi (interleaved 1F1B: 4 stages, one layer each, on 2 ranks), ppfsdp1 (2 stages x N/2 ranks,
FSDP1 over each stage's data-parallel ranks)), with the
agent attached when ``--endpoint`` is given, and writes each rank's local parameter tensors after
the last step to ``DIR/rank{r}.pt`` (for the bit-identity check; ``--without`` first trains the
same in the same processes without the agent, writing ``DIR2/rank{r}.pt``). The data of rank ``r`` at step
``s`` is :func:`batch` ``(r, s)``; every rank of one data-parallel replica group sees its own batch,
tensor-parallel ranks share theirs. ``--flip`` flips one bit (BIT of the first element's
float32 bits, default 3: a low mantissa bit; 23: the lowest exponent bit, halving or doubling it;
29: an exponent bit set in every |x| in [2^-63, 2), zeroing it; 31: the sign)
of one rank's local weight shard after the optimizer step of STEP (silent data corruption).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.harness import free_port

IN, HID, OUT, BATCH, SEED, LR = 8, 16, 4, 6, 5, 0.05


def model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, OUT), torch.nn.LayerNorm(OUT),
    )


def batch(replica: int, step: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(BATCH, IN, generator=g).to(dtype), torch.randn(BATCH, OUT, generator=g).to(dtype)


STAGES = 2  # pipeline ranks of the pipeline modes: layers 0-1, then 2-3 (ppi: layers 0, 2, then 1, 3)
#: pipeline modes: the mesh dim within a stage (data or tensor parallel)
PIPELINE = {"pp": "dp", "ppdp": "dp", "pptp": "tp", "ppi": None, "ppfsdp1": "dp"}


def replicas(mode: str, world: int) -> int:
    """Data-parallel replicas (distinct batches per step) of a mode."""
    if mode in PIPELINE:
        return world // STAGES if PIPELINE[mode] == "dp" else 1
    return 1 if mode == "tp" else world


def _stage(mode: str, m: torch.nn.Module, world: int):
    """Pipeline modes: the (pp, dp|tp) mesh (ppi: (pp,)), and ``m`` with the layers of the other
    pipeline rank replaced by Identity (every rank keeps the model's original parameter names, as
    torchtitan's split does). Rank ``pp`` holds layers 0-1 or 2-3; under ppi layers ``pp`` and
    ``pp + 2`` (stages ``pp`` and ``pp + 2`` of 4, one layer each: the interleaved layout)."""
    from torch.distributed.device_mesh import init_device_mesh

    inner = PIPELINE[mode]
    mesh = (init_device_mesh("cpu", (STAGES, world // STAGES), mesh_dim_names=("pp", inner)) if inner
            else init_device_mesh("cpu", (world,), mesh_dim_names=("pp",)))
    stage = mesh.get_coordinate()[0]
    for i in range(4):
        if (i % STAGES if mode == "ppi" else i // 2) != stage:
            m[i] = torch.nn.Identity()
    return mesh, stage


def _replicate_layernorm(m: torch.nn.Module, mesh) -> None:
    """``m``'s LayerNorm parameters ``Replicate``d over ``mesh`` (a tensor-parallel group); its
    output a plain tensor."""
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

    def replicate(name, mod, mesh):
        for n, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(n, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))

    distribute_module(m, mesh, replicate, output_fn=lambda mod, out, mesh: out.to_local())


def _wrap(mode: str, m: torch.nn.Module, rank: int, world: int):
    if mode in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if mode == "hsdp"
                else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, rank
    if mode in ("fsdp1", "fsdp1o"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(m, device_id=torch.device("cpu"), use_orig_params=mode == "fsdp1o"), rank
    if mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)})
        _replicate_layernorm(m[3], mesh)
        return m, 0
    if mode == "pp":  # 2 stages x N/2 data-parallel ranks, FSDP2 over each stage's dp ranks (torchtitan)
        from torch.distributed.fsdp import fully_shard

        mesh, stage = _stage(mode, m, world)
        for i in (2 * stage, 2 * stage + 1):
            if isinstance(m[i], (torch.nn.Linear, torch.nn.LayerNorm)):
                fully_shard(m[i], mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        return (m, mesh), mesh.get_coordinate()[1]
    if mode == "ppdp":  # 2 stages x N/2 plain replicas per stage, gradients all-reduced over "dp" by
        # hand (DDP inside a PipelineStage trips over its bucket rebuild on gloo in torch 2.13):
        # plain parameters, so attach(mesh=) tells the agent the stage
        mesh, stage = _stage(mode, m, world)
        return (m, mesh), mesh.get_coordinate()[1]
    if mode == "pptp":  # 2 stages x N/2 tensor-parallel ranks, sharing each stage's batch: stage 0
        # column-wise (its output gathered for the next stage), stage 1 row-wise and a replicated LayerNorm
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh, stage = _stage(mode, m, world)
        if stage == 0:
            parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(output_layouts=Replicate())})
        else:
            parallelize_module(m, mesh["tp"], {"2": RowwiseParallel(input_layouts=Replicate(), use_local_output=False)})
            _replicate_layernorm(m[3], mesh["tp"])
        return (m, mesh), 0
    if mode == "ppi":  # interleaved: 4 one-layer stages, rank r holding stages r and r + 2
        mesh, stage = _stage(mode, m, world)
        return (m, mesh), 0
    if mode == "ppfsdp1":  # 2 stages x N/2 ranks, FSDP1 over each stage's data-parallel ranks
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # torch 2.13 on gloo/CPU: the stage's first backward fails ("The tensor has a non-zero
        # number of elements, but its data is not allocated yet"), FULL_SHARD or SHARD_GRAD_OP,
        # use_orig_params either (tests/test_sharded.py skips on it)
        mesh, stage = _stage(mode, m, world)
        m = FSDP(m, process_group=mesh["dp"].get_group(), device_id=torch.device("cpu"), use_orig_params=True)
        return (m, mesh), mesh.get_coordinate()[1]
    raise ValueError(mode)


def _schedule(mode: str, m: torch.nn.Module, mesh):
    """The pipeline schedule of rank's stage(s) of ``m``: GPipe over 2 stages, or interleaved 1F1B
    over 4 (ppi). 2 micro-batches of BATCH/2; the schedule divides the summed gradients by 2."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    pp, group, cpu = mesh.get_coordinate()[0], mesh["pp"].get_group() if mesh.ndim > 1 else mesh.get_group(), torch.device("cpu")
    loss = torch.nn.functional.mse_loss
    if mode == "ppi":  # the layer modules themselves are the stages (hooks on them see every call)
        layers = m.module if hasattr(m, "module") else m
        stages = [PipelineStage(layers[i], i, 2 * STAGES, cpu, group=group) for i in (pp, pp + STAGES)]
        return ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=loss)
    return ScheduleGPipe(PipelineStage(m, pp, STAGES, cpu, group=group), n_microbatches=2, loss_fn=loss)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _flip(m: torch.nn.Module, name: str, bit: int = 3) -> None:
    for n, p in m.named_parameters():
        if n.endswith(name):
            with torch.no_grad():
                t = _local(p).detach().reshape(-1)
                if t.numel():
                    t[:1].view(torch.int32).bitwise_xor_(1 << bit)
            return


def _train(rank: int, world: int, args, endpoint: str, out: str) -> None:
    """Build the layout from the seed and train it ``args.steps`` steps, the agent attached when
    ``endpoint`` is given; write the rank's local parameters under ``out``."""
    m, replica = _wrap(args.mode, model(), rank, world)
    mesh, schedule = None, None
    if args.mode in PIPELINE:
        m, mesh = m
        schedule = _schedule(args.mode, m, mesh)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    mon = None
    if endpoint:
        from gradwatch.agent import attach

        # FSDP2 and TP stages: the agent finds the (pp, dp|tp) mesh as the root of the parameters'
        # sub-mesh; plain stages (and FSDP1's flat parameters) need the mesh given
        extra = {"mesh": mesh} if args.mode in ("ppdp", "ppi", "ppfsdp1") else {}
        mon = attach(m, opt, endpoint=endpoint, every=args.every, job=args.job, rank=rank, world_size=world, **extra)
        assert type(mon).__name__ == "Monitor", mon
    flip = tuple(args.flip.split(":")) if args.flip else None
    for step in range(args.steps):
        x, y = batch(replica, step)
        if schedule is not None:
            if mesh.get_coordinate()[0] == 0:  # holds the first stage
                schedule.step(x)
            else:  # holds the last stage
                schedule.step(target=y)
            if args.mode == "ppdp":  # data parallel within the stage: the replicas' mean gradient
                for p in m.parameters():
                    dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                    p.grad.div_(mesh["dp"].size())
        else:
            torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if flip and int(flip[0]) == step and int(flip[1]) == rank:
            _flip(m, flip[2], *(int(b) for b in flip[3:]))
    if mon is not None:
        errors, disabled = mon.errors, set(mon.disabled)
        mon.close()
        assert errors == 0 and not disabled, (errors, disabled)
    os.makedirs(out, exist_ok=True)
    torch.save({n: _local(p).detach().clone() for n, p in m.named_parameters()}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()


def _run(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.use_deterministic_algorithms(True)
    if args.without:  # the same training without the agent first, in the same processes (one start-up)
        _train(rank, world, args, "", args.without)
    _train(rank, world, args, args.endpoint, args.out)
    dist.destroy_process_group()
    sys.stdout.write(f"{DONE} {rank}\n")  # one write: the ranks share the pipe
    sys.stdout.flush()


#: printed by each rank once its results are saved and its process group is gone (test_sharded.run_job)
DONE = "sharded_job: rank finished"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--endpoint", default="")
    ap.add_argument("--job", default="sharded")
    ap.add_argument("--out", required=True)
    ap.add_argument("--flip", default="")
    ap.add_argument("--without", default="", help="also train without the agent first, writing there")
    args = ap.parse_args()
    mp.spawn(_run, args=(args.ranks, free_port(), args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
