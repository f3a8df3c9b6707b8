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

import functools
import hashlib
import itertools
import math
from typing import Optional

import msgspec
import numpy as np

from gradwatch import columns, wire


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


def place(digest: str, coord: tuple) -> str:
    """The key the aggregator holds a rank's schema and records by: the schema's hash, and the
    rank's coordinates on the schema's mesh when it has one (``"<hash>@3,1"``): ranks of one stage
    share a schema (:mod:`gradwatch.wire`), each is placed on its mesh by its header."""
    return f"{digest}@{','.join(map(str, coord))}" if coord else digest


def fits(mesh: Optional[wire.Mesh], coord: tuple) -> bool:
    """A rank at ``coord`` can be placed on ``mesh``: no coordinates without a mesh, else a point of it."""
    return mesh.fits(coord) if mesh is not None else not coord


def unplace(key: str) -> str:
    """The schema hash of a :func:`place` key."""
    return key.partition("@")[0]


_PARTS: dict[tuple, tuple] = {}  # (schema hash, stage) -> part: straggler asks per rank per step
# a digest of the parameter names -> a small number (parts compare in O(1)); the digest, not the
# names: held past their schemas, 16,384 entries of up to max_names names grew without bound
_NAMES: dict[bytes, int] = {}
_PARTS_MAX = 1 << 14


def part(schema: wire.Schema) -> tuple:
    """Which part of the model a rank runs: its pipeline stage (:func:`_stage`) and the names of
    the parameters its schema lists. Ranks with equal parts run the same layers on their own data
    (data-parallel peers: DDP, FSDP, HSDP replicas and shards, the ranks of one stage), so their
    own statistics and timings are comparable; ranks of different stages are not (a stage's norms
    and compute time are its own). ``(stage coordinates, number of the parameter names)``, cached
    by the schema's hash and the stage (a stage's ranks share both, whatever their other coordinates)."""
    stage = _stage(schema.mesh)
    got = _PARTS.get((unplace(schema.hash), stage))
    if got is None:
        if len(_PARTS) >= _PARTS_MAX or len(_NAMES) >= _PARTS_MAX:
            _PARTS.clear()
            _NAMES.clear()
        digest = hashlib.blake2b(msgspec.msgpack.encode([p[0] for p in schema.params]), digest_size=16).digest()
        names = _NAMES.setdefault(digest, len(_NAMES))
        got = _PARTS[(unplace(schema.hash), stage)] = (stage, names)
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


#: cap of a group's size (``prod(sizes[dims])``): a peer's mesh may claim sizes whose product no
#: int64 holds; no group of a job's ranks reaches it
_NEED_MAX = 1 << 62


