"""The engine's verify attention split at the committed pages (prefix_attn="flashinfer",
kdtree.engine.prefix): refusals on any machine; on a GPU with flashinfer installed, the split metadata
against the whole and an engine with the split against one without."""
import numpy as np
import pytest
import torch

from kdtree import golden
from kdtree.cache import AttnMeta
from kdtree.engine.config import EngineConfig
from kdtree.ops import flashinfer_prefix as fp

PAGE = 64


def test_prefix_attn_is_checked_before_anything_is_built():
    from kdtree.config import TINY_A
    from kdtree.model import build_model
    m = build_model(TINY_A, seed=1)
    with pytest.raises(ValueError, match="prefix_attn='fast'"):
        EngineConfig(prefix_attn="fast").resolve(m)
    with pytest.raises(ValueError, match="prefix_attn='flashinfer': needs the kernel backend and "
                                         "attention on a GPU"):
        EngineConfig(prefix_attn="flashinfer").resolve(m)
    assert EngineConfig().resolve(m).prefix_attn == "off"
    with pytest.raises(ValueError, match="prefix_attn='flashinfer': not with deterministic=True"):
        EngineConfig(prefix_attn="flashinfer", deterministic=True).resolve(m)


def test_with_prefix_refuses_the_torch_paths_and_a_wrong_shape():
    meta = AttnMeta(torch.zeros(2, 3, dtype=torch.int32), None, torch.zeros(2, 1), torch.ones(2), None, None,
                    192, PAGE, attn_impl="absorb")
    with pytest.raises(ValueError, match="with_prefix: expected the paged layout with attn_impl 'kernel'"):
        meta.with_prefix(object(), torch.zeros(2, dtype=torch.int32))
    meta = AttnMeta(torch.zeros(2, 3, dtype=torch.int32), None, torch.zeros(2, 1),
                    torch.ones(2, dtype=torch.int32), None, None, 192, PAGE, attn_impl="kernel")
    with pytest.raises(ValueError, match=r"prefix_rows: expected an int tensor \[2\]"):
        meta.with_prefix(object(), torch.zeros(3, dtype=torch.int32))
    got = meta.with_prefix("pass", torch.tensor([64, 0], dtype=torch.int32))
    assert got.prefix == "pass" and got.rest_seq_len.tolist() == [-63, 1] and meta.prefix is None


def test_each_launch_plans_the_committed_pages_and_copies_the_same_rows():
    """PrefixSplit.plan(b, N): each active request cut at its host length rounded down to whole pages (padding
    slots 0), the pass of (bucket, N) planned with exactly the rows copied to the device (the invariant a
    captured round relies on); meta picks the pass by the block's rows. AR (whole): every key planned."""
    from types import SimpleNamespace

    from kdtree.engine.prefix import PrefixSplit
    planned = {}

    class Pass:
        def __init__(self, key):
            self.key = key

        def plan(self, rows, nodes, page_table, whole=False):
            planned[self.key] = (list(rows), nodes, tuple(page_table.shape)) + (("whole",) if whole else ())

    reqs = [SimpleNamespace(slot=1, length=700), SimpleNamespace(slot=0, length=63),
            SimpleNamespace(slot=2, length=128)]
    e = SimpleNamespace(active=reqs, page_size=PAGE, page_table=torch.zeros(8, 20, dtype=torch.int32),
                        in_flight=False)
    split = PrefixSplit.__new__(PrefixSplit)
    split.e, split.rows, split.whole = e, torch.full((8,), -1, dtype=torch.int32), False
    split.passes = {(b, N): Pass((b, N)) for b in (4, 8) for N in (1, 9)}
    split.plan(4, 9)
    assert planned == {(4, 9): ([0, 640, 128, 0], 9, (4, 20))}
    assert split.rows.tolist() == [0, 640, 128, 0, -1, -1, -1, -1]
    meta = AttnMeta(torch.zeros(4, 20, dtype=torch.int32), None, torch.zeros(4, 9),
                    torch.full((4,), 709, dtype=torch.int32), None, None, 20 * PAGE, PAGE, attn_impl="kernel")
    got = split.meta(meta, 4)
    assert got.prefix is split.passes[4, 9] and got.rest_seq_len.tolist() == [709, 69, 581, 709]
    split.plan(4, 1)   # an AR plan's round (budget="auto") plans the pass of one row
    assert planned[4, 1] == ([0, 640, 128, 0], 1, (4, 20))
    meta1 = AttnMeta(torch.zeros(4, 20, dtype=torch.int32), None, torch.zeros(4, 1),
                     torch.full((4,), 701, dtype=torch.int32), None, None, 20 * PAGE, PAGE,
                     attn_impl="kernel")
    assert split.meta(meta1, 4).prefix is split.passes[4, 1]
    # AR (whole): every key, its own row included, one more row while a round is in flight
    split.whole, e.in_flight = True, True
    split.plan(4, 1)
    assert planned[4, 1] == ([65, 702, 130, 0], 1, (4, 20), "whole")
    assert split.rows.tolist()[:4] == [65, 702, 130, 0]
    got = split.meta(meta1, 4)
    assert got.prefix is split.passes[4, 1] and got.prefix_whole and got.rest_seq_len is None
    with pytest.raises(ValueError, match="with_whole: expected .* a one-row block"):
        split.meta(meta, 4)


