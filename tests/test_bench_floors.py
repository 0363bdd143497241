"""kdtree.bench.floors: a round's byte floor by part, on a small K2.6-layout model on the CPU, and the floor
fractions the K2.6 record's targets take from its rows."""
import dataclasses

import pytest

from kdtree import k26
from kdtree.bench import k26_record as KR
from kdtree.bench.floors import PARTS, round_floor, round_floor_parts
from kdtree.bench.decode_layers import expert_bytes
from kdtree.config import TINY_B
from kdtree.model import MoE


@pytest.fixture(scope="module")
def pair():
    small = dataclasses.replace(TINY_B, n_group=1, topk_group=1)
    t = k26.build_target(2, device="cpu", args=small, kernel_only=False)
    d = k26.build_drafter(t, args=k26.drafter_args(t.args, num_hidden_layers=2, hidden_size=small.hidden_size,
                                                   num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                                                   intermediate_size=128))
    return t, d


def test_parts_follow_the_routing_the_context_and_the_mode(pair):
    t, d = pair
    moe = [layer.mlp for layer in t.model.layers if isinstance(layer.mlp, MoE)]
    ar = round_floor_parts(t, None, "ar", 3.0, 96, 2)
    assert set(ar) == set(PARTS) and ar["drafter"] == ar["drafter_kv"] == 0
    assert ar["experts"] == round(3.0 * expert_bytes(moe[0].experts)) * len(moe)
    a = t.model.layers[0].self_attn.args
    row = (a.kv_lora_rank + a.qk_rope_head_dim) * 4   # a float32 cache row
    assert ar["kv"] == len(t.model.layers) * 2 * 96 * row
    assert ar["head"] == t.lm_head.weight.numel() * 4 + t.model.norm.weight.numel() * 4
    more = round_floor_parts(t, None, "ar", 6.0, 192, 2)
    assert more["experts"] == 2 * ar["experts"] and more["kv"] == 2 * ar["kv"]
    assert more["weights"] == ar["weights"] > 0
    dd = round_floor_parts(t, d, "ddtree", 3.0, 96, 2)
    assert {k: dd[k] for k in ("weights", "experts", "kv", "head")} == {k: ar[k] for k in
                                                                      ("weights", "experts", "kv", "head")}
    assert dd["drafter"] == k26.weight_bytes(d) + t.lm_head.weight.numel() * 4   # the shared lm_head again
    da = d.args
    assert dd["drafter_kv"] == 2 * 96 * len(d.layers) * 2 * da.num_key_value_heads * da.head_dim * 4


def test_the_draft_stage_reads_the_drafter_but_its_context_projection(pair):
    from kdtree.bench.floors import draft_stage_parts
    t, d = pair
    parts = round_floor_parts(t, d, "dflash", 2.0, 64, 1)
    own = draft_stage_parts(parts, d)
    fc = sum(p.numel() * p.element_size() for p in list(d.fc.parameters()) + list(d.hidden_norm.parameters()))
    assert own["drafter"] == parts["drafter"] - fc > 0 and own["drafter_kv"] == parts["drafter_kv"]
    assert all(own[k] == 0 for k in ("weights", "experts", "kv", "head"))


def test_the_floor_and_its_fraction(pair):
    parts = round_floor_parts(pair[0], pair[1], "dflash", 1.0, 64, 1)
    f = round_floor(parts, 2e9, 4e-3)
    total = sum(parts.values())
    assert f["bytes"] == total and f["s"] == pytest.approx(total / 2e9)
    assert f["fraction"] == pytest.approx(total / 2e9 / 4e-3)
    assert round_floor(parts, None, 4e-3)["s"] is None and round_floor(parts, 2e9, None)["fraction"] is None


@pytest.mark.parametrize("kw, needle", [
    (dict(mode="tree"), "mode='tree'"), (dict(experts_touched=-1.0), "experts_touched=-1.0"),
    (dict(context=-1), "context=-1"), (dict(batch=0), "batch=0"),
    (dict(mode="ddtree", drafter=None), "drafter"),
])
def test_bad_arguments_are_named(pair, kw, needle):
    args = dict(target=pair[0], drafter=pair[1], mode="ar", experts_touched=2.0, context=64, batch=1)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        round_floor_parts(**{**args, **kw})
    with pytest.raises(ValueError, match="parts"):
        round_floor({"weights": 1}, 1.0, 1.0)


def test_the_record_targets_the_rows_floor_fractions():
    base = dict(context=4096, batch=1, layers=6, run="r", tau_chain=5.0, block=8, fitted=False)
    rows = [dict(base, mode="ar", budget=None, tok_per_s=1.0, tau=1.0, floor={"fraction": 0.5}),
            dict(base, mode="dflash", budget=None, tok_per_s=2.0, tau=3.0, floor={"fraction": 0.4},
                 drafter_floor={"fraction": 0.6}),
            dict(base, mode="ddtree", budget=8, tok_per_s=3.0, tau=3.5, floor={"fraction": 0.45}),
            dict(base, mode="ddtree", budget=32, tok_per_s=2.5, tau=4.0, floor={"fraction": 0.7})]
    got = {t["key"]: t for t in KR.cell_targets(rows)}
    assert got["k26_ar_floor_fraction"]["measured"] == 0.5
    assert got["k26_ddtree_floor_fraction"]["measured"] == 0.45          # the fastest fixed budget's
    assert "B=8" in got["k26_ddtree_floor_fraction"]["name"]
    drafter = got["k26_drafter_floor_fraction"]
    assert drafter["measured"] == 0.6 and not drafter["met"]
    bare = [{k: v for k, v in r.items() if k not in ("floor", "drafter_floor")} for r in rows]
    assert not any("floor" in t["key"] for t in KR.cell_targets(bare))   # a CPU run's rows: no floor target
