"""The job's parallel layout, found from the model alone: what each rank holds of each parameter.

Under DDP every rank holds every parameter whole. Under FSDP2 (``fully_shard``), HSDP and tensor
parallelism parameters are DTensors whose ``placements`` say, per dimension of a DeviceMesh,
whether the rank holds a ``Shard`` or a ``Replicate`` of it. Under FSDP1
(``FullyShardedDataParallel``) the module holds a ``FlatParameter`` per wrapped unit: the rank's
shard of the concatenation of the original parameters (``_fqns``, ``_shapes``), each original's
part in the shard given by ``_shard_param_infos`` (offset and length; absent parts are empty).

:func:`detect` turns any of these into one list of :class:`Local` views, one per original
parameter in ``named_parameters`` order, each giving the rank's *local* weight and gradient as a
plain tensor (what :mod:`.measure` reduces), plus the mesh (``wire.Mesh``) and, per parameter,
the mesh dimensions it is sharded along. Under pipeline parallelism each rank holds its stage's
parameters only; the job's mesh (the root of the parameters' sub-mesh, or ``attach(mesh=)``)
then has a stage dimension (``pp``), along which nothing is sharded. Nothing here communicates: the aggregator combines the
shards' sums of squares into global norms (see :mod:`gradwatch.wire`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from gradwatch import wire

from .hooks import normalise


class Local:
    """One parameter as this rank holds it, duck-typed as a parameter for :mod:`.measure`:
    ``grad`` is the local gradient (a plain tensor, or None), ``detach()`` the local weight."""

    __slots__ = ("_weight", "_grad")

    def __init__(self, weight: Callable[[], torch.Tensor], grad: Callable[[], Optional[torch.Tensor]]):
        self._weight, self._grad = weight, grad

    @property
    def grad(self) -> Optional[torch.Tensor]:
        return self._grad()

    def detach(self) -> torch.Tensor:
        return self._weight().detach()


@dataclass(frozen=True)
class Layout:
    """What this rank holds of the model.

    Attributes:
        params: the parameters' local views, schema order (plain parameters under DDP).
        meta: ``(original name, global shape, dtype)`` per parameter: the schema's ``params``.
        mesh: the device mesh, or None when every rank holds every parameter whole.
        shard: ``(mesh dims sharded along, local element count)`` per parameter; () without a mesh.
        kind: "plain", "dtensor" or "fsdp1" (for logs and tests).
    """

    params: list
    meta: tuple
    mesh: Optional[wire.Mesh] = None
    shard: tuple = ()
    kind: str = "plain"

    @property
    def dims(self) -> tuple:
        """Per parameter, the mesh dims it is sharded along (() without a mesh)."""
        return tuple(d for d, _ in self.shard)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _is_dtensor(t) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _local(t):
    """A DTensor's local tensor (no dispatch, no autograd view); any other tensor as it is."""
    if t is None or not _is_dtensor(t):
        return t
    lt = getattr(t, "_local_tensor", None)
    return lt if lt is not None else t.to_local()


def _mesh_of(dm) -> wire.Mesh:
    names = tuple(dm.mesh_dim_names or (f"dim{i}" for i in range(dm.ndim)))
    coord = dm.get_coordinate()
    return wire.Mesh(names, tuple(int(s) for s in dm.shape), tuple(int(c) for c in coord))


def _fsdp1_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """``(normalised prefix, FSDP module, flat parameter)`` of every FSDP1 unit in ``model``."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except Exception:  # pragma: no cover - torch built without distributed
        return []
    out = []
    for name, m in model.named_modules():
        handle = getattr(m, "_handle", None) if isinstance(m, FSDP) else None
        if handle is not None and getattr(handle, "flat_param", None) is not None:
            out.append((normalise(name), m, handle.flat_param))
    return out


def _flat_shard(fp) -> Optional[torch.Tensor]:
    """The rank's shard of flat parameter ``fp`` (its data outside forward/backward)."""
    size = getattr(fp, "_sharded_size", None)
    t = fp.detach()
    if size is not None and t.numel() != size.numel():
        t = getattr(fp, "_local_shard", t)
    return t


def _flat_grad(fp) -> Optional[torch.Tensor]:
    g = fp.grad
    size = getattr(fp, "_sharded_size", None)
    if g is None or (size is not None and g.numel() != size.numel()):
        return None  # no gradient, or an unsharded one (no_sync): nothing to say about the shard
    return g


def _slice(t: Optional[torch.Tensor], off: int, n: int) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().reshape(-1)[off : off + n]


