"""kdtree.bench.layer: the model the per-layer verify benchmark builds."""
import torch


def test_the_layer_benchmark_model_takes_every_real_config():
    """bench.layer's two-layer model at each real shape: its arguments pass the model's checks (the real
    special-token ids lie past its small vocabulary), built on the meta device (no memory)."""
    from kdtree.bench.layer import layer_args
    from kdtree.model import Transformer
    for config in ("kimi-k2.6", "data/configs/mid.json"):
        a = layer_args(config)
        got = (a.num_hidden_layers, a.first_k_dense_replace, a.vocab_size, a.eos_token_id)
        assert got == (2, 1, 1024, None)
        with torch.device("meta"):
            Transformer(a)
