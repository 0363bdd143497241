"""kdtree: DDTree speculative decoding for MLA + MoE models, with golden references and GPU kernels.

The model (and torch with it) loads on first use of a name that needs it, so that `python -m kdtree lab` can
refuse a bad argument at once.
"""
import importlib

from .config import TINY_A, TINY_B, ModelArgs, load_config

__version__ = "0.1.0"
__all__ = ["ModelArgs", "TINY_A", "TINY_B", "load_config", "Transformer", "KVCache", "build_model"]

_FROM_MODEL = ("Transformer", "KVCache", "build_model")
_WITH_MODEL = ("model", "checks")   # the submodules `import kdtree` loaded when it imported the model itself


def __getattr__(name: str):
    if name in _FROM_MODEL:
        return getattr(importlib.import_module(".model", __name__), name)
    if name in _WITH_MODEL:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
