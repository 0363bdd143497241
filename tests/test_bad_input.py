"""Bad input at the public entry points: a clear error naming the argument, and no state changed."""
import numpy as np
import pytest
import torch

from kdtree import decode, golden, quant, validate, weights
from kdtree.config import ModelArgs
from kdtree.drafter import OracleDrafter
from kdtree.model import Transformer, init_weights


def _model(seed=0, **kw):
    return init_weights(Transformer(ModelArgs(**kw)), seed=seed).eval()


def test_prompts_must_be_integer_token_ids():
    m = _model()
    for bad, msg in (([1.7, 2.2], r"expected integer token ids, got 1.7"), ([1, True], "got True"),
                     (torch.tensor([[1, 2], [3, 4]]), r"shape \[T\] or \[1, T\]"),
                     (torch.tensor([1.0, 2.0]), "torch.float32"), (np.array([1, 2], np.float64), "float64")):
        with pytest.raises(ValueError, match=msg):
            decode.generate_ar(m, bad, 3)
    assert decode.generate_ar(m, np.array([1, 2, 3]), 2).tokens == decode.generate_ar(m, [1, 2, 3], 2).tokens


def test_non_finite_target_logits_are_named_at_t0_and_t1():
    m = _model()
    with torch.no_grad():
        m.lm_head.weight[5, 0] = float("nan")
    for T in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"target logits: NaN or inf in verify row"):
            decode.generate_ar(m, [1, 2, 3], 4, temperature=T)
    oracle = OracleDrafter(decode.generate_ar(_model(), [1, 2, 3], 24).tokens, m.args.vocab_size)
    with pytest.raises(ValueError, match=r"target logits: NaN or inf"):
        decode.generate_ddtree(m, oracle, [1, 2, 3], 8, budget=8)


def test_a_drafter_of_another_vocabulary_is_refused():
    m = _model()
    oracle = OracleDrafter([1, 2, 3], m.args.vocab_size + 5)
    with pytest.raises(ValueError, match=r"drafter: vocabulary 1029 differs from the target's 1024"):
        decode.generate_ddtree(m, oracle, [1, 2, 3], 4, budget=4)
    with pytest.raises(ValueError, match=r"drafter: expected a drafter"):
        decode.generate_dflash(m, None, [1, 2, 3], 4)


def test_cache_truncate_takes_an_int_in_range():
    m = _model()
    cache = m.new_cache(16)
    m(torch.tensor([[1, 2, 3, 4]]), cache)
    for bad in (1.5, True, None, -1, 5):
        with pytest.raises(ValueError, match="truncate length="):
            cache.truncate(bad)
    assert cache.length == 4
    cache.truncate(2)
    assert cache.length == 2


