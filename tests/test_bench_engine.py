"""kdtree.bench.engine's CPU parts: the decode weight-bytes floor."""
import pytest

from kdtree.bench.engine import decode_weight_bytes
from kdtree.config import TINY_A, TINY_B, load_config


@pytest.mark.parametrize("args", [TINY_A, TINY_B, load_config("mid"), load_config("kimi-k2.6")])
def test_all_experts_touched_is_every_parameter_but_the_embedding_table(args):
    full = decode_weight_bytes(args, itemsize=1, experts_touched=args.n_routed_experts)
    assert full == args.param_count() - args.vocab_size * args.hidden_size + args.hidden_size
    top = decode_weight_bytes(args, itemsize=2)
    per_expert = 3 * args.hidden_size * args.moe_intermediate_size * 2
    assert full * 2 - top \
        == args.n_moe_layers * (args.n_routed_experts - args.num_experts_per_tok) * per_expert


def test_mid_config_shape_and_bytes():
    a = load_config("mid")
    assert (a.hidden_size, a.num_hidden_layers, a.n_routed_experts, a.num_experts_per_tok) \
        == (2048, 12, 32, 4)
    assert 1.3e9 < a.param_count() < 1.5e9
    # bf16, top-4 routing: attention 137 M, dense 35 M, touched + shared experts 173 M, lm_head 66 M weights
    assert 0.80e9 < decode_weight_bytes(a) < 0.84e9


def test_experts_touched_is_checked():
    with pytest.raises(ValueError, match="experts_touched=99"):
        decode_weight_bytes(TINY_A, experts_touched=99)


def test_the_benchmark_says_it_needs_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from kdtree.bench import engine as bench_engine
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        bench_engine.run(tmp_path)
    assert not any(tmp_path.iterdir())