def test_the_split_has_a_pass_for_every_block_the_policy_verifies():
    """prefix_nodes: a fixed budget's block rows; budget="auto": AR's 1, the chain's L + 1 and each candidate
    tree's B + 1; the policies' verify_rows say the same of a built engine."""
    from kdtree import weights
    from kdtree.budget.config import AutoConfig
    from kdtree.engine import Engine
    from kdtree.engine.config import prefix_nodes
    m = weights.load("data/trained/target").eval()
    d = weights.load_drafter("data/trained/drafter", m)
    L1 = d.block_size
    assert prefix_nodes(EngineConfig(mode="ddtree", budget=8).resolve(m, d)) == (9,)
    assert prefix_nodes(EngineConfig(mode="ar").resolve(m)) == (1,)
    assert prefix_nodes(EngineConfig(mode="dflash").resolve(m, d)) == (L1,)
    cfg = EngineConfig(mode="ddtree", budget="auto", auto=AutoConfig(budgets=(4, 16))).resolve(m, d)
    assert prefix_nodes(cfg) == tuple(sorted({1, L1, 5, 17}))
    e = Engine(m, d, mode="ddtree", budget="auto", budgets=(4, 16), max_batch=2, max_len=128)
    assert e.policy.verify_rows() == prefix_nodes(cfg)
    e = Engine(m, d, mode="ddtree", budget=8, max_batch=2, max_len=128)
    assert e.policy.verify_rows() == (9,)


