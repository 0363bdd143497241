"""The engine's prefix split on a CPU: its own plumbing (PrefixSplit's plans and cut rows, the policies'
launches, AttnMeta.with_prefix, layers.kernel_attention) with float64 stand-ins for the three GPU pieces
(verify_attn, FlashInfer's prefix pass, the merge kernel), each round's verify logits against the same round
recomputed without the split; a device copy of the cut rows that disagrees with the plan gives another answer
(the check can fail). The GPU pieces themselves: tests/test_prefix_split.py, test_attn_merge.py."""
import dataclasses

import pytest
import torch

from kdtree.ops import attn_split as sp
from kdtree.ops import verify_attn_golden as vg

PAGE = 64


def _rows(pool, table, S):
    r = torch.arange(S)
    return pool[table.long()[r // PAGE] * PAGE + r % PAGE].double().numpy()


def _verify_attn(q, pool, page_table, seq_len, words, scale, page_size=PAGE, **kw):
    """verify_attn's contract in float64 (verify_attn_golden), one request at a time."""
    b, N, H, _ = q.shape
    out, lse = torch.zeros(b, N, H, 512, dtype=q.dtype), torch.zeros(b, N, H)
    j = torch.arange(N)
    for i in range(b):
        c, qi = _rows(pool, page_table[i], int(seq_len[i])), q[i].double().numpy()
        mask = ((words[i][:, j // 32] >> (j % 32)) & 1).bool().numpy()
        o, s = vg.mla_tree_attention(qi[..., :512], qi[..., 512:], c[:, :512], c[:, 512:], mask, scale)
        out[i], lse[i] = torch.from_numpy(o).to(q.dtype), torch.from_numpy(s).float()
    return out, lse


class _Prefix:
    """FlashInferPrefix's contract in float64: pages gathered at plan time, every prefix row seen."""

    def __init__(self, heads, scale, max_batch, max_pages, page_size=PAGE, device="cpu", backend="fa3",
                 graph=True, workspace=None):
        self.heads, self.scale, self.max_batch, self.graph = heads, scale, max_batch, graph
        self.planned = None

    def plan(self, rows, nodes, page_table, whole=False):
        assert len(rows) == self.max_batch or not self.graph
        assert whole or all(r % PAGE == 0 for r in rows)
        self.rows, self.table, self.planned = list(rows), page_table[:len(rows)].clone(), (len(rows), nodes)

    def run(self, q, pool, lse=True):
        b, N = self.planned
        assert tuple(q.shape[:2]) == (b, N)
        out, s_all = torch.zeros(b, N, self.heads, 512, dtype=q.dtype), torch.zeros(b, N, self.heads)
        for i in range(b):
            c, qi = _rows(pool, self.table[i], self.rows[i]), q[i].double().numpy()
            o, s = vg.prefix_attention(qi[..., :512], qi[..., 512:], c[:, :512], c[:, 512:], self.scale)
            out[i], s_all[i] = torch.from_numpy(o).to(q.dtype), torch.from_numpy(s).float()
        return out, (s_all if lse else None)


def _merge(o1, l1, o2, l2):
    o, s = sp.merge_lse(o1.double(), l1.double(), o2.double(), l2.double())
    return o.to(o1.dtype), s.float()


@pytest.fixture
def stand_ins(monkeypatch):
    import kdtree.engine.config as ec
    import kdtree.kernels as K
    import kdtree.ops.attn_merge as am
    import kdtree.ops.flashinfer_prefix as fp
    monkeypatch.setattr(K, "verify_attn", _verify_attn)
    monkeypatch.setattr(fp, "FlashInferPrefix", _Prefix)
    monkeypatch.setattr(fp, "WORKSPACE_BYTES", 16)
    monkeypatch.setattr(am, "merge_states", _merge)
    monkeypatch.setattr(ec, "_check_prefix_attn", lambda *a: None)


def _target():
    from kdtree import k26
    from kdtree.config import load_config
    args = dataclasses.replace(load_config("mid"), vocab_size=512, hidden_size=256, intermediate_size=512,
                               moe_intermediate_size=64, n_routed_experts=8, num_attention_heads=4,
                               q_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32)
    t = k26.build_target(1, device="cpu", args=args, kernel_only=False)
    t.attn_impl = "kernel"
    return t


def _checked(e):
    """Wrap the engine's verify so that every round's split logits are compared with the same block's
    logits without the split, over the state before the round (the whole pass runs first; the split's
    writes of the block rows then stand, as in an unchecked round). Returns the lists the errors go to and
    whether a round was in flight at each."""
    from kdtree.model import PagedMeta
    errs, flights, verify = [], [], e.runner.verify

    def checked(tokens, positions, mask, mask_words, b, sampling):
        n = len(e.active)
        meta = PagedMeta.build(e.page_table[:b], e.lens[:b], positions, mask, e.page_size, "kernel", e.moe,
                               mask_words)
        whole = e.model.forward_paged(tokens.long(), e.pool, meta).logits[:n].double()
        out = verify(tokens, positions, mask, mask_words, b, sampling)
        errs.append(float((out[0][:n].double() - whole).norm() / whole.norm()))
        flights.append(e.in_flight)
        # the cut rows: each request's host length in whole pages (AR: every key, its own row included),
        # padding slots 0
        if e.prefix.whole:
            cuts = [int(x) for x in e.lens[:n] + 1] + [0] * (b - n)
        else:
            cuts = [r.length // PAGE * PAGE for r in sorted(e.active, key=lambda r: r.slot)] + [0] * (b - n)
        assert e.prefix.rows[:b].tolist() == cuts
        return out
    e.runner.verify = checked
    return errs, flights


@pytest.mark.parametrize("mode,budget", [("ar", None), ("ddtree", 8), ("ddtree", "auto")])
def test_the_engines_split_rounds_equal_the_whole_on_a_cpu(stand_ins, mode, budget):
    """Three requests of 600-740 synthetic rows (cuts from 576 / 640 / 704; the bucket's fourth slot
    padding; AR: FlashInfer's pass over every key), eight rounds each verified with and without the split
    and its cut rows checked, then six overlapped rounds (run()'s schedule: AR plans a round while the
    previous one is in flight); then the cut rows copied to the device a page before the plan's (AR: the
    plan a page short of every key): that page is attended twice (unseen), and the check says so."""
    from kdtree import k26
    from kdtree.engine import Engine
    from kdtree.engine.prefix import PrefixSplit
    from kdtree.simulate import Profile
    t = _target()
    d = None if mode == "ar" else k26.build_drafter(t, args=k26.drafter_args(
        t.args, num_hidden_layers=1, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=256))
    sim = None if mode == "ar" else Profile(4.0, depth=7, K=16)
    e = Engine(t, d, mode=mode, budget=budget, max_batch=4, max_len=1024, prefix_attn="flashinfer",
               simulate=sim, **({"budgets": (4, 16)} if budget == "auto" else {}))
    assert e.prefix is not None and e.model.attn_impl == "kernel"
    for i in range(3):
        e.add_request([11 + i, 12, 13, 14], 160, synthetic_context=600 + 70 * i)
    e.step()
    errs, flights = _checked(e)
    for _ in range(8):
        e.step()
    for _ in range(6):
        e.step(overlap=True)
    assert len(errs) == 14 and max(errs) <= 1e-3, errs   # float32 model, float64 attention
    assert e.prefix.whole == (mode == "ar") and (mode != "ar" or any(flights)), flights
    e.step()   # lands the round in flight, then one of its own
    plan = PrefixSplit._plan

    def off_by_a_page(self, b, N, rows):   # the device's cut a page before the plan's: that page twice
        plan(self, b, N, rows)
        self.rows[:b].copy_(torch.tensor([max(r - PAGE, 0) for r in rows], dtype=torch.int32))

    def short_by_a_page(self, b, N, rows):   # AR: the pass a page short of every key: that page unseen
        plan(self, b, N, [max(r - PAGE, 1) if r else 0 for r in rows])
        self.rows[:b].copy_(torch.tensor(rows, dtype=torch.int32))
    PrefixSplit._plan = short_by_a_page if mode == "ar" else off_by_a_page
    try:
        if mode == "ar":
            e.step()
        else:
            with pytest.raises(AssertionError):   # the cut rows' check sees it first ...
                e.step()
    finally:
        PrefixSplit._plan = plan
    assert errs[-1] > 5e-3, errs               # ... after the logits' (5x the bound above)
