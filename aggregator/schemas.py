"""The schema store: each job's schemas, their placed copies on a mesh, and the bytes they hold.

A schema is kept once per job, by hash (content-addressed: every rank of a stage sends the same
one); names over ``max_label_len`` characters are cut, keeping a digest of the whole so labels stay
distinct (:meth:`SchemaStore.short_names`).

* **Places on a mesh.** The ranks of one pipeline stage share a schema whatever their other mesh
  coordinates; each message's header says where its rank is (``wire.Header.coord``). A job keeps
  each schema once, by hash, and each rank's place as a placed copy (its lists shared, a mesh with
  the rank's coordinates) under :func:`.shards.place`'s key, which the rank's records are then
  held by. A header whose coordinates are not a point of its schema's mesh is rejected
  (``bad_coord``), and a message naming a placed key as its schema (``unknown_schema``), before
  either changes anything (:meth:`SchemaStore.misplaced`).
* **Memory.** An admitted job holds at most :data:`SCHEMAS_PER_RANK` schemas per rank of its world
  plus :data:`SCHEMAS_MIN`, placed copies included: at the cap those no rank, open round or
  waiting step uses go at once (else at the state's once-a-second scan), past it a new one is
  rejected (``schema_limit``). All jobs' schemas stay within ``max_schema_bytes``
  (:func:`schema_cost`); those of jobs not proven (pending, or holding a slot but not proven:
  :mod:`.admission`) within :data:`WAITING_SHARE` of it (64 MiB as shipped), so frames of invented
  jobs hold little memory and cannot crowd out running ones; a pending job holds at most
  2 x ``max_pending_ranks`` schemas (its ranks' placed copies among them).
"""

from __future__ import annotations

import hashlib
from typing import Optional

import msgspec

from gradwatch import wire

from .jobs import JobState, RankState, Registry
from .limits import Limits
from .shards import fits, place, unplace

#: schemas an admitted job holds at most, per rank of its world and besides: each rank's placed
#: one and its stage's own in use, and as many again while a new model's schemas arrive
SCHEMAS_PER_RANK, SCHEMAS_MIN = 4, 64

#: share of ``max_schema_bytes`` the schemas of every job not proven hold together at most
WAITING_SHARE = 1 / 16

#: bytes a placed copy of a schema is counted as (a struct and a mesh; the lists are the schema's)
PLACED_COST = 256


def schema_cost(s: wire.Schema) -> int:
    """Approximate bytes ``s`` holds as kept, for ``max_schema_bytes``: per parameter ~200 plus
    its name's and dtype's characters and 8 per dim of its shape, per slot ~270 plus its strings'
    characters (CPython 3.11 tuples and str objects; a 100-layer model's schema: ~67 kB counted,
    75 kB measured with tracemalloc)."""
    n = 256 + len(s.host)
    for name, shape, dtype in s.params:
        n += 200 + len(name) + 8 * len(shape) + len(dtype)
    for module, out, kind, dtype in s.slots:
        n += 270 + len(module) + len(out) + len(kind) + len(dtype)
    return n