def _need():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    why = fp.available()
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
def test_kernel_attention_with_the_split_is_the_whole():
    """layers.kernel_attention over AttnMeta.with_prefix (FlashInfer's prefix, verify_attn's rest, merged)
    against the same metadata without the split, a tree block over three requests of different lengths, cuts
    at 0, some and all committed pages; rows copied to the device that disagree with the plan give another
    answer (the check can fail)."""
    _need()
    from kdtree.layers import kernel_attention
    H, scale, dev, N = 16, 0.1352, "cuda", 9
    lens = [700, 64, 1000]                    # rows cached before the block
    cuts = [640, 0, 896]
    b, P = len(lens), -(-(max(lens) + N) // PAGE)
    g = torch.Generator().manual_seed(3)
    pool = (torch.randn(b * P * PAGE, 576, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    table = torch.randperm(b * P, generator=g).to(torch.int32).view(b, P).to(dev)
    q = (torch.randn(b, N, H, 576, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    tree = golden.ddtree(np.random.default_rng(1).standard_normal((15, 64)).astype(np.float32) * 2, N - 1)
    mask = torch.from_numpy(golden.compile_tree(tree, 0, 0).mask)[None].expand(b, N, N).to(dev)
    cache_len = torch.tensor(lens, device=dev)
    pos = cache_len[:, None] + torch.arange(N, device=dev)
    meta = AttnMeta.build(table, cache_len, pos, mask, PAGE, "kernel")
    whole = kernel_attention(q, pool, meta, scale).double()
    pre = fp.FlashInferPrefix(H, scale, max_batch=b, max_pages=P, graph=False)
    pre.plan(cuts, N, table)
    split = kernel_attention(q, pool, meta.with_prefix(pre, torch.tensor(cuts, dtype=torch.int32,
                                                                          device=dev)), scale).double()
    err = float((split - whole).norm() / whole.norm())
    assert err <= 1e-2, err
    wrong = kernel_attention(q, pool, meta.with_prefix(pre, torch.tensor([0, 0, 0], dtype=torch.int32,
                                                                          device=dev)), scale).double()
    assert float((wrong - whole).norm() / whole.norm()) > 0.05   # rows past the plan: counted twice


def _whole_logits(e, tokens, lens, mask, meta_fn=None):
    """The target's verify logits of `tokens` [n, T] over the engine's pool after `lens` cached rows, eager,
    without the split (or with meta_fn(meta) applied)."""
    from kdtree.model import PagedMeta
    n, T = tokens.shape
    positions = lens[:, None] + torch.arange(T, device=lens.device)
    meta = PagedMeta.build(e.page_table[:n], lens, positions, mask, e.page_size, e.model.attn_impl, e.moe)
    if meta_fn is not None:
        meta = meta_fn(meta)
    return e.model.forward_paged(tokens.long(), e.pool, meta).logits.double()


class _SplitCheck:
    """Stands in for layers.kernel_attention in the model's layers: a call with a split also runs the whole
    attention on the same inputs and writes each request's relative error into errs[layer, request] on the
    device, no host reads, so a captured round's replay rewrites them (layers by their pool)."""

    def __init__(self, layers: int, batch: int, device="cuda"):
        self.errs = torch.full((layers, batch), float("nan"), device=device)
        self.layer: dict[int, int] = {}

    def __call__(self, qk, pool, meta, scale):
        import dataclasses

        from kdtree.layers import kernel_attention
        o = kernel_attention(qk, pool, meta, scale)
        if meta.prefix is not None:
            whole = kernel_attention(qk, pool, dataclasses.replace(meta, prefix=None), scale).float()
            i = self.layer.setdefault(pool.data_ptr(), len(self.layer))
            err = (o.float() - whole).flatten(1).norm(dim=1) / whole.flatten(1).norm(dim=1)   # [b]
            self.errs[i, :err.shape[0]].copy_(err)
        return o

    def round_errors(self, n: int) -> list[float]:
        """The worst relative error of each layer over the first n requests since the last call."""
        got = self.errs[:len(self.layer), :n].amax(dim=1).tolist()
        self.errs.fill_(float("nan"))
        return got


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_the_engines_split_rounds_equal_the_whole_attention(graphs, monkeypatch):
    """AR with prefix_attn="flashinfer" at the mid config's dimensions (2 MoE layers, INT4 experts), 600-740
    synthetic context rows, graphs off / on: in each round (one at a time, then overlapped), every layer's
    attention through FlashInfer's pass (AR: over every key, planned per launch, replayed) against
    verify_attn's over the same queries and cache; then on the final state a 9-row tree block through
    forward_paged with a split at each request's committed pages. The logits are not compared: two bf16
    roundings of one attention move a row to another expert set now and then, which moves its logits far
    (docs/engine.md). A pass planned a page short fails the check; run() then serves to the end."""
    _need()
    import kdtree.fused
    import kdtree.model
    from kdtree import k26
    from kdtree.engine import Engine
    from kdtree.engine.prefix import PrefixSplit
    t = k26.build_target(2, device="cuda", config="mid")
    layers = t.args.num_hidden_layers
    check = _SplitCheck(layers, 4)
    monkeypatch.setattr(kdtree.model, "kernel_attention", check)
    monkeypatch.setattr(kdtree.fused, "kernel_attention", check)
    e = Engine(t, mode="ar", max_batch=4, max_len=1024, graphs=graphs, prefix_attn="flashinfer")
    assert e.prefix is not None and (e.graph_reason is None) == graphs
    for i in range(3):
        e.add_request([11 + i, 12, 13, 14], 24, synthetic_context=600 + 70 * i)
    e.step()
    check.round_errors(4)
    errs = []
    for _ in range(6):
        lens = e.lens[:len(e.active)].tolist()
        e.step()
        errs.append((check.round_errors(len(lens)), lens))
    for _ in range(4):   # run()'s schedule: each round planned while the previous one is in flight
        e.step(overlap=True)
        assert e.in_flight
        errs.append((check.round_errors(3), "overlapped"))
    e.step()   # lands the round in flight, then one of its own
    check.round_errors(3)
    assert len(check.layer) == layers and all(len(x) == layers for x, _ in errs), errs
    assert max(max(x) for x, _ in errs) <= 1e-2, errs   # NaN (a layer that did not write) fails too
    assert e.prefix.whole   # AR: FlashInfer's pass over every key, no rest
    plan = PrefixSplit._plan

    def short_by_a_page(self, b, N, rows):   # the pass planned a page short of every key: that page unseen
        plan(self, b, N, [max(r - PAGE, 1) if r else 0 for r in rows])
        self.rows[:b].copy_(torch.tensor(rows, dtype=torch.int32))
    monkeypatch.setattr(PrefixSplit, "_plan", short_by_a_page)
    e.step()
    assert max(check.round_errors(len(e.active))) > 0.05   # the check can fail
    monkeypatch.setattr(PrefixSplit, "_plan", plan)
    # a tree block on the final state, the split planned here
    N, n = 9, len(e.active)
    for r in e.active:
        e.scheduler.grow(r, r.length + N)
    lens = e.lens[:n].clone()
    tree = golden.ddtree(np.random.default_rng(2).standard_normal((15, 64)).astype(np.float32) * 2, N - 1)
    mask = torch.from_numpy(golden.compile_tree(tree, 0, 0).mask)[None].expand(n, N, N).to("cuda")
    tokens = torch.randint(0, t.args.vocab_size, (n, N), device="cuda")
    cuts = [r.length // PAGE * PAGE for r in sorted(e.active, key=lambda r: r.slot)]
    assert all(c > 0 for c in cuts)
    a = t.args
    pre = fp.FlashInferPrefix(a.num_attention_heads, a.softmax_scale, n, e.pages_per_req, graph=False)
    pre.plan(cuts, N, e.page_table[:n])
    cut_dev = torch.tensor(cuts, dtype=torch.int32, device="cuda")
    _whole_logits(e, tokens, lens, mask, lambda m: m.with_prefix(pre, cut_dev))
    tree_errs = check.round_errors(n)
    assert len(tree_errs) == layers and max(tree_errs) <= 1e-2, tree_errs
    out = e.run()
    assert all(len(res.tokens) == 24 for res in out.values()) and e.free_pages == e.pages.capacity


@pytest.mark.gpu
@pytest.mark.parametrize("mode,budget", [("ar", None), ("ddtree", 8), ("ddtree", "auto")])
def test_an_engine_with_the_split_serves_like_one_without(mode, budget):
    """Two engines, with and without the split, graphed, serving the same requests to the end (run():
    overlapped rounds): the greedy tokens agree but for near ties, whose flips then carry a request apart
    (so the bound is loose), and every page comes back."""
    _need()
    from kdtree import k26
    from kdtree.engine import Engine
    from tests.test_engine_gpu import MID_DRAFTER
    t = k26.build_target(2, device="cuda", config="mid")
    d = None if mode == "ar" else k26.build_drafter(t, args=k26.drafter_args(t.args, **MID_DRAFTER))
    prompts = [[11 + i, 12, 13, 14] for i in range(3)]
    kw = dict(mode=mode, budget=budget, max_batch=4, max_len=1024)
    runs = []
    for e in (Engine(t, d, **kw), Engine(t, d, prefix_attn="flashinfer", **kw)):
        ids = [e.add_request(p, 32, synthetic_context=650) for p in prompts]
        out = e.run()
        runs.append([out[i].tokens[:8] for i in ids])
        assert e.free_pages == e.pages.capacity
    assert sum(a == b for a, b in zip(*runs)) >= 2, runs   # the first 8 tokens of most requests