class _Groups:
    """Numbered groups of ranks' entries, worked out with numpy over ranks x parameters (a 16,384-rank
    sharded job's round has ~3 million entries; keyed in Python they took seconds).

    Entries (rank x parameter) of one column whose mesh shape (names, sizes), dims and coordinates
    on the selected dims agree share a number in :attr:`group`, listed in rank order. Ranks
    with the same mesh shape, ``shard`` object and columns make one block, whose coordinates are
    numbered with one ``np.unique``: Python work per block and per distinct coordinates, not per entry.

    Attributes:
        rank: int32 [E] the entry's position in the per-rank lists.
        col: int32 [E] its parameter column.
        group: int32 (int64 past 2**31 numbers) [E] its group, 0 .. n - 1 (numbers without entries
            may be left unused).
        need: int64 [n] per group, ``prod(sizes[dims])`` (capped at :data:`_NEED_MAX`).
        n: the numbers' range.
    """

    def __init__(self, meshes: list, dims_of, on: bool, whole: bool = False):
        """``dims_of(k)``: rank position k's ``(shard, columns)``: the mesh dims of each of its
        parameters and their int64 [len(shard)] columns, or None to leave the rank out (as a rank without a mesh is). ``on``: group by
        the coordinates *on* each parameter's dims and the stage dims (the ranks holding the same
        bytes, :func:`holders`; parameters held whole left out unless the mesh has stages); else by
        those *off* its dims (the shard group, :func:`_off`; parameters held whole left out unless
        ``whole``)."""
        self._placed: dict[tuple, Optional[np.ndarray]] = {}  # (ranks, width) -> placed()
        blocks: dict[tuple, list[int]] = {}
        info: dict[tuple, tuple] = {}
        col_keys: dict[int, tuple] = {}  # id of a columns array -> (it, its bytes)
        for k, mesh in enumerate(meshes):
            if mesh is None or len(mesh.coord) != len(mesh.sizes):
                continue  # no mesh, or a schema's mesh with no rank placed on it (the state never lets one through)
            got = dims_of(k)
            if got is None:
                continue
            shard, cols = got
            if not shard:
                continue
            ck = col_keys.get(id(cols))  # placed ranks share one columns array: its bytes once
            if ck is None:
                ck = col_keys[id(cols)] = (cols, cols.tobytes())  # held: its id stays its own
            key = (mesh.names, mesh.sizes, id(shard), ck[1])
            members = blocks.get(key)
            if members is None:
                members = blocks[key] = []
                info[key] = (mesh, shard, cols)
            members.append(k)
        ids: dict[tuple, int] = {}  # (names, sizes, dims, selected coordinates) -> number
        needs: list[int] = []
        rank, col, gid = [], [], []
        for key, members in blocks.items():
            mesh, shard, cols = info[key]
            nd = len(mesh.names)
            staged = wire.stage_dims(mesh)
            K = np.asarray(members, np.int64)
            C = np.array([meshes[k].coord for k in members], np.int64).reshape(len(members), nd)
            by_dims: dict[tuple, list[int]] = {}
            for i, dims in enumerate(shard):
                if dims or (staged if on else whole):
                    by_dims.setdefault(tuple(dims), []).append(i)
            for dims, where in by_dims.items():
                sel = sorted(set(dims) | set(staged)) if on else [d for d in range(nd) if d not in dims]
                sel = [d for d in sel if d < nd]
                rows, inv = np.unique(C[:, sel], axis=0, return_inverse=True)
                need = min(math.prod(mesh.sizes[d] for d in dims if d < nd), _NEED_MAX)
                number = np.empty(len(rows), np.int64)
                for u, row in enumerate(rows.tolist()):
                    g = ids.setdefault((mesh.names, mesh.sizes, dims, tuple(row)), len(ids))
                    if g == len(needs):
                        needs.append(need)
                    number[u] = g
                c = cols[np.asarray(where, np.int64)].astype(np.int32)
                rank.append(np.repeat(K.astype(np.int32), len(c)))
                col.append(np.tile(c, len(K)))
                small = number.astype(np.int32) if len(ids) < 1 << 31 else number  # 4 bytes an entry
                gid.append(np.repeat(small[inv.reshape(-1)], len(c)))
        if not rank:
            self.rank = self.col = self.group = np.zeros(0, np.int32)
            self.need, self.n = np.zeros(0, np.int64), 0
            return
        # one piece (a job whose ranks share one schema's lists and dims): no copy; a 16,384-rank
        # mesh job has ~3 million entries, and each new array of them costs ~20 ms at its start
        rank, col, gid = (x[0] if len(x) == 1 else np.concatenate(x) for x in (rank, col, gid))
        if len(blocks) > 1:  # members in rank order, as one block lists them: sums in a fixed order
            order = np.argsort(rank, kind="stable")
            rank, col, gid = rank[order], col[order], gid[order]
        # a group is one set of coordinates *and* one column
        width = int(col.max()) + 1
        wide = len(ids) * width >= 1 << 31  # group numbers past int32
        group = (gid.astype(np.int64) if wide else gid.astype(np.int32, copy=False)) * width + col
        needs = np.asarray(needs, np.int64)
        if len(needs) * width > 4 * len(group):  # sparse (a peer's schema may make it so): number densely
            uniq, group = np.unique(group, return_inverse=True)
            need = needs[uniq // width]
        else:
            need = np.repeat(needs, width)
        group = group.reshape(-1)
        self.rank, self.col = rank, col
        self.group = group.astype(np.int32, copy=False) if len(need) < 1 << 31 else group
        self.need, self.n = need, len(need)

    @functools.cached_property
    def short(self) -> np.ndarray:
        """bool [n]: the groups with fewer members than they need (incomplete)."""
        return np.bincount(self.group, minlength=self.n) < self.need

    @functools.cached_property
    def index(self) -> np.ndarray:
        """:attr:`group` as intp, numpy's index type (an int32 index is converted on every use)."""
        return self.group.astype(np.intp)

    def placed(self, ranks: int, width: int) -> Optional[np.ndarray]:
        """For ``ranks`` rows of ``width`` columns, viewed flat (rank-major): int64 [E] each entry's
        row, or None where the entries are every row in order (a job whose ranks all shard every
        parameter alike). Kept: a job's rounds repeat their groups (:class:`~.reconcile.Layout`
        keeps them)."""
        if (ranks, width) not in self._placed:
            at = self.rank.astype(np.int64) * width + self.col
            self._placed[ranks, width] = None if len(at) == ranks * width and np.array_equal(at, np.arange(len(at))) else at
        return self._placed[ranks, width]


_KINDS: dict[tuple, tuple] = {}  # the dims of a rank's grad_sq classes -> (them, their columns)
_CACHED = 1024
_NORM_GROUPS: dict[tuple, tuple] = {}  # norms_of's groups by their meshes' and kinds' ids, position by position


def sq_kind(dims: tuple) -> tuple:
    """The one object standing for a rank's ``grad_sq`` classes ``dims`` (tuple of mesh-dim tuples,
    in the rank's order): ``(dims, int64 [len(dims)] columns 0..n-1)``. Equal dims give the same
    object (at most :data:`_CACHED` kept), so a step's ranks are matched to kept groups by id."""
    kind = _KINDS.get(dims)
    if kind is None:
        if len(_KINDS) >= _CACHED:
            _KINDS.clear()
        kind = _KINDS[dims] = (dims, np.arange(len(dims), dtype=np.int64))
    return kind


def global_norms(entries: dict[int, tuple[wire.Mesh, tuple]]) -> dict[int, float]:
    """Global gradient norm of every rank whose shard groups all reported.

    Args:
        entries: rank -> (its mesh, its report's ``grad_sq``: ``((dims, sum of squares), ...)``).

    Returns:
        rank -> its global norm (:func:`norms_of`), for the ranks whose every group is complete.
    """
    ranks = list(entries)
    kinds = [sq_kind(tuple(d for d, _ in sq)) for _, sq in entries.values()]
    values = [[v for _, v in sq] for _, sq in entries.values()]
    norm, ok = norms_of([m for m, _ in entries.values()], kinds, values)
    at = np.flatnonzero(ok)
    return dict(zip([ranks[k] for k in at.tolist()], norm[at].tolist()))


def gradless(norm: np.ndarray, own: np.ndarray, nonfinite: np.ndarray) -> np.ndarray:
    """Global gradient norms (float64 [R]) with NaN where there was no gradient at all: the
    rank had none (its own norm, float64 [R], NaN with no non-finite parameter, int [R] counts:
    the agent then sends 0.0 for each ``grad_sq`` class) and nor had the ranks its norm adds up
    (it is 0.0). A replica's norm is NaN there; sqrt(0) would read as a vanishing gradient. A
    pipeline rank of a frozen stage keeps the other stages' norm."""
    return np.where(np.isnan(own) & (nonfinite == 0) & (norm == 0.0), np.nan, norm)


def norms_of(meshes: list, kinds: list, values: list) -> tuple[np.ndarray, np.ndarray]:
    """Global gradient norms of ranks from their sums of squared gradient elements.

    Args:
        meshes: per rank, its placed mesh (``coord`` set).
        kinds: per rank, :func:`sq_kind` of its ``grad_sq`` classes' dims.
        values: per rank, the sum of squares of each class (floats, in its kind's order).

    Returns:
        ``(norm, complete)``: float64 [R], per rank sqrt(sum over its classes of the class's sums
        of squares summed over the class's shard group); bool [R], whether every group is
        complete (all ``prod(sizes[dims])`` members present; ``norm`` is NaN where not). Under
        pipeline parallelism (a mesh with stage dims, :func:`gradwatch.wire.stage_dims`) that sum
        is the rank's *stage total*; the rank's global norm is then sqrt of the stage totals of
        the ranks sharing its coordinates on every other dim, one per stage, once all stages'
        totals are complete. NaN and Inf propagate. Float64 sums, in rank order and each rank's
        order of classes.
    """
    R = len(meshes)
    # a rank's classes are its pseudo-parameters: column c its c-th class, grouped as shards are.
    # Every step of a job asks with the same ranks, places and classes: their groups are kept
    # (with the objects whose ids key them, so no id is reused while they are)
    key = (tuple(map(id, meshes)), tuple(map(id, kinds)))  # by position: the groups name positions
    hit = _NORM_GROUPS.get(key)
    if hit is None:
        if len(_NORM_GROUPS) >= 8:
            _NORM_GROUPS.clear()
        g = _Groups(meshes, kinds.__getitem__, on=False, whole=True)
        widths = np.array([len(k[0]) for k in kinds], np.int64)
        starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        staged = any(wire.stage_dims(m) for m in {(m.names, m.sizes): m for m in meshes}.values())
        complete = np.bincount(g.rank, g.short[g.group], minlength=R) == 0
        hit = _NORM_GROUPS[key] = (meshes, kinds, g, starts[g.rank] + g.col, int(widths.sum()), staged, complete)
    _, _, g, at, width, staged, complete = hit
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.fromiter(itertools.chain.from_iterable(values), np.float64, count=width)[at]
        share = np.bincount(g.index, v, minlength=g.n)[g.index]
        total = np.bincount(g.rank, share, minlength=R)
    if not staged:  # no pipeline stages (the usual mesh): the totals' roots
        with np.errstate(invalid="ignore"):
            return np.where(complete, np.sqrt(total), np.nan), complete.copy()
    # pipeline stages: each stage's total once (from the rank of the same pipeline replica)
    ok = np.flatnonzero(complete).tolist()
    stages: dict[tuple, dict[tuple, float]] = {}
    for k in ok:
        mesh, st = meshes[k], wire.stage_dims(meshes[k])
        if st:
            stages.setdefault(_off(mesh, st), {})[tuple(mesh.coord[d] for d in st)] = float(total[k])
    norm, done = np.full(R, np.nan), np.zeros(R, bool)
    for k in ok:
        mesh, t = meshes[k], float(total[k])
        st = wire.stage_dims(mesh)
        if st:
            per = stages[_off(mesh, st)]
            if len(per) < _size(mesh, st):
                continue  # a stage has not reported yet
            t = sum(per[s] for s in sorted(per))
        norm[k], done[k] = math.sqrt(t) if t >= 0 else math.nan, True
    return norm, done


def holders(meshes: list, shards: list, pcols: list, n_params: int) -> np.ndarray:
    """Which ranks hold the same bytes of each parameter.

    Args:
        meshes: per rank, its schema's mesh (None: every parameter whole).
        shards: per rank, its schema's ``shard`` (the mesh dims of each schema parameter).
        pcols: per rank, int64 [its schema's parameters]: their columns among ``n_params``.

    Returns:
        int64 [R, n_params]: ranks with equal numbers in a column hold the same bytes of that
        parameter: equal coordinates on the dims it is sharded along and on the pipeline-stage
        dims (0 for a parameter every rank holds whole, and everywhere without a mesh).
    """
    out = np.zeros((len(meshes), n_params), np.int64)
    g = _Groups(meshes, lambda k: (shards[k], pcols[k]), on=True)
    out[g.rank, g.col] = g.group + 1
    return out


def combine_params(meshes: list, shards: list, pcols: list, param: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-parameter rows of a round with each shard group combined into the global figures.

    Args:
        meshes: per rank of the round, its schema's mesh (None: every parameter whole).
        shards: per rank, its schema's ``shard`` (the mesh dims of each schema parameter).
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
    :class:`~.reconcile.Layout` keeps them). Each group's squares are summed in rank order, float64."""
    return combine(shard_groups(meshes, shards, pcols), param)


def shard_groups(meshes: list, shards: list, pcols: list) -> "_Groups":
    """The shard groups of a round's ranks (arguments as :func:`combine_params`'), for
    :func:`combine`: they depend only on the ranks' schemas and places, and a job's rounds repeat
    them (:class:`~.reconcile.Layout` keeps them)."""
    return _Groups(meshes, lambda k: (shards[k], pcols[k]), on=False)


def _norm_columns() -> frozenset:
    """The columns of ``param`` that are norms, whose shards combine as the square root of their
    summed squares (their merge rule's ``squares``, :data:`gradwatch.columns.MERGE_RULES`); every
    other column (a count) is summed.

    Raises:
        ValueError: a ``param`` column merges by a rule that is neither a norm nor a sum: its
            shards have no exact combination here.
    """
    out = set()
    for s in columns.of("param"):
        if columns.MERGE_RULES[s.merge].squares:
            out.add(s.column)
        elif s.merge != "sum":
            raise ValueError(f"{s.name}: a parameter's shards combine as a norm or a sum, not by {s.merge!r}")
    return frozenset(out)


def combine(g: "_Groups", param: np.ndarray) -> np.ndarray:
    """:func:`combine_groups` with the groups worked out (:func:`shard_groups`): a new array,
    ``param`` unchanged."""
    param = np.asarray(param, np.float64)
    if not g.n:
        return param.copy()
    src = param.reshape(-1, param.shape[2])  # rank-major rows
    at, group = g.placed(*param.shape[:2]), g.index
    total = np.empty((g.n, src.shape[1]))
    norms = _norm_columns()
    with np.errstate(invalid="ignore", over="ignore"):
        for f in range(src.shape[1]):  # a field at a time, contiguous (a 16,384-rank round has ~3 million entries)
            x = src[:, f].copy() if at is None else src[at, f]  # a copy: squared in place below
            if f in norms:
                np.multiply(x, x, out=x)  # a norm: its squares summed (a count is summed as it is)
            total[:, f] = np.bincount(group, x, minlength=g.n)  # in entry order: members in rank order
        for f in norms:
            np.sqrt(total[:, f], out=total[:, f])
    total[g.short] = np.nan
    if at is None:  # every row is an entry
        return np.take(total, group, axis=0).reshape(param.shape)
    out = param.copy()
    out.reshape(-1, param.shape[2])[at] = total[group]
    return out
