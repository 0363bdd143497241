"""The offline corpus, the tokenizer, and the training loops of the trained tiny pair (CPU smoke sizes)."""
import numpy as np
import pytest
import torch

from kdtree import data, train, weights
from kdtree.decode import generate_ar, generate_ddtree, generate_dflash
from kdtree.drafter import DrafterArgs, build_drafter
from kdtree.config import TINY_A
from kdtree.model import build_model


@pytest.fixture(scope="module")
def corpus():
    files = data.corpus_files()
    tok = data.load_tokenizer()
    return (files, tok, data.encode_files(tok, files["train"][:30]),
            data.encode_files(tok, files["heldout"][:8]))


def test_corpus_split_is_stable_and_disjoint(corpus):
    files = corpus[0]
    assert set(files["train"]).isdisjoint(files["heldout"])
    assert all(data.split_of(p.relative_to(data.stdlib_root()).as_posix()) == "heldout"
               for p in files["heldout"])
    n = len(files["train"]) + len(files["heldout"])
    assert 0.01 < len(files["heldout"]) / n < 0.12  # about 5%


def test_corpus_of_several_sources():
    """stdlib + torch: the stdlib's files keep their split, torch's split by "torch/<path>", no file twice."""
    files = data.corpus_files(("stdlib", "torch"))
    troot = data.source_root("torch")
    tfiles = [p for split in ("train", "heldout") for p in files[split] if troot in p.parents]
    assert len(tfiles) > 100 \
        and len(set(files["train"]) | set(files["heldout"])) == sum(map(len, files.values()))
    for split in ("train", "heldout"):
        for p in files[split]:
            key = f"torch/{p.relative_to(troot).as_posix()}" if troot in p.parents else \
                p.relative_to(data.stdlib_root()).as_posix()
            assert data.split_of(key) == split, p
    only = data.corpus_files()
    assert set(only["heldout"]) <= set(files["heldout"]) and set(only["train"]) <= set(files["train"])
    info = data.corpus_info(files, ("stdlib", "torch"))
    assert info["versions"]["torch"] == torch.__version__ and info["train_files"] == len(files["train"])
    with pytest.raises(ValueError, match="corpus source 'pandas'"):
        data.corpus_files(("stdlib", "pandas"))


def test_tokenizer_is_byte_level_and_lossless(corpus):
    files, tok, _, _ = corpus
    assert tok.get_vocab_size() == 4096
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|mask|>") == 1
    text = data.read_text(files["heldout"][0])[:3000] + "\n# ünïcödé ✓\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(text).ids) < len(text.encode()) / 2  # it compresses


def _tiny_target(vocab):
    return train.target_args(vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=2, n_routed_experts=4, q_lora_rank=32, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)