class SchemaStore:
    """Every job's schemas: what a message's schema and place say (:meth:`misplaced`), keeping
    schemas within the bounds (:meth:`keep`, :meth:`room_for`), placing ranks (:meth:`place`),
    answering the decoder (:meth:`known`, :meth:`sizes`).

    Args:
        registry: the jobs (a pending job holding schemas may be evicted to make room).
        limits: ``max_schema_bytes``, ``max_pending_ranks``, ``max_label_len``.
    """

    def __init__(self, registry: Registry, limits: Limits):
        self.registry, self.limits = registry, limits

    def known(self, h: wire.Header, digest: str):
        """The job's schema of that hash, if it holds one (wire.decode: resends are not parsed again).
        Never a placed copy (a :func:`.shards.place` key is the aggregator's, not a wire hash)."""
        job = self.registry.of(h)
        return job.schemas.get(digest) if job and "@" not in digest else None

    def sizes(self, h: wire.Header, digest: str):
        """``(parameters, slots)`` of the job's schema of that hash, ``(None, None)`` when it holds none."""
        job = self.registry.of(h)
        s = job.schemas.get(digest) if job and "@" not in digest else None
        return (len(s.params), len(s.slots)) if s else (None, None)

    @staticmethod
    def misplaced(job: JobState, r: Optional[RankState], msg) -> Optional[str]:
        """Why ``msg`` may not change the job for its schema or place, or None: it names a placed
        copy (``unknown_schema``: the aggregator's key, no wire hash), or coordinates its schema's
        mesh does not have (``bad_coord``; unless the rank's previous message had this place)."""
        h = msg.header
        digest = msg.hash if isinstance(msg, wire.Schema) else msg.schema
        if "@" in digest:
            return "unknown_schema"
        same_place = r is not None and r.placed[0] == digest and r.placed[1] == h.coord  # checked before
        held = None if same_place else msg if isinstance(msg, wire.Schema) else job.schemas.get(digest)
        if held is not None and not fits(held.mesh, h.coord):
            return "bad_coord"
        return None

    def keep(self, job: JobState, msg) -> Optional[str]:
        """A schema message the job does not hold yet is kept (:meth:`keep_schema`); ``schema_limit``
        when it has no room. None otherwise."""
        if isinstance(msg, wire.Schema) and msg.hash not in job.schemas:
            if not self.keep_schema(job, msg):
                return "schema_limit"
            self.registry.version += 1
        return None

    def place_of(self, job: JobState, r: Optional[RankState], digest: str, coord: tuple) -> Optional[str]:
        """The key the rank's records under schema ``digest`` at ``coord`` are held by: as its
        previous message's when it had the same place, else :meth:`place`'s."""
        if r is not None and r.placed[0] == digest and r.placed[1] == coord and r.placed[2] in job.schemas:
            return r.placed[2]  # placed as its previous message was (every message of a mesh rank asks)
        return self.place(job, digest, coord)

    @staticmethod
    def prune(job: JobState, keep: str = "") -> None:
        """Keep only the schemas ``job``'s ranks, open rounds and waiting steps (their norms, NaN
        guards and shard sums name their place's key) use, a placed one's own, and ``keep``."""
        used = {r.schema for r in job.ranks.values()}
        used.update(rep.schema for rnd in job.rounds.values() for rep in rnd.reports.values())
        t = job.table
        if t is not None:
            for per in (t.norms, t.grad_sq, t.guard):
                used.update(e[0] for d in per.values() for e in d.values())
        used.update([unplace(k) for k in used])  # a placed schema's own, which resends name
        used.add(keep)
        job.keep_schemas(used)

    def room_for(self, job: JobState, cost: int, keep: str = "") -> bool:
        """Whether ``job`` may keep one more schema (its own or a placed copy) of ``cost`` bytes.

        Counts: a job holding a slot holds fewer than :data:`SCHEMAS_PER_RANK` per rank of its
        world plus :data:`SCHEMAS_MIN`; a pending job, whose world is only what its frames claim,
        fewer than 2 x ``max_pending_ranks`` (kept for its ranks until it has a slot). Bytes: all
        jobs' schemas within ``max_schema_bytes`` (:func:`schema_cost`), those of jobs not proven
        within :data:`WAITING_SHARE` of it, so they cannot crowd out the running ones (other such
        jobs holding schemas are evicted to make room: pending ones first, then the one whose
        proof got least far, the least recently heard among equals). A proven job over either
        drops the schemas no one uses first (else the TTL scan does; ``keep`` is never dropped).
        Frames under the job's identity cannot make it hold more."""
        limit = self.limits.max_schema_bytes
        if not job.admitted and len(job.schemas) >= 2 * self.limits.max_pending_ranks:
            return False
        if not (job.admitted and job.proven):
            while True:
                waiting = [j for j in self.registry.jobs.values() if not (j.admitted and j.proven)]
                if sum(j.schema_bytes for j in waiting) + cost <= limit * WAITING_SHARE:
                    break
                others = [j for j in waiting if j is not job and j.schema_bytes]
                if not others:
                    return False
                self.registry.evict(min(others, key=lambda j: (j.admitted, j.progress, j.touched)))
            if not job.admitted:
                return sum(j.schema_bytes for j in self.registry.jobs.values()) + cost <= limit
        cap = SCHEMAS_PER_RANK * job.world + SCHEMAS_MIN
        others = sum(j.schema_bytes for j in self.registry.jobs.values() if j is not job)
        if len(job.schemas) >= cap or others + job.schema_bytes + cost > limit:
            self.prune(job, keep)  # leaves at most the ~2 per rank in use
        return len(job.schemas) < cap and others + job.schema_bytes + cost <= limit

    def keep_schema(self, job: JobState, msg: wire.Schema) -> bool:
        """Hold ``msg`` (names cut, :meth:`short_names`) as the job's schema of its hash, if it
        has room (:meth:`room_for`). False: not kept."""
        kept = self.short_names(msg)
        cost = schema_cost(kept)
        if not self.room_for(job, cost):
            return False
        job.hold_schema(msg.hash, kept, cost)
        return True

    def place(self, job: JobState, digest: str, coord: tuple) -> Optional[str]:
        """The key rank records under schema ``digest`` are held by, for a rank at ``coord``
        (:func:`.shards.place`), its placed schema made when first asked (the schema's lists, a mesh
        with the coordinates); ``digest`` itself without a mesh. None when the job does not hold the
        schema, or ``coord`` is not a point of its mesh (:meth:`misplaced` rejected those before); ``""``
        when a placed copy is to be made and the job has no room for one (:meth:`room_for`)."""
        s = job.schemas.get(digest)
        if s is None or not fits(s.mesh, coord):
            return None
        if s.mesh is None:
            return digest
        key = place(digest, coord)
        if key not in job.schemas:
            if not self.room_for(job, PLACED_COST, keep=digest):
                return ""
            job.hold_schema(key, msgspec.structs.replace(s, mesh=wire.Mesh(s.mesh.names, s.mesh.sizes, coord), hash=key),
                            PLACED_COST)
        return key

    def short_names(self, s: wire.Schema) -> wire.Schema:
        """``s`` with label values over ``max_label_len`` characters cut (a layer's module path
        plus output suffix; a parameter's owning module), each cut part keeping 8 hex chars of its
        whole text's BLAKE2b digest so that cut names stay distinct. A parameter keeps its last
        component (``.weight``), which names its owning module (:mod:`.reconcile`)."""
        n = self.limits.max_label_len

        def cut(text: str, room: int) -> str:
            if len(text) <= room:
                return text
            return text[: max(room - 10, 0)] + "~" + hashlib.blake2b(text.encode(), digest_size=4).hexdigest() + "~"

        def slot(m: str, o: str) -> tuple[str, str]:
            o = cut(o, 32)
            return cut(m, n - len(o)), o

        def param(name: str) -> str:
            owner, dot, leaf = name.rpartition(".")
            leaf = cut(leaf, 32)
            return cut(owner, n - len(leaf) - 1) + dot + leaf

        if all(len(p[0]) <= n for p in s.params) and all(len(x[0]) + len(x[1]) <= n for x in s.slots):
            return s
        params = tuple((param(a), b, c) for a, b, c in s.params)
        slots = tuple((*slot(a, b), c, d) for a, b, c, d in s.slots)
        return msgspec.structs.replace(s, params=params, slots=slots, hash=s.hash)
