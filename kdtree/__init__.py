"""kdtree: DDTree speculative decoding for MLA + MoE models, with golden references and GPU kernels."""
from .config import TINY_A, TINY_B, ModelArgs, load_config
from .model import KVCache, Transformer, build_model

__version__ = "0.1.0"
__all__ = ["ModelArgs", "TINY_A", "TINY_B", "load_config", "Transformer", "KVCache", "build_model"]
