"""kdtree.tp: tensor parallelism over torch.distributed, checked by the gloo dry-run on the CPU (8 local ranks)."""
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
        assert r["ddtree_equals_ar"] and r["ar_equals_unsharded"], r
        assert r["tau_oracle"] > 1.5, r  # long accepted paths: the walk and compaction ran across shards
        assert r["params_unsharded"] == split + rep
        assert r["params_on_rank"] == rep + split // 8, r  # each rank holds 1/8 of what is split


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
        q = build_model(TINY_B, seed=0).quantize_experts()
        before = {k: v.clone() for k, v in q.state_dict().items()}
        with pytest.raises(NotImplementedError, match="INT4 routed experts"):
            tp.shard(q, 0, 2)
        after = q.state_dict()  # a rejected call changes nothing
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="backend='mpi'"):
        tp.dryrun(2, backend="mpi")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (the nvidia-h200-x2 kind)")
def test_dryrun_two_gpus_nccl():
    """The same dry-run over NCCL, one GPU per rank."""
    ranks = tp.dryrun(world=2, backend="nccl", new_tokens=10, budget=16)
    for r in ranks:
        assert r["backend"] == "nccl" and r["logits_rel_err"] < 1e-4, r
        assert r["ddtree_equals_ar"] and r["ar_equals_unsharded"] and r["tau_oracle"] > 1.5, r