def _fsdp1_params(model) -> tuple[dict, dict, Optional[wire.Mesh]]:
    """Views of every FSDP1 original parameter: ``{id(flat param): [entries]}``, ``{id(original
    parameter): entry}`` (use_orig_params) and the mesh. An entry is ``(name, shape, dtype,
    Local, (dims, numel))``."""
    by_flat, by_orig, mesh = {}, {}, None
    for prefix, unit, fp in _fsdp1_units(model):
        pg = getattr(unit, "process_group", None)
        inter = getattr(unit, "_inter_node_pg", None)
        sharded = getattr(getattr(unit, "_handle", None), "uses_sharded_strategy", True)
        if mesh is None and pg is not None:
            import torch.distributed as dist

            if inter is not None:  # HYBRID_SHARD: replicate across nodes, shard within one
                mesh = wire.Mesh(("replicate", "shard"), (inter.size(), pg.size()),
                                 (dist.get_rank(inter), dist.get_rank(pg)))
            else:
                mesh = wire.Mesh(("shard",), (pg.size(),), (dist.get_rank(pg),))
        dims = (len(mesh.names) - 1,) if (sharded and mesh is not None) else ()
        entries = []
        infos = getattr(fp, "_shard_param_infos", None) or [None] * len(fp._fqns)
        for i, (fqn, shape, numel) in enumerate(zip(fp._fqns, fp._shapes, fp._numels)):
            info = infos[i]
            if info is not None and info.in_shard:
                off, n = int(info.offset_in_shard), int(info.numel_in_shard)
            elif info is not None:
                off, n = 0, 0  # this rank holds none of it: an empty shard, sum of squares 0
            else:  # not sharded: the whole parameter, in order
                off, n = sum(int(x) for x in fp._numels[:i]), int(numel)
            local = Local(lambda fp=fp, off=off, n=n: _slice(_flat_shard(fp), off, n),
                          lambda fp=fp, off=off, n=n: _slice(_flat_grad(fp), off, n))
            name = f"{prefix}.{fqn}" if prefix else fqn
            entries.append((normalise(name), tuple(shape), _dtype(fp), local, (dims, n)))
        by_flat[id(fp)] = entries
        for orig, e in zip(getattr(fp, "_params", None) or (), entries):
            by_orig[id(orig)] = e
    return by_flat, by_orig, mesh


def _root(dm, named) -> object:
    """The root of sub-mesh ``dm`` (``init_device_mesh(...)["dp"]`` under pipeline parallelism),
    when every DTensor parameter's mesh dimensions are named in it; else ``dm`` itself."""
    try:
        root = dm._get_root_mesh()
    except Exception:
        return dm
    names = set(root.mesh_dim_names or ())
    for _, p in named:
        if _is_dtensor(p) and not set(p.device_mesh.mesh_dim_names or ("?",)) <= names:
            return dm  # a flattened or unnamed sub-mesh: its own dims are the best we know
    return root


def detect(model: torch.nn.Module, mesh=None) -> Layout:
    """The layout of ``model`` (already unwrapped from DDP and torch.compile).

    Args:
        model: the module this rank trains (under pipeline parallelism: its stage).
        mesh: the job's whole ``DeviceMesh`` (``attach(..., mesh=)``), or None to find it from the
            parameters (the root of their DTensors' meshes). Needed when parameters are plain
            tensors but the rank is one of several pipeline stages (a dimension named ``pp``,
            :func:`gradwatch.wire.stage_dims`), e.g. DDP within a stage. FSDP1 units keep the mesh
            of their own process groups.

    Returns:
        A :class:`Layout`: plain parameters without a mesh under DDP or a single process; local
        views, the mesh and shard dims under FSDP1, FSDP2, HSDP, tensor and pipeline parallelism.
    """
    named = list(model.named_parameters())
    by_flat, by_orig, wmesh = _fsdp1_params(model)
    if wmesh is None and mesh is not None:
        wmesh = _mesh_of(mesh)
    if wmesh is None:  # DTensors: the mesh with the most dimensions names them all; its root the job
        dmesh = None
        for _, p in named:
            if _is_dtensor(p) and (dmesh is None or p.device_mesh.ndim > dmesh.ndim):
                dmesh = p.device_mesh
        wmesh = _mesh_of(_root(dmesh, named)) if dmesh is not None else None
    mesh = wmesh
    if mesh is None:
        return Layout([p for _, p in named], tuple((normalise(n), tuple(p.shape), _dtype(p)) for n, p in named))
    params, meta, shard = [], [], []
    for n, p in named:
        entries = by_flat.get(id(p)) or ([by_orig[id(p)]] if id(p) in by_orig else None)
        if entries is None:
            entries = [_dtensor_entry(normalise(n), p, mesh)]
        for name, shape, dtype, local, sh in entries:
            params.append(local)
            meta.append((name, shape, dtype))
            shard.append(sh)
    kind = "fsdp1" if by_flat else "dtensor" if any(_is_dtensor(p) for _, p in named) else "plain"
    return Layout(params, tuple(meta), mesh, tuple(shard), kind)


def _dtensor_entry(name: str, p, mesh: wire.Mesh):
    if not _is_dtensor(p):  # a plain parameter next to DTensors: every rank holds it whole
        return name, tuple(p.shape), _dtype(p), p, ((), p.numel())
    pm = p.device_mesh
    pnames = tuple(pm.mesh_dim_names or ())
    dims = []
    for i, pl in enumerate(p.placements):
        if pl.is_shard():
            # a parameter on a sub-mesh: its dimension by name in the job's mesh
            j = mesh.names.index(pnames[i]) if i < len(pnames) and pnames[i] in mesh.names else i
            dims.append(j)
    local = Local(lambda p=p: _local(p), lambda p=p: _local(p.grad))
    return name, tuple(p.shape), _dtype(p), local, (tuple(sorted(dims)), _local(p).numel())
