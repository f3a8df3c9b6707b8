"""A tiny sharded training job for tests/test_sharded.py: real gloo processes on CPU.

``python -m tests.sharded_job MODE --ranks N --steps S --out DIR [--endpoint E --every K --job J]
[--flip STEP:RANK:PARAM[:BIT]]`` trains :func:`model` under ``MODE`` (fsdp2, fsdp1, fsdp1o (use_orig_params),
hsdp (2x2 mesh), tp (ColwiseParallel / RowwiseParallel and a replicated LayerNorm), pp (2 pipeline
stages, GPipe, FSDP2 over each stage's N/2 data-parallel ranks), ppdp (the same with plain
replicas, gradients all-reduced over dp by hand)), with the
agent attached when ``--endpoint`` is given, and writes each rank's local parameter tensors after
the last step to ``DIR/rank{r}.pt`` (for the bit-identity check). The data of rank ``r`` at step
``s`` is :func:`batch` ``(r, s)``; every rank of one data-parallel replica group sees its own batch,
tensor-parallel ranks share theirs. ``--flip`` flips one bit (BIT of the first element's
float32 bits, default 3: a low mantissa bit; 23: the lowest exponent bit, halving or doubling it;
29: an exponent bit set in every |x| in [2^-63, 2), zeroing it; 31: the sign)
of one rank's local weight shard after the optimizer step of STEP (silent data corruption).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

IN, HID, OUT, BATCH, SEED, LR = 8, 16, 4, 6, 5, 0.05


def model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, OUT), torch.nn.LayerNorm(OUT),
    )


def batch(replica: int, step: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(BATCH, IN, generator=g).to(dtype), torch.randn(BATCH, OUT, generator=g).to(dtype)


STAGES = 2  # pipeline stages of modes pp and ppdp: layers 0-1, then 2-3


def replicas(mode: str, world: int) -> int:
    """Data-parallel replicas (distinct batches per step) of a mode."""
    return 1 if mode == "tp" else world // STAGES if mode in ("pp", "ppdp") else world


def _stage(mode: str, m: torch.nn.Module, world: int):
    """Pipeline modes: the (pp, dp) mesh, and ``m`` with the other stage's layers replaced by
    Identity (every rank keeps the model's original parameter names, as torchtitan's split does)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (STAGES, world // STAGES), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    for i in range(4):
        if i // 2 != stage:
            m[i] = torch.nn.Identity()
    return mesh, stage


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
        from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)})

        def replicate(name, mod, mesh):
            for n, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(n, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))

        distribute_module(m[3], mesh, replicate, output_fn=lambda mod, out, mesh: out.to_local())
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
    raise ValueError(mode)


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


def _run(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.use_deterministic_algorithms(True)
    m, replica = _wrap(args.mode, model(), rank, world)
    mesh, schedule = None, None
    if args.mode in ("pp", "ppdp"):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        m, mesh = m
        stage = mesh.get_coordinate()[0]
        pstage = PipelineStage(m, stage, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
        # 2 micro-batches of BATCH/2; the schedule divides the summed gradients by 2 (scale_grads)
        schedule = ScheduleGPipe(pstage, n_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    mon = None
    if args.endpoint:
        from gradwatch.agent import attach

        # FSDP2 stages: the agent finds the (pp, dp) mesh as the root of the parameters' "dp" mesh;
        # DDP stages hold plain tensors: the mesh is given
        extra = {"mesh": mesh} if args.mode == "ppdp" else {}
        mon = attach(m, opt, endpoint=args.endpoint, every=args.every, job=args.job, rank=rank, world_size=world, **extra)
        assert type(mon).__name__ == "Monitor", mon
    flip = tuple(args.flip.split(":")) if args.flip else None
    for step in range(args.steps):
        x, y = batch(replica, step)
        if schedule is not None:
            if mesh.get_coordinate()[0] == 0:
                schedule.step(x)
            else:
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
    torch.save({n: _local(p).detach().clone() for n, p in m.named_parameters()}, os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


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
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(args.ranks, port, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