def test_save_refuses_integer_dtypes_and_a_stale_shard_index(tmp_path):
    m = _model()
    with pytest.raises(ValueError, match=r"dtype=torch.int8: expected a floating torch dtype"):
        weights.save(m, tmp_path / "a", dtype=torch.int8)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="holds a sharded checkpoint"):
        weights.save(m, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b" / "model.safetensors").exists()


def test_quantize_experts_names_the_layer_and_changes_nothing_on_failure():
    m = _model()
    moe_layers = [i for i, l in enumerate(m.model.layers) if hasattr(l.mlp, "experts")]
    last = moe_layers[-1]
    with torch.no_grad():
        m.model.layers[last].mlp.experts[0].gate_proj.weight[0, 0] = float("inf")
    before = [type(m.model.layers[i].mlp.experts).__name__ for i in moe_layers]
    with pytest.raises(ValueError, match=rf"quantize_experts: layer {last}: "):
        m.quantize_experts()
    assert [type(m.model.layers[i].mlp.experts).__name__ for i in moe_layers] == before


def test_golden_moe_int4_drops_ids_outside_the_experts():
    g = torch.Generator().manual_seed(3)
    E, D, I, T = 4, 64, 32, 3
    p13, s13 = quant.stack_experts([quant.quantize(torch.randn(2 * I, D, generator=g) / 8) for _ in range(E)])
    p2, s2 = quant.stack_experts([quant.quantize(torch.randn(D, I, generator=g) / 6) for _ in range(E)])
    x = torch.randn(T, D, generator=g).numpy()
    ids = np.array([[0, 2], [1, -1], [3, 4]])
    w = np.random.default_rng(0).random((T, 2))
    args = (p13.numpy(), s13.float().numpy(), p2.numpy(), s2.float().numpy())
    got = golden.moe_int4(x, ids, w, *args)
    want = np.zeros_like(got)
    for t in range(T):
        for j in range(2):
            if 0 <= ids[t, j] < E:  # one pair at a time
                want[t] += golden.moe_int4(x[t:t + 1], ids[t:t + 1, j:j + 1], w[t:t + 1, j:j + 1], *args)[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.abs(got[1]).max() > 0


def test_drafter_sessions_check_their_calls():
    from kdtree.config import TINY_B
    from kdtree.drafter import build_drafter
    from kdtree.model import build_model
    t = build_model(TINY_B, seed=3)
    d = build_drafter(t, block_size=4)
    for bad in (0, -1, "x", True):
        with pytest.raises(ValueError, match="max_len="):
            d.session(bad)
    s = d.session(8)
    with pytest.raises(RuntimeError, match="call start"):
        s.propose([1, 2])
    with pytest.raises(RuntimeError, match="call start"):
        s.accept(torch.zeros(1, d.fc.in_features))
    s.start([1, 2, 3], torch.randn(3, d.fc.in_features))
    with pytest.raises(ValueError,
                       match=r"features: 6 more positions overflow the session \(3 of max_len 8\)"):
        s.accept(torch.randn(6, d.fc.in_features))
    assert s.length == 3
    with pytest.raises(ValueError, match="committed: expected"):
        s.propose([1, TINY_B.vocab_size])
    assert s.propose([1, 2, 3]).shape == (3, TINY_B.vocab_size)


def test_train_config_rejects_settings_that_train_wrong():
    from kdtree.train import TrainConfig
    for kw, msg in ((dict(grad_clip=-1.0), "grad_clip=-1.0"), (dict(grad_clip=0.0), "grad_clip=0.0"),
                    (dict(weight_decay=float("nan")), "weight_decay=nan"),
                    (dict(bias_update=-1e-3), "bias_update"), (dict(warmup=-5), "warmup=-5")):
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**kw)
    assert TrainConfig(warmup=0).warmup == 0


def test_a_cache_for_another_model_is_refused():
    m, other = _model(), _model(num_hidden_layers=2)
    cache = other.new_cache(16)
    with pytest.raises(ValueError, match=r"cache: 2 layers of width \d+, the model needs \d+ of width"):
        m(torch.tensor([[1, 2]]), cache)
    assert cache.length == 0


def test_int4_experts_check_dtypes_and_sizes():
    from kdtree.model import Int4Experts
    from kdtree.quant import QuantFormatError
    ok = Int4Experts.random(4, 64, 32, seed=0)
    parts = [ok.w13_packed, ok.w13_scale, ok.w2_packed, ok.w2_scale]
    with pytest.raises(QuantFormatError,
                       match="w13_packed: expected a tensor of torch.int32, got torch.float32"):
        Int4Experts(parts[0].float(), *parts[1:])
    with pytest.raises(QuantFormatError, match="w2_scale: expected a tensor of"):
        Int4Experts(*parts[:3], parts[3].to(torch.int32))
    with pytest.raises(QuantFormatError, match="E > 0"):
        Int4Experts(parts[0][:0], parts[1][:0], parts[2][:0], parts[3][:0])


def test_drafter_args_reject_sizes_and_constants_that_cannot_work():
    from kdtree.drafter import DrafterArgs
    for kw, msg in ((dict(num_attention_heads=0), "num_attention_heads=0"),
                    (dict(hidden_size=-8), "hidden_size=-8"),
                    (dict(num_key_value_heads=0), "num_key_value_heads=0"),
                    (dict(rope_theta=float("nan")), "rope_theta=nan"),
                    (dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
                    (dict(target_layer_ids=(0, -1)), r"target_layer_ids=\(0, -1\)")):
        with pytest.raises(ValueError, match=msg):
            DrafterArgs(**kw)


def test_seed_and_stop_tokens_are_checked():
    m = _model()
    with pytest.raises(ValueError, match="seed=None: expected an int >= 0"):
        decode.generate_ar(m, [1, 2], 2, seed=None)
    with pytest.raises(ValueError, match=r"stop_tokens=\[1.5\]: expected token ids"):
        decode.generate_ar(m, [1, 2], 2, stop_tokens=[1.5])
    assert decode.generate_ar(m, [1, 2], 3, stop_tokens=None).tokens \
        == decode.generate_ar(m, [1, 2], 3).tokens


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    from safetensors.torch import save_file
    from kdtree.weights import CheckpointError, read_state_dict
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(tmp_path / "part-1.safetensors"))
    save_file({"a": torch.full((2,), 2.0)}, str(tmp_path / "part-2.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"tensor a is in both part-1.safetensors and part-2.safetensors"):
        read_state_dict(tmp_path)


def test_golden_compile_tree_and_walk_check_their_arguments():
    tree = golden.ddtree(np.random.default_rng(1).standard_normal((3, 50)).astype(np.float32), 6)
    for kw, msg in ((dict(root_token=1, start_pos=2.5), r"start_pos=2.5"), (dict(root_token=1.7, start_pos=2),
                                                                            r"root_token=1.7"),
                    (dict(root_token=-1, start_pos=2), r"root_token=-1")):
        with pytest.raises(ValueError, match=msg):
            golden.compile_tree(tree, **kw)
    vb = golden.compile_tree(tree, 1, 2)
    with pytest.raises(ValueError, match=r"walk: expected tokens \[N\] with N >= 1"):
        golden.walk([], [], [])
    with pytest.raises(ValueError, match="walk: target_choice must hold integers"):
        golden.walk(vb.tokens, vb.parents, vb.tokens.astype(np.float64))
    acc, bonus = golden.walk(vb.tokens, vb.parents, vb.tokens)
    assert acc[0] == 0


@pytest.mark.parametrize("call,needle", [
    (lambda m: validate.losslessness(m, n_prompts=0), "n_prompts=0"),
    (lambda m: validate.losslessness(m, n_prompts=2, max_new_tokens=0), "max_new_tokens=0"),
    (lambda m: validate.losslessness(m, n_prompts=True), "n_prompts=True"),
    (lambda m: validate.losslessness(m, n_prompts=2, cases=()), "cases"),
    (lambda m: validate.golden_property_checks(n_cases=0), "n_cases=0"),
    (lambda m: validate.oracle_sweep(m, [], 8, 4, (4,)), "len\\(prompts\\)=0"),
    (lambda m: validate.kernel_checks(n_prompts=0), "n_prompts=0"),
])
def test_validate_refuses_a_check_over_nothing(tiny, call, needle):
    """A validation over zero prompts or cases would report a pass over nothing: refused, naming the count."""
    with pytest.raises(ValueError, match=needle):
        call(tiny[2])


def test_validate_counts_take_numpy_ints():
    rep = validate.golden_property_checks(n_cases=np.int64(3))
    assert rep["cases"] == 3 and isinstance(rep["cases"], int) and not rep["failures"]


def _tree(tokens, depths, parents):
    n = len(tokens)
    return golden.Tree(np.array(tokens), np.array(depths, np.int32), np.array(parents, np.int32),
                       np.zeros(n, np.float32), np.zeros(n, np.int32))


@pytest.mark.parametrize("call,needle", [
    (lambda: golden.build_tree(np.array([[1.7, 2.0]]), np.log(np.array([[0.6, 0.4]])), 2),
     "integer token ids"),
    (lambda: golden.build_tree(np.array([[1, -3]]), np.log(np.array([[0.6, 0.4]])), 2), "ids >= 0, got -3"),
    (lambda: golden.ddtree(np.zeros((2, 8), np.float32), 10 ** 9),
     r"budget=1000000000: expected an int in \[1,"),
    (lambda: golden.compile_tree(_tree([1, 2], [1, 2], [-1, 5]), 0, 0), r"parents\[1\] = 5"),
    (lambda: golden.compile_tree(_tree([1, 2], [1, 3], [-1, 0]), 0, 0), r"depths\[1\] = 3, expected 2"),
    (lambda: golden.compile_tree(_tree([1.5, 2], [1, 2], [-1, 0]), 0, 0), "integer token ids"),
    (lambda: golden.compile_tree(_tree([-1, 2], [1, 2], [-1, 0]), 0, 0), "ids >= 0"),
    (lambda: golden.walk(np.array([0, 3]), np.array([-1, 2]), np.array([3, 1])), r"parents\[1\] = 2"),
    (lambda: golden.walk(np.array([0, -3]), np.array([-1, 0]), np.array([3, 1])), "ids >= 0"),
    (lambda: golden.walk(np.array([0, 3]), np.array([0, 0]), np.array([3, 1])), r"parents\[0\]"),
    (lambda: golden.greedy_walk(np.array([0, 3]), np.array([-1, 0]), np.array([[np.nan, 1.0], [0.0, 1.0]])),
     "NaN at row 0"),
    (lambda: golden.compact_kv(np.ones((8, 2)), -2, [0, 1]), "block_start=-2"),
    (lambda: golden.compact_kv(np.ones((8, 2)), 2, [0.0, 1.5]), "integer row indices"),
    (lambda: golden.ancestor_mask(np.array([-1.0, 0.0])), "integer parent indices"),
])
def test_golden_functions_refuse_what_they_would_truncate_or_misread(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_huge_caches_are_refused_before_allocation():
    """A pool or cache larger than the free memory: a clear error naming the sizes, nothing allocated."""
    from kdtree.engine import Engine
    from kdtree.model import KVCache
    m = _model()
    with pytest.raises(ValueError, match=r"max_tokens=1000000000000, .*needs .* GiB, more than the"):
        Engine(m, mode="ar", max_batch=2, max_len=256, max_tokens=10 ** 12)
    with pytest.raises(ValueError, match=r"KVCache batch=1000000, max_len=2048: needs .* GiB"):
        KVCache(m.args, 10 ** 6, 2048)


def test_numpy_scalars_are_taken_and_bools_refused_by_the_generate_wrappers():
    m = _model()
    p = [3, 5, 7]
    a = decode.generate_ar(m, p, np.int64(4)).tokens
    assert a == decode.generate_ar(m, p, 4).tokens
    assert len(decode.generate_ar(m, p, 4, temperature=np.float32(0.7), seed=np.int64(3)).tokens) == 4
    with pytest.raises(ValueError, match="temperature=True"):
        decode.generate_ar(m, p, 4, temperature=True)
    with pytest.raises(ValueError, match="max_new_tokens=True"):
        decode.generate_ar(m, p, True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target and its drafter saved side by side: (target folder, drafter folder, the target)."""
    from kdtree.config import TINY_A
    from kdtree.drafter import build_drafter
    from kdtree.model import build_model
    d = tmp_path_factory.mktemp("ckpt")
    m = build_model(TINY_A, seed=3)
    weights.save(m, d / "target")
    weights.save_drafter(build_drafter(m, block_size=4), d / "drafter")
    return d / "target", d / "drafter", m


@pytest.fixture
def no_read(monkeypatch):
    """Reading a checkpoint's tensors fails the test: a refusal must come before it."""
    def read(path):
        raise AssertionError(f"the tensors of {path} were read before the refusal")
    monkeypatch.setattr(weights, "read_state_dict", read)


@pytest.mark.parametrize("kw,needle", [
    (dict(path=None), r"load: path=None: expected a checkpoint folder"),
    (dict(path=123), r"load: path=123: expected a checkpoint folder"),
    (dict(dtype="bogus"), r"load: dtype='bogus': expected a floating torch dtype"),
    (dict(dtype="int8"), r"load: dtype='int8': expected a floating torch dtype"),
    (dict(device="cuda:0"), r"load: device='cuda:0': no CUDA device"),
    (dict(device="meta"), r"load: device='meta': expected a torch device"),
    (dict(args=5), r"load: args: expected a kdtree ModelArgs"),
    (dict(attn_impl="fast"), r"load: attn_impl='fast': expected one of"),
    (dict(attn_impl="kernel"), r"load: attn_impl='kernel' needs kv_lora_rank 512")])
def test_load_refuses_each_argument_before_reading_the_weights(saved, no_read, monkeypatch, kw, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # a CPU-only machine
    kw = dict(path=saved[0]) | kw
    with pytest.raises(ValueError, match=needle):
        weights.load(kw.pop("path"), **kw)


def test_dtypes_are_taken_by_their_torch_names(saved):
    t = weights.load(saved[0], dtype="float16")
    assert t.dtype == torch.float16
    assert weights.load(saved[0], dtype="torch.bfloat16").dtype == torch.bfloat16
    d = weights.load_drafter(saved[1], t, dtype="float16")
    assert d.fc.weight.dtype == torch.float16
    with pytest.raises(ValueError, match=r"load_drafter: target: expected the kdtree Transformer"):
        weights.load_drafter(saved[1], None)


def test_read_state_dict_and_checkpoint_kind_take_what_load_takes(saved):
    with pytest.raises(ValueError, match=r"read_state_dict: path=None: expected a checkpoint folder"):
        weights.read_state_dict(None)
    assert weights.checkpoint_kind(str(saved[0])) == "target"
    assert weights.checkpoint_kind(str(saved[1])) == "drafter"


@pytest.mark.parametrize("call,needle", [
    (lambda: _build(None), r"args: expected a kdtree ModelArgs"),
    (lambda: _build(seed="x"), r"seed='x': expected an int"),
    (lambda: _build(dtype=torch.int8), r"dtype=torch.int8: expected a floating torch dtype"),
    (lambda: _build(device=None), r"device=None: expected a torch device"),
    (lambda: Transformer({}), r"args: expected a kdtree ModelArgs"),
    (lambda: _cache(None), r"KVCache args: expected a kdtree ModelArgs"),
    (lambda: _cache(dtype="x"), r"KVCache dtype='x': expected a floating torch dtype"),
    (lambda: _cache(device="tpu"), r"KVCache device='tpu': expected a torch device")])
def test_model_and_cache_constructors_check_their_arguments(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_cuda_is_refused_by_name_on_a_cpu_only_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda': no CUDA device on this machine"):
        _build(device="cuda")
    with pytest.raises(ValueError, match=r"KVCache device='cuda': no CUDA device"):
        _cache(device="cuda")


def test_build_model_takes_a_dtype_name():
    assert _build(dtype="bfloat16").dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [None, 123, "", "  "])
def test_load_config_names_what_it_takes(bad):
    from kdtree.config import load_config
    with pytest.raises(ValueError, match=r"config=.*: expected a ModelArgs, one of \['tiny-a'"):
        load_config(bad)


def _build(args="tiny", **kw):
    from kdtree.config import TINY_A
    from kdtree.model import build_model
    return build_model(TINY_A if args == "tiny" else args, **kw)


def _cache(args="tiny", **kw):
    from kdtree.cache import KVCache
    from kdtree.config import TINY_A
    return KVCache(TINY_A if args == "tiny" else args, 1, 8, **kw)
