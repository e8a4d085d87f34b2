import itertools

import pytest
import torch

from sixfold.config import ConfigError
from sixfold.join import pick_device
from sixfold.mesh import GROUP_DIMS, GROUP_NAMES, ORDER, ParallelDims


def test_rank_formulas():
    d = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2)
    for r in range(d.world_size):
        c = d.coords(r)
        assert c["tp"] == r % 2
        assert c["dp_shard"] == (r // 2) % 2
        assert c["dp_replicate"] == (r // 4) % 2
        assert c["pp"] == r // 8
        assert d.rank_of(c) == r


def test_groups_partition_world():
    for sizes in itertools.product([1, 2], repeat=5):
        d = ParallelDims(*sizes)
        for name in GROUP_NAMES:
            groups = d.all_groups(name)
            assert sorted(r for g in groups for r in g) == list(range(d.world_size)), name


def test_groups_are_the_ranks_that_share_every_other_coordinate():
    """Each group, by its coordinates (coords()): the ranks equal on every dimension outside the group's, ep and
    edp within a (pp, tp) pair by their own coordinates, pp_ends the first and last stages' ranks (a middle one
    alone); each in rising rank order."""
    same = {"ep": ("pp", "tp", "edp"), "edp": ("pp", "tp", "ep"), "pp_ends": ("tp", "cp", "dp_shard", "dp_replicate")}
    for pp, dp_replicate, dp_shard, cp, tp in itertools.product((1, 3), (1, 2), (2, 4), (1, 3), (1, 2)):
        for ep in (e for e in (1, 2, 4) if dp_shard * cp % e == 0):
            d = ParallelDims(pp, dp_replicate, dp_shard, cp, tp, ep)
            coords = [d.coords(r) for r in range(d.world_size)]
            for name in GROUP_NAMES:
                keys = same.get(name) or [k for k in ORDER if k not in GROUP_DIMS[name]]
                for r, c in enumerate(coords):
                    ranks = tuple(q for q, o in enumerate(coords) if all(o[k] == c[k] for k in keys))
                    if name == "pp_ends":
                        ends = {0, pp - 1}
                        ranks = tuple(q for q in ranks if coords[q]["pp"] in ends) if c["pp"] in ends else (r,)
                    assert d.group_ranks(name, r) == ranks, (d, name, r)


def test_sixteen_ranks_with_ep():
    d = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2, ep=2)
    assert d.world_size == 16
    assert d.group_ranks("tp", 5) == (4, 5)
    assert d.group_ranks("cp", 0) == (0, 2)
    assert d.group_ranks("pp", 3) == (3, 11)
    assert d.group_ranks("fsdp", 1) == (1, 3, 5, 7)
    assert d.group_ranks("batch", 0) == (0, 4)
    assert d.group_ranks("loss", 8) == (8, 10, 12, 14)
    # ep: consecutive members of the flattened (dp_shard, cp) index, same tp and pp
    assert d.group_ranks("ep", 0) == (0, 2)
    assert d.group_ranks("ep", 4) == (4, 6)
    assert d.group_ranks("edp", 0) == (0, 4)
    assert d.group_ranks("edp", 2) == (2, 6)
    for r in range(16):
        ep, edp = set(d.group_ranks("ep", r)), set(d.group_ranks("edp", r))
        assert ep & edp == {r}
        assert len(ep) * len(edp) == len(d.group_ranks("fsdp", r)) * d.dp_replicate


def test_ep_with_replicas():
    d = ParallelDims(dp_replicate=2, dp_shard=4, ep=2)
    assert d.group_ranks("ep", 0) == (0, 1)
    assert d.group_ranks("edp", 0) == (0, 2, 4, 6)


def test_bad_ep():
    with pytest.raises(ConfigError, match="parallel.ep=3 must divide"):
        ParallelDims(dp_shard=2, ep=3)


def test_a_group_crosses_nodes_where_any_of_its_kind_holds_ranks_of_two():
    """Against every group's ranks: tp=4 on nodes of 6 GPUs crosses (ranks 4-7), though rank 0's group does not."""
    shapes = [dict(tp=4, dp_shard=3), dict(cp=4, dp_replicate=3), dict(pp=3, tp=2, dp_shard=2),
              dict(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4), dict(dp_shard=3, cp=2, ep=3)]
    for shape, per_node in itertools.product(shapes, (1, 2, 3, 4, 6, 8, 12)):
        d = ParallelDims(**shape)
        for name in GROUP_NAMES:
            whole = any(len({r // per_node for r in g}) > 1 for g in d.all_groups(name))
            assert d.crosses_nodes(name, per_node) == whole, (shape, per_node, name)
    assert ParallelDims(tp=4, dp_shard=3).crosses_nodes("tp", 6)


def test_a_rank_without_a_gpu_of_its_own_is_refused(monkeypatch):
    """More ranks on a machine than GPUs it shows: named, not CUDA's invalid device ordinal."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"local rank 1 has no GPU of its own: this machine shows 1 "
                                          r"\(CUDA_VISIBLE_DEVICES=3\); start at most 1 ranks on it"):
        pick_device()
