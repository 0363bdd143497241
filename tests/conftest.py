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
