"""INT4 expert weights in the Kimi K2 release format: compressed-tensors `pack-quantized`, symmetric,
4 bits, one scale per group of 32 inputs.

For one linear layer W [out, in] (in a multiple of 32) a checkpoint holds, under the layer's prefix:

    weight_packed  int32 [out, in / 8]   q + 8 for q in [-8, 7], eight per int32 along `in`:
                                         input 8c + i sits in bits 4i .. 4i + 3 of word c
    weight_scale   bf16  [out, in / 32]  one scale per group of 32 inputs
    weight_shape   int64 [2]             (out, in)

and W = q * scale[:, in // 32]. In K2 checkpoints only the routed experts of the MoE layers are stored so;
attention, shared experts, the dense layers, embeddings and lm_head stay bf16.

    w = quantize(weight)            # Int4Weight (packed, scale, shape)
    w.dequantize()                  # float32 [out, in], exactly q * scale
    tensors = w.state_dict("model.layers.1.mlp.experts.0.up_proj")   # the three checkpoint tensors
    w = read_int4(tensors, "model.layers.1.mlp.experts.0.up_proj")   # checked on the way in
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from . import checks

GROUP = 32      # inputs per scale
PER_WORD = 8    # 4-bit values per int32
QMIN, QMAX = -8, 7
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


class QuantFormatError(ValueError):
    pass


@dataclass
class Int4Weight:
    packed: torch.Tensor  # int32 [out, in / 8]
    scale: torch.Tensor   # bf16 (or float) [out, in / 32]
    shape: tuple[int, int]

    def __post_init__(self):
        check_int4(self.packed, self.scale, self.shape)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def unpack(self) -> torch.Tensor:
        """int8 [out, in] in [-8, 7]."""
        return unpack(self.packed, self.in_features)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """[out, in] = q * scale (exact in float32: a 4-bit integer times a bf16 scale)."""
        q = self.unpack().to(torch.float32)
        s = self.scale.to(torch.float32).repeat_interleave(GROUP, dim=1)
        return (q * s).to(dtype)

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """The three checkpoint tensors, named as compressed-tensors names them."""
        p = f"{prefix}." if prefix else ""
        return {p + "weight_packed": self.packed.contiguous(), p + "weight_scale": self.scale.contiguous(),
                p + "weight_shape": torch.tensor(self.shape, dtype=torch.int64)}


def check_int4(packed: torch.Tensor, scale: torch.Tensor, shape, name: str = "weight") -> None:
    """Raise QuantFormatError naming the tensor and the expected value when the three do not fit together."""
    try:
        vals = [v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v for v in shape]
    except TypeError:
        vals = None
    if vals is None or len(vals) != 2 or not all(checks.is_int(v) for v in vals):
        raise QuantFormatError(f"{name}.weight_shape: expected two integers (out, in), got {shape!r}")
    out, inp = (int(v) for v in vals)
    if out <= 0 or inp <= 0 or inp % GROUP:
        raise QuantFormatError(f"{name}.weight_shape: expected (out, in) with in a positive multiple of "
                               f"{GROUP}, got {(out, inp)}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise QuantFormatError(f"{name}.weight_packed: expected an int32 tensor, got {got}")
    if tuple(packed.shape) != (out, inp // PER_WORD):
        raise QuantFormatError(f"{name}.weight_packed: expected shape {(out, inp // PER_WORD)} "
                               f"(out, in / {PER_WORD}) for weight_shape {(out, inp)}, "
                               f"got {tuple(packed.shape)}")
    if not isinstance(scale, torch.Tensor) or not scale.dtype.is_floating_point:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise QuantFormatError(f"{name}.weight_scale: expected a floating-point tensor (bf16), got {got}")
    if tuple(scale.shape) != (out, inp // GROUP):
        raise QuantFormatError(f"{name}.weight_scale: expected shape {(out, inp // GROUP)} (one scale per "
                               f"{GROUP} inputs) for weight_shape {(out, inp)}, got {tuple(scale.shape)}")


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] in [-8, 7] -> int32 [out, in / 8] (input 8c + i in bits 4i..4i+3 of word c, stored
    q + 8)."""
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[1] % PER_WORD:
        raise QuantFormatError(f"q: expected int8 [out, in] with in a multiple of {PER_WORD}, got {q.dtype} "
                               f"{tuple(q.shape)}")
    if q.numel() and (int(q.min()) < QMIN or int(q.max()) > QMAX):
        raise QuantFormatError(f"q: expected values in [{QMIN}, {QMAX}], "
                               f"got [{int(q.min())}, {int(q.max())}]")
    u = (q.to(torch.int64) + 8).view(q.shape[0], -1, PER_WORD)
    shifts = torch.arange(0, 4 * PER_WORD, 4, dtype=torch.int64, device=q.device)
    words = (u << shifts).sum(dim=-1)                     # [out, in / 8] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [out, in / 8] -> int8 [out, in] in [-8, 7]."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] * PER_WORD != in_features:
        raise QuantFormatError(f"packed: expected int32 [out, {in_features // PER_WORD}], got {packed.dtype} "
                               f"{tuple(packed.shape)}")
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 4 * PER_WORD, 4, dtype=torch.int64, device=packed.device)
    u = (w[..., None] >> shifts) & 0xF                    # [out, in / 8, 8]
    return (u - 8).to(torch.int8).reshape(packed.shape[0], in_features)


