"""Sharded parameters (FSDP1, FSDP2, HSDP, tensor parallel): combining shard groups exactly.

Under a sharded layout each rank reports what *it holds*: per parameter the L2 norm of its local
shard, per step the sums of squared gradient elements of its local shards, grouped by the mesh
dimensions they are sharded along (``grad_sq``; see :mod:`gradwatch.wire`). A parameter sharded
along mesh dims ``D`` is split over the ranks whose coordinates agree on every other dimension:
its *shard group*. Summing the shard group's sums of squares and taking the square root gives the
global norm exactly (never an average of norms): ``||g||^2 = sum over shards of ||g_shard||^2``.

Ranks hold the same bytes of such a parameter when their coordinates agree on ``D``: the replicas
of one shard across HSDP's replicate dimension, every rank for a parameter ``Replicate``d over a
tensor-parallel group; under pipeline parallelism also on the stage dims (ranks of different
stages hold different parameters, even under equal names). :func:`holders` numbers those sets
so fingerprints and gradient norms are compared within them only (:mod:`.checks._fingerprints`). The global
norm under pipeline parallelism adds the stages' totals (:func:`global_norms`).

Pure functions; no torch.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from gradwatch import wire


def _off(mesh: wire.Mesh, dims) -> tuple:
    """Identity of a shard group: the mesh, and the coordinates on every dim not in ``dims``."""
    return (mesh.names, mesh.sizes, tuple(c for k, c in enumerate(mesh.coord) if k not in dims))


def _stage(mesh: Optional[wire.Mesh]) -> tuple:
    """A rank's pipeline stage: its coordinates on the mesh's stage dims (() without any)."""
    return () if mesh is None else tuple(mesh.coord[k] for k in wire.stage_dims(mesh) if k < len(mesh.coord))


def _on(mesh: wire.Mesh, dims) -> tuple:
    """Identity of what a rank holds of a parameter sharded along ``dims``: its coordinates there,
    and its pipeline stage (ranks of different stages never hold the same parameter)."""
    return (mesh.names, mesh.sizes, tuple(mesh.coord[k] for k in dims if k < len(mesh.coord)), _stage(mesh))


_PARTS: dict[str, tuple] = {}  # schema hash -> part: straggler asks per rank per step
_NAMES: dict[tuple, int] = {}  # parameter names -> a small number (parts compare in O(1))
_PARTS_MAX = 1 << 14


def part(schema: wire.Schema) -> tuple:
    """Which part of the model a rank runs: its pipeline stage (:func:`_stage`) and the names of
    the parameters its schema lists. Ranks with equal parts run the same layers on their own data
    (data-parallel peers: DDP, FSDP, HSDP replicas and shards, the ranks of one stage), so their
    own statistics and timings are comparable; ranks of different stages are not (a stage's norms
    and compute time are its own). ``(stage coordinates, number of the parameter names)``, cached
    by the schema's hash (which covers both)."""
    got = _PARTS.get(schema.hash)
    if got is None:
        if len(_PARTS) >= _PARTS_MAX or len(_NAMES) >= _PARTS_MAX:
            _PARTS.clear()
            _NAMES.clear()
        names = _NAMES.setdefault(tuple(p[0] for p in schema.params), len(_NAMES))
        got = _PARTS[schema.hash] = (_stage(schema.mesh), names)
    return got


def parts(schemas: list) -> np.ndarray:
    """int64 [len(schemas)]: :func:`part` of each schema numbered in order of first appearance
    (equal numbers: the same part of the model)."""
    ids: dict[tuple, int] = {}
    by_hash: dict[str, int] = {}  # one lookup per distinct schema: a job usually has one or a few
    out = np.empty(len(schemas), np.int64)
    for k, s in enumerate(schemas):
        if s.hash not in by_hash:
            by_hash[s.hash] = ids.setdefault(part(s), len(ids))
        out[k] = by_hash[s.hash]
    return out


def _size(mesh: wire.Mesh, dims) -> int:
    return math.prod(mesh.sizes[k] for k in dims if k < len(mesh.sizes))


