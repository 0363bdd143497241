import os
import shutil

import pytest
import torch

from kdtree.config import TINY_A, TINY_B
from kdtree.model import build_model

# The tiny models' CPU paths run on one thread (beside other CPU load, several threads contend and a test's
# time multiplies); KDTREE_TORCH_THREADS=N asks for N.
torch.set_num_threads(max(1, int(os.environ.get("KDTREE_TORCH_THREADS", "1"))))


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    try:
        import cupy  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"CuPy not importable: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", params=["tiny-a", "tiny-b"])
def tiny(request):
    """(name, ModelArgs, randomly initialised float32 model) for each tiny preset."""
    args = {"tiny-a": TINY_A, "tiny-b": TINY_B}[request.param]
    return request.param, args, build_model(args, seed=11)


@pytest.fixture
def poison_outputs():
    """Kernel outputs are filled with NaN / -7777 before every launch (kdtree.ops.loader.POISON, which _empty
    reads), so unwritten ones show."""
    from kdtree.ops import loader
    loader.POISON = True
    yield
    loader.POISON = False


@pytest.fixture(scope="session")
def nvcc():
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc not on PATH")
    return path


@pytest.fixture
def paged_block():
    """make(model, B, T, ctx, moe) -> (pool, meta, tokens): a GPU verify step's inputs for `model` (attn_impl
    'kernel'): a random bf16 latent pool of B requests whose caches hold ctx - 13 b rows, T appended rows each
    (T = 1: decode; else a DDTree block's ancestor mask), random tokens."""
    import numpy as np

    from kdtree import golden
    from kdtree.model import AttnMeta

    def make(m, B: int, T: int, ctx: int, moe: str = "loop"):
        L, dev = m.args.num_hidden_layers, "cuda"
        rng = np.random.default_rng(B * T)
        pages = -(-(ctx + T) // 64) + 1
        pool = (torch.randn(L, B * pages * 64, 576, device=dev) * 0.5).to(torch.bfloat16)
        table = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
        cache_len = torch.tensor([ctx - 13 * b for b in range(B)], device=dev)
        tree = golden.ddtree(rng.standard_normal((8, 16)).astype(np.float32) * 2, T - 1) if T > 1 else None
        mask = (torch.from_numpy(golden.compile_tree(tree, 0, 0).mask) if tree is not None
                else torch.ones(1, 1, dtype=torch.bool)).to(dev)[None].expand(B, T, T).contiguous()
        pos = cache_len[:, None] + (mask.sum(-1) - 1)
        meta = AttnMeta.build(table, cache_len, pos, mask, 64, "kernel", moe)
        tokens = torch.from_numpy(rng.integers(0, m.args.vocab_size, (B, T))).to(dev)
        return pool, meta, tokens
    return make


@pytest.fixture
def fused_model():
    """make(seed, int4=True, moe="loop") -> a small bf16 GPU model the fused decode path takes (tiny kernel
    shapes, 16 routed experts, top 4 in 4 groups), its queries scaled by 0.3 so bf16 rounding moves its
    logits little (validate.kernel_model's reason); routed experts INT4 (int4) or kept bf16; prepared paged
    for `moe`."""
    from kdtree.validate import tiny_kernel_args

    def make(seed: int, int4: bool = True, moe: str = "loop"):
        args = tiny_kernel_args().replace(q_lora_rank=128, n_routed_experts=16, num_experts_per_tok=4,
                                          n_group=4, topk_group=2, moe_intermediate_size=64)
        m = build_model(args, seed=seed, attn_impl="kernel", dtype=torch.float32, device="cpu")
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.q_b_proj.weight.mul_(0.3)
        if int4:
            m.quantize_experts()
        return m.to(device="cuda", dtype=torch.bfloat16).prepare_paged(moe)
    return make
