"""kdtree.tp: tensor parallelism over torch.distributed, checked by the gloo dry-run on the CPU (8 local
ranks)."""
import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist

from kdtree import tp
from kdtree.config import TINY_B
from kdtree.model import build_model


def _sharded_fraction(model) -> tuple[int, int]:
    """(parameters that tp.shard splits, parameters it replicates) of an unsharded model."""
    split = rep = 0
    for name, p in model.named_parameters():
        s = any(k in name for k in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                                    "down_proj")) and "q_a_proj" not in name
        split, rep = (split + p.numel(), rep) if s else (split, rep + p.numel())
    return split, rep


@pytest.mark.slow
def test_dryrun_eight_ranks_matches_the_unsharded_model():
    ranks = tp.dryrun(world=8, backend="gloo", new_tokens=10, budget=16)
    assert [r["rank"] for r in ranks] == list(range(8))
    ref = build_model(dataclasses.replace(TINY_B, num_attention_heads=8), seed=1)
    split, rep = _sharded_fraction(ref)
    for r in ranks:
        assert r["logits_rel_err"] < 1e-5, r
        assert r["ddtree_equals_ar"] and r["ar_equals_unsharded"] and r["engine_batch_equals_oracle"], r
        assert r["tau_oracle"] > 1.5, r  # long accepted paths: the walk and compaction ran across shards
        assert r["params_unsharded"] == split + rep
        assert r["params_on_rank"] == rep + split // 8, r  # each rank holds 1/8 of what is split


def test_engine_runs_unchanged_on_two_gloo_ranks():
    """Each rank of world 2 serves a batch of requests through the engine; outputs equal its oracle loop's;
    with budget="auto" every rank verifies the plan rank 0 chose, round by round."""
    ranks = tp.dryrun(world=2, backend="gloo", new_tokens=8, budget=8, auto=True)
    for r in ranks:
        assert r["engine_batch_equals_oracle"] and r["ddtree_equals_ar"] and r["ar_equals_unsharded"], r
        assert r["logits_rel_err"] < 1e-5, r
        assert r["auto_equals_oracle"] and r["auto_plans"] == ranks[0]["auto_plans"] and r["auto_plans"], r


def test_shard_rejects_bad_input():
    m = build_model(TINY_B, seed=0)  # 4 heads
    with pytest.raises(ValueError, match="rank"):
        tp.shard(m, 2, 2)
    assert tp.shard(m, 0, 1) is m  # one rank: nothing to do
    with pytest.raises(RuntimeError, match="not initialised"):
        tp.shard(m, 0, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by world = 3"):
            tp.shard(build_model(TINY_B, seed=0), 0, 3)
        # 8 heads and every MLP split by 8, but 12 INT4 experts are not: refused before anything changes
        q = build_model(dataclasses.replace(TINY_B, num_attention_heads=8, n_routed_experts=12, n_group=1,
                                            topk_group=1), seed=0)
        q.quantize_experts()
        before = {k: v.clone() for k, v in q.state_dict().items()}
        with pytest.raises(ValueError, match="n_routed_experts = 12 is not divisible by world = 8"):
            tp.shard(q, 0, 8)
        after = q.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        # shapes that split, but the group has one process: rank/world disagree with it
        with pytest.raises(ValueError, match="rank=0, world=2 but this process is rank 0 of a group of 1"):
            tp.shard(build_model(TINY_B, seed=0), 0, 2)
        r = build_model(TINY_B, seed=0)
        r.tp = (0, 2)  # as shard leaves a sharded model
        with pytest.raises(ValueError, match=r"already sharded \(rank, world\) = \(0, 2\)"):
            tp.shard(r, 0, 2)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="backend='mpi'"):
        tp.dryrun(2, backend="mpi")
    with pytest.raises(ValueError, match=r"world=0: expected an int >= 1"):
        tp.dryrun(0)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (the nvidia-h200-x2 kind)")
def test_dryrun_two_gpus_nccl():
    """The same dry-run over NCCL, one GPU per rank."""
    ranks = tp.dryrun(world=2, backend="nccl", new_tokens=10, budget=16)
    for r in ranks:
        assert r["backend"] == "nccl" and r["logits_rel_err"] < 1e-4, r
        assert r["ddtree_equals_ar"] and r["ar_equals_unsharded"] and r["tau_oracle"] > 1.5, r


def test_dryrun_int4_experts_two_ranks():
    """INT4 routed experts under expert parallelism: each rank keeps its stacked block; ids of the other
    rank's experts are dropped by the grouping; the result equals the unsharded INT4 model."""
    ranks = tp.dryrun(world=2, backend="gloo", new_tokens=8, budget=8, int4=True)
    for r in ranks:
        assert r["int4"] and r["logits_rel_err"] < 1e-5 and r["ddtree_equals_ar"] \
            and r["ar_equals_unsharded"], r


def test_int4_expert_blocks_add_up_to_all_experts():
    """Int4Experts.select(lo, hi): the blocks' outputs (reference path) sum to the full module's."""
    from kdtree.model import Int4Experts
    ex = Int4Experts.random(8, 64, 32, seed=5, scale=0.05)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 64, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(7)])
    w = torch.rand(7, 3, generator=g)
    full = ex(x, w, ids)
    parts = sum(ex.select(lo, lo + 2)(x, w, ids) for lo in range(0, 8, 2))
    assert full.abs().max() > 0 and torch.allclose(parts, full, rtol=1e-5, atol=1e-6)
    assert ex.select(2, 4).select(1, 2).id_offset == 3
    with pytest.raises(ValueError, match="select"):
        ex.select(4, 4)


def test_world_sizes_that_do_not_divide_are_refused_before_spawning(monkeypatch):
    import torch.multiprocessing as mp
    monkeypatch.setattr(mp, "spawn", lambda *a, **k: pytest.fail("spawned ranks for an impossible world"))
    with pytest.raises(ValueError, match="world=3: num_attention_heads = 8 is not divisible"):
        tp.dryrun(world=3)
    with pytest.raises(ValueError, match="world=0"):
        tp.dryrun(world=0)
    tp.check_shardable(TINY_B, 4)
    with pytest.raises(ValueError, match="n_routed_experts = 16"):
        tp.check_shardable(TINY_B.replace(num_attention_heads=32), 32)


def test_allreduce_cost_on_two_gloo_ranks():
    """The all-reduce measurement's plumbing on the CPU: one row per size, times positive and growing with
    the bytes overall, a latency and a bandwidth for project_multi; bad settings refused before spawning."""
    r = tp.allreduce_cost(2, backend="gloo", sizes=(2**10, 2**22), repeats=5)
    assert [x["bytes"] for x in r["rows"]] == [2**10, 2**22] and r["world"] == 2 and r["backend"] == "gloo"
    assert all(x["median_s"] > 0 for x in r["rows"]) and r["latency_s"] == r["rows"][0]["median_s"]
    assert r["Bps"] > 0
    with pytest.raises(ValueError, match="world"):
        tp.allreduce_cost(1, backend="gloo")
    with pytest.raises(ValueError, match="sizes"):
        tp.allreduce_cost(2, backend="gloo", sizes=())


@pytest.mark.gpu
def test_allreduce_cost_on_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (the nvidia-h200-x2 kind)")
    r = tp.allreduce_cost(2, backend="nccl", sizes=(2**12, 2**24), repeats=20)
    assert 0 < r["latency_s"] < 1e-3 and r["Bps"] > 1e9