def test_forward_blocks_equals_inference_drafting():
    t = build_model(TINY_A, seed=0)
    d = build_drafter(t, seed=1, block_size=5)
    seq = torch.randint(0, TINY_A.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    feats = train.target_features(t, seq, d.target_layer_ids)
    anchors = torch.tensor([[3, 10, 22]])
    blocks = torch.full((1, 3, 5), d.args.mask_token_id)
    blocks[0, :, 0] = seq[0, anchors[0]]
    with torch.no_grad():
        got = d.forward_blocks(feats, blocks, anchors)
    for j, r in enumerate(anchors[0].tolist()):
        s = d.session(64)
        s.start(seq[0, :r].tolist(), feats[0, :r])
        torch.testing.assert_close(got[0, j, 1:], s.propose(seq[0, :r + 1].tolist()), rtol=1e-4, atol=1e-4)


def test_greedy_corpus_is_the_targets_greedy_continuation():
    t = build_model(TINY_A, seed=4)
    prompts = torch.randint(0, TINY_A.vocab_size, (3, 7), generator=torch.Generator().manual_seed(5))
    seqs = train.greedy_corpus(t, prompts, 12, batch=2, progress=False)
    for i in range(3):
        assert seqs[i, 7:].tolist() == generate_ar(t, prompts[i].tolist(), 12).tokens


def test_drafter_soft_loss_is_the_kl_to_the_targets_distributions():
    """soft_weight adds depth-weighted KL(target || drafter) at the block's positions: recomputed here from
    the target's logits at positions anchor + k - 1 (an off-by-one would compare against the wrong rows)."""
    t = build_model(TINY_A, seed=6)
    d = build_drafter(t, seed=7, block_size=4)
    seqs = torch.randint(2, TINY_A.vocab_size, (3, 24), generator=torch.Generator().manual_seed(8))
    cfg0 = train.TrainConfig(anchors=2, depth_decay=0.5)
    cfg1 = train.TrainConfig(anchors=2, depth_decay=0.5, soft_weight=0.7)
    with torch.no_grad():
        l0, _ = train.drafter_loss(d, t, seqs, 6, cfg0, np.random.default_rng(3))
        l1, _ = train.drafter_loss(d, t, seqs, 6, cfg1, np.random.default_rng(3))
        anchors = torch.from_numpy(np.random.default_rng(3).integers(5, 24 - 4 + 1, size=(3, 2)))
        feats = train.target_features(t, seqs, d.target_layer_ids)
        blocks = torch.full((3, 2, 4), d.args.mask_token_id)
        blocks[:, :, 0] = seqs.gather(1, anchors)
        q = torch.log_softmax(d.forward_blocks(feats, blocks, anchors)[:, :, 1:].double(), -1)  # [3, 2, 3, V]
        tl = torch.log_softmax(t(seqs).logits.double(), -1)
    w = 0.5 ** torch.arange(3, dtype=torch.float64)
    kl = torch.zeros(3, 2, 3, dtype=torch.float64)
    for b in range(3):
        for m in range(2):
            for k in range(3):
                p = tl[b, anchors[b, m] + k]
                kl[b, m, k] = (p.exp() * (p - q[b, m, k])).sum()
    want = 0.7 * float((kl * w).sum() / (w.sum() * 6))
    assert want > 0.01
    assert abs(float(l1 - l0) - want) < 1e-4 * max(1.0, want), (float(l1 - l0), want)
    with pytest.raises(ValueError, match="soft_weight"):
        train.TrainConfig(soft_weight=-1.0)


def test_training_smoke_target_and_drafter(corpus, tmp_path):
    _, tok, tr, ho = corpus
    args = _tiny_target(tok.get_vocab_size())
    cfg = train.TrainConfig(steps=16, batch=4, seq_len=32, lr=1e-2, warmup=4, eval_every=8, eval_batches=1)
    m, log = train.train_target(args, tr, ho, cfg, progress=False)
    first, last = log["train_loss"][0][1], np.mean([x[1] for x in log["train_loss"][-1:]])
    assert last < first - 0.3, (first, last)  # it learns
    assert log["heldout_loss"][-1][1] < log["heldout_loss"][0][1] < np.log(tok.get_vocab_size()) + 0.5
    prompts = torch.from_numpy(data.windows(tr, 8, 12, np.random.default_rng(0)))
    seqs = train.greedy_corpus(m, prompts, 12, batch=6, progress=False)
    dargs = DrafterArgs.for_target(args, block_size=4, mask_token_id=tok.token_to_id("<|mask|>"))
    dcfg = train.TrainConfig(steps=16, batch=4, seq_len=32, lr=3e-3, warmup=2, eval_every=8, anchors=4,
                             soft_weight=0.5)
    d, dlog = train.train_drafter(m, seqs[:8], 8, dargs, dcfg, heldout=seqs[8:], progress=False)
    assert dlog["train_loss"][-1][1] < dlog["train_loss"][0][1]
    assert len(dlog["heldout"]) == 2 and len(dlog["heldout"][-1][2]) == 3  # per-depth accuracy
    # checkpoints round-trip, and DDTree with the trained drafter stays lossless
    weights.save(m, tmp_path / "target")
    weights.save_drafter(d, tmp_path / "drafter")
    m2 = weights.load(tmp_path / "target")
    d2 = weights.load_drafter(tmp_path / "drafter", m2)
    p = ho[:16].tolist()
    ar = generate_ar(m2, p, 16)
    assert generate_ddtree(m2, d2, p, 16, budget=8).tokens == ar.tokens
    assert generate_dflash(m2, d2, p, 16).tokens == ar.tokens
    assert ar.tokens == generate_ar(m, p, 16).tokens


def test_train_config_rejects_bad_values():
    with pytest.raises(ValueError, match="TrainConfig.steps"):
        train.TrainConfig(steps=0)
    with pytest.raises(ValueError, match="depth_decay"):
        train.TrainConfig(depth_decay=1.5)


def test_default_pair_fits_the_checkpoint_limits():
    """Each checkpoint file <= 15 MB and both <= 25 MB in bf16 (the device returns files of up to 16 MiB)."""
    from kdtree.model import Transformer
    from kdtree.drafter import DFlashDrafter
    a = train.target_args(4096)
    with torch.device("meta"):
        t = Transformer(a)
        d = DFlashDrafter(DrafterArgs.for_target(a, block_size=16, num_hidden_layers=2, mask_token_id=1))
    tb, db = (2 * sum(p.numel() for p in m.parameters()) for m in (t, d))
    assert tb <= 15e6 and db <= 15e6 and tb + db <= 25e6, (tb, db)
    assert 3e6 < tb / 2  # "a few million parameters" at least


def test_router_bias_update_moves_load_toward_balance():
    """The aux-loss-free update lowers the bias of overloaded experts and raises it for idle ones, and the
    next forward routes more evenly."""
    m = build_model(TINY_A, seed=3)
    layer = next(i for i, blk in enumerate(m.model.layers) if hasattr(blk.mlp, "gate"))
    gate = m.model.layers[layer].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
        gate.e_score_correction_bias[0] = 1.0  # expert 0 wins every token (router scores are sigmoids)
    load = train._ExpertLoad(m)
    x = torch.randint(0, TINY_A.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    m(x)
    before = load.counts[layer].clone()
    worst = load.update(0.05)
    assert worst == float(before.max() / before.mean()) and before[0] == before.max()
    bias = gate.e_score_correction_bias
    assert abs(float(bias[0]) - 0.95) < 1e-6 \
        and torch.allclose(bias[before < before.mean()], torch.tensor(0.05))
    for _ in range(30):
        m(x)
        load.update(0.05)
    m(x)
    after = load.counts[layer]
    assert after.max() / after.mean() < before.max() / before.mean()
    load.close()


def test_rank_coverage_counts_labels_within_the_top_k():
    """rank_coverage against a direct count: top-1 coverage is the accuracy, coverage grows with k, and at k =
    V every label is covered."""
    t = build_model(TINY_A, seed=9)
    d = build_drafter(t, seed=10, block_size=4)
    seqs = torch.randint(2, TINY_A.vocab_size, (3, 20), generator=torch.Generator().manual_seed(11))
    cov = train.rank_coverage(d, t, seqs, 6, ks=(1, 8, TINY_A.vocab_size), anchors=3, seed=2)
    _, acc = train.drafter_loss(d, t, seqs, 6, train.TrainConfig(anchors=3), np.random.default_rng(2))
    assert np.allclose(cov[1], acc.tolist())
    assert all(a <= b for a, b in zip(cov[1], cov[8])) and cov[TINY_A.vocab_size] == [1.0, 1.0, 1.0]
    _, logits, labels, _ = train._draft_blocks(d, t, seqs, 6, 3, np.random.default_rng(2))
    top8 = logits.topk(8, dim=-1).indices
    assert np.allclose(cov[8], (top8 == labels[..., None]).any(-1).float().mean(dim=(0, 1)).tolist())