def global_norms(entries: dict[int, tuple[wire.Mesh, tuple]]) -> dict[int, float]:
    """Global gradient norm of every rank whose shard groups all reported.

    Args:
        entries: rank -> (its mesh, its report's ``grad_sq``: ``((dims, sum of squares), ...)``).

    Returns:
        rank -> sqrt(sum over its ``grad_sq`` classes of the class's sums of squares summed over
        the class's shard group), for the ranks whose every group is complete (all
        ``prod(sizes[dims])`` members present). Under pipeline parallelism (a mesh with stage
        dims, :func:`gradwatch.wire.stage_dims`) that sum is the rank's *stage total*; the rank's
        global norm is then sqrt of the stage totals of the ranks sharing its coordinates on every
        other dim, one per stage, once all stages' totals are complete. NaN and Inf propagate.
    """
    acc: dict[tuple, list] = {}
    for mesh, sq in entries.values():
        for dims, v in sq:
            a = acc.setdefault((dims, _off(mesh, dims)), [0.0, 0])
            a[0] += v
            a[1] += 1
    totals = {}
    for r, (mesh, sq) in entries.items():
        total, ok = 0.0, True
        for dims, _ in sq:
            s, n = acc[(dims, _off(mesh, dims))]
            if n < _size(mesh, dims):
                ok = False
                break
            total += s
        if ok:
            totals[r] = total
    # pipeline stages: each stage's total once (from the rank of the same pipeline replica)
    stages: dict[tuple, dict[tuple, float]] = {}
    for r, total in totals.items():
        mesh, st = entries[r][0], wire.stage_dims(entries[r][0])
        if st:
            stage = tuple(mesh.coord[k] for k in st)
            stages.setdefault(_off(mesh, st), {})[stage] = total
    out = {}
    for r, total in totals.items():
        mesh = entries[r][0]
        st = wire.stage_dims(mesh)
        if st:
            per = stages[_off(mesh, st)]
            if len(per) < _size(mesh, st):
                continue  # a stage has not reported yet
            total = sum(per[s] for s in sorted(per))
        out[r] = math.sqrt(total) if total >= 0 else math.nan
    return out


def holders(meshes: list, shards: list, pcols: list, n_params: int) -> np.ndarray:
    """Which ranks hold the same bytes of each parameter.

    Args:
        meshes: per rank, its schema's mesh (None: every parameter whole).
        shards: per rank, its schema's ``shard`` (``((dims, numel), ...)`` per schema parameter).
        pcols: per rank, int64 [its schema's parameters]: their columns among ``n_params``.

    Returns:
        int64 [R, n_params]: ranks with equal numbers in a column hold the same bytes of that
        parameter: equal coordinates on the dims it is sharded along and on the pipeline-stage
        dims (0 for a parameter every rank holds whole, and everywhere without a mesh).
    """
    out = np.zeros((len(meshes), n_params), np.int64)
    ids: dict[tuple, int] = {(): 0}
    for k, (mesh, shard) in enumerate(zip(meshes, shards)):
        if mesh is None or not shard:
            continue
        staged = bool(wire.stage_dims(mesh))
        for j, (dims, _) in zip(pcols[k], shard):
            if dims or staged:
                out[k, j] = ids.setdefault((int(j), _on(mesh, dims)), len(ids))
    return out


def combine_params(meshes: list, shards: list, pcols: list, param: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-parameter rows of a round with each shard group combined into the global figures.

    Args:
        meshes: per rank of the round, its schema's mesh (None: every parameter whole).
        shards: per rank, its schema's ``shard`` (``((dims, numel), ...)`` per schema parameter).
        pcols: per rank, int64 [its schema's parameters]: their columns in ``param``.
        param: float64 [R, P, 3] (wire ``PARAM_FIELDS``: grad norm, weight norm, grad non-finite
            count) of what each rank holds, NaN where not present.

    Returns:
        ``(param, holders)``: float64 [R, P, 3] with every sharded parameter's row replaced, on
        every member of a complete shard group, by the group's global figures (norms: sqrt of the
        summed squares; non-finite counts: summed); NaN on members of an incomplete group. And
        :func:`holders` int64 [R, P].
    """
    return combine_groups(meshes, shards, pcols, param), holders(meshes, shards, pcols, param.shape[1])


def combine_groups(meshes: list, shards: list, pcols: list, param: np.ndarray) -> np.ndarray:
    """:func:`combine_params`' ``param`` alone (its ``holders`` depend only on the schemas:
    :class:`~.reconcile.Layout` keeps them)."""
    R = param.shape[0]
    out = param.copy()
    groups: dict[tuple, list[int]] = {}
    need: dict[tuple, int] = {}
    for k in range(R):
        mesh, shard = meshes[k], shards[k]
        if mesh is None or not shard:
            continue
        for j, (dims, _) in zip(pcols[k], shard):
            if dims:
                key = (int(j), dims, _off(mesh, dims))
                groups.setdefault(key, []).append(k)
                need[key] = _size(mesh, dims)
    with np.errstate(invalid="ignore"):
        for key, members in groups.items():
            j = key[0]
            key_rows = param[members, j]
            if len(members) < need[key]:
                out[members, j] = np.nan
                continue
            norms = np.sqrt(np.sum(key_rows[:, :2] ** 2, axis=0))
            out[members, j, 0] = norms[0]
            out[members, j, 1] = norms[1]
            out[members, j, 2] = key_rows[:, 2].sum()
    return out


def mesh_of(job, rank: int) -> Optional[wire.Mesh]:
    """The mesh of ``rank``'s current schema in ``job`` (a ``state.JobState``), or None."""
    r = job.ranks.get(rank)
    s = job.schemas.get(r.schema) if r is not None else None
    return s.mesh if s is not None else None



def part_of(job, rank: int) -> Optional[tuple]:
    """:func:`part` of ``rank``'s current schema in ``job`` (a ``state.JobState``), or None."""
    r = job.ranks.get(rank)
    s = job.schemas.get(r.schema) if r is not None else None
    return part(s) if s is not None else None
