"""aggregator/shards.py on hand-made meshes: pipeline stages (a "pp" mesh dimension)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradwatch import wire
from gradwatch.aggregator.shards import combine_params, global_norms

PP_DP = ("pp", "dp")


def mesh(pp: int, dp: int, names=PP_DP) -> wire.Mesh:
    return wire.Mesh(names, (2, 2), (pp, dp))


def test_stage_dims_by_name():
    assert wire.stage_dims(mesh(0, 0)) == (0,)
    assert wire.stage_dims(wire.Mesh(("dp", "pp_stage"), (2, 2), (0, 0))) == (1,)
    assert wire.stage_dims(wire.Mesh(("replicate", "shard"), (2, 2), (0, 0))) == ()
    assert wire.stage_dims(None) == ()


def test_pipeline_global_norm_adds_each_stage_once():
    # stage 0: a parameter FSDP-sharded over dp (dims (1,)); stage 1: the same plus a whole one
    entries = {
        0: (mesh(0, 0), (((1,), 1.0),)),
        1: (mesh(0, 1), (((1,), 2.0),)),
        2: (mesh(1, 0), (((), 5.0), ((1,), 3.0))),
        3: (mesh(1, 1), (((), 5.0), ((1,), 4.0))),
    }
    want = math.sqrt(1 + 2 + 5 + 3 + 4)  # stage 1's replicated class counted once per rank, not twice
    got = global_norms(entries)
    assert got == {r: pytest.approx(want) for r in range(4)}
    # a stage missing: no global norm for anyone yet (never a stage's norm passed off as global)
    assert global_norms({r: entries[r] for r in (0, 1)}) == {}
    # one replica of stage 1 only: ranks on its dp coordinate are not complete either (group of 2)
    assert global_norms({r: entries[r] for r in (0, 1, 2)}) == {}


def test_pipeline_holders_never_span_stages():
    # both stages name their parameter "w" (a hand-split model): held by different ranks' stages
    meshes = [mesh(0, 0), mesh(0, 1), mesh(1, 0), mesh(1, 1)]
    shards = [(((), 4),)] * 4  # plain replicas within a stage
    pcols = [np.array([0])] * 4
    param = np.ones((4, 1, 3))
    _, holders = combine_params(meshes, shards, pcols, param)
    h = holders[:, 0]
    assert h[0] == h[1] and h[2] == h[3] and h[0] != h[2]