def quantize(weight: torch.Tensor, scale_dtype=torch.bfloat16) -> Int4Weight:
    """Symmetric 4-bit quantization, group 32 (compressed-tensors' rule: scale = absmax / 7.5). The scale is
    rounded to scale_dtype first and q = clamp(round(w / scale), -8, 7) uses the rounded scale, so
    dequantize() reproduces q * scale exactly."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise QuantFormatError(f"weight: expected a floating-point [out, in] tensor, got "
                               f"{getattr(weight, 'dtype', type(weight).__name__)} "
                               f"{tuple(getattr(weight, 'shape', ()))}")
    out, inp = weight.shape
    if inp % GROUP:
        raise QuantFormatError(f"weight: expected in_features a multiple of {GROUP}, got {inp}")
    if not torch.isfinite(weight).all():
        raise QuantFormatError("weight: expected finite values (NaN or inf present)")
    w = weight.detach().to(torch.float32).view(out, inp // GROUP, GROUP)
    scale = (w.abs().amax(dim=-1) / ((QMAX - QMIN) / 2)).to(scale_dtype)        # [out, in / 32]
    s = scale.to(torch.float32)
    q = torch.round(w / torch.where(s == 0, torch.ones_like(s), s)[..., None]).clamp(QMIN, QMAX)
    return Int4Weight(pack(q.to(torch.int8).view(out, inp)), scale, (int(out), int(inp)))


def is_int4(tensors: Mapping[str, torch.Tensor], prefix: str) -> bool:
    return f"{prefix}.weight_packed" in tensors


def read_int4(tensors: Mapping[str, torch.Tensor], prefix: str) -> Int4Weight:
    """The layer `prefix` from a checkpoint's tensors (as compressed-tensors writes them), checked."""
    missing = [f"{prefix}.{s}" for s in SUFFIXES if f"{prefix}.{s}" not in tensors]
    if missing:
        raise QuantFormatError(f"{prefix}: expected the pack-quantized tensors {list(SUFFIXES)}; "
                               f"missing {missing}")
    shape_t = tensors[f"{prefix}.weight_shape"]
    if shape_t.dim() != 1 or shape_t.numel() != 2 or shape_t.dtype.is_floating_point:
        raise QuantFormatError(f"{prefix}.weight_shape: expected an integer tensor of 2 values, got "
                               f"{shape_t.dtype} {tuple(shape_t.shape)}")
    shape = tuple(int(v) for v in shape_t.tolist())
    packed, scale = tensors[f"{prefix}.weight_packed"], tensors[f"{prefix}.weight_scale"]
    check_int4(packed, scale, shape, name=prefix)
    return Int4Weight(packed, scale, shape)


def stack_experts(weights: list[Int4Weight]) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts of one shape -> (packed int32 [E, out, in / 8], scale [E, out, in / 32])."""
    shapes = {w.shape for w in weights}
    if len(shapes) != 1:
        raise QuantFormatError(f"experts: expected one shape for all, got {sorted(shapes)}")
    return torch.stack([w.packed for w in weights]), torch.stack([w.scale for w in weights])
