"""Argument checks shared by the public API (decode, model, golden, kernels, engine).

Each check names the argument and says what was expected (`ValueError("name=value: expected ...")`),
accepts numpy scalars where Python ones are accepted, refuses bools where numbers are expected, never
truncates a float to an int, and reads no device values (tensor checks look at type, dtype, shape,
contiguity and device only), so the engine's rounds can call none of them and its entry points all of them.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def is_int(v) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_number(v) -> bool:
    """A Python or numpy integer or float, not a bool."""
    return is_int(v) or isinstance(v, (float, np.floating))


def int_in(name: str, v, lo: int | None = None, hi: int | None = None, note: str = "") -> int:
    """v as an int with lo <= v <= hi (either bound optional). note: appended to the expectation."""
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        if lo == 1 and hi is None:
            want = "a positive int"
        elif hi is None:
            want = "an int" if lo is None else f"an int >= {lo}"
        elif lo is None:
            want = f"an int <= {hi}"
        else:
            want = f"an int in [{lo}, {hi}]"
        raise ValueError(f"{name}={v!r}: expected {want}{note}")
    return int(v)


def positive_int(name: str, v, hi: int | None = None, note: str = "") -> int:
    return int_in(name, v, 1, hi, note)


def finite_float(name: str, v, lo: float | None = None, hi: float | None = None, note: str = "") -> float:
    """v as a finite float with lo <= v <= hi (either bound optional); ints are accepted, bools are not."""
    if not is_number(v) or not math.isfinite(float(v)) or (lo is not None and v < lo) or (
            hi is not None and v > hi):
        want = "a finite number" + (f" >= {lo:g}" if lo is not None else "") + (
            f" <= {hi:g}" if hi is not None else "")
        raise ValueError(f"{name}={v!r}: expected {want}{note}")
    return float(v)


def flag(name: str, v) -> bool:
    """v as a bool: True or False (a numpy bool too); strings, numbers and None are refused, so that "no" or
    "false" is never taken as True."""
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name}={v!r}: expected True or False")
    return bool(v)


def float_dtype(name: str, v) -> torch.dtype:
    """v as a floating torch dtype: a torch.dtype, or its name as torch spells it ('bfloat16', 'float16',
    'torch.float32', 'half', ...)."""
    d = getattr(torch, v.removeprefix("torch."), None) if isinstance(v, str) else v
    if not (isinstance(d, torch.dtype) and d.is_floating_point):
        raise ValueError(f"{name}={v!r}: expected a floating torch dtype (torch.bfloat16, torch.float32, ... "
                         "or its name: 'bfloat16')")
    return d


def device(name: str, v) -> torch.device:
    """v as a device of this machine: 'cpu', 'cuda', 'cuda:N' (N below the visible GPUs), or such a
    torch.device; other kinds ('meta', 'mps', ...) are refused, as is CUDA where none is visible."""
    try:
        dev = torch.device(v)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}={v!r}: expected a torch device ('cpu', 'cuda', 'cuda:1', ...)")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"{name}={v!r}: no CUDA device on this machine")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"{name}={v!r}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return dev


def one_of(name: str, v, choices) -> object:
    if v not in tuple(choices):
        raise ValueError(f"{name}={v!r}: expected one of {tuple(choices)}")
    return v


def token_list(name: str, ids, vocab_size: int | None = None, allow_empty: bool = False) -> list[int]:
    """An ordered sequence of token ids -> list[int]: a list / tuple / range / numpy array / CPU or CUDA
    tensor of shape [T] or [1, T] (a tensor is copied to the host: for entry points only), ids in [0,
    vocab_size). Unordered or one-pass collections (dict, set, generator) are refused: their iteration order
    would become the token order."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        t = torch.as_tensor(ids)
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or not (
                t.dim() == 1 or (t.dim() == 2 and t.shape[0] == 1)):
            raise ValueError(f"{name}: expected integer token ids, shape [T] or [1, T], got {t.dtype} "
                             f"{tuple(t.shape)}")
        ids = t.flatten().tolist()
    if not isinstance(ids, (list, tuple, range)):
        raise ValueError(f"{name}: expected an ordered sequence of integer token ids (list, tuple, 1-D "
                         f"integer tensor or array), got {type(ids).__name__}")
    ids = list(ids)
    bad = next((t for t in ids if not is_int(t)), None)
    if bad is not None:
        raise ValueError(f"{name}: expected integer token ids, got {bad!r} ({type(bad).__name__})")
    ids = [int(t) for t in ids]
    if not ids and not allow_empty:
        raise ValueError(f"{name}: expected at least one token")
    if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
        want = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name}: expected token ids {want}, got [{min(ids)}, {max(ids)}]")
    return ids


def id_array(name: str, a) -> np.ndarray:
    """A numpy array of token ids (integers >= 0; floats are never truncated)."""
    a = np.asarray(a)
    if a.size and (not np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        raise ValueError(f"{name}: expected integer token ids, got dtype {a.dtype}")
    if a.size and a.min() < 0:
        raise ValueError(f"{name}: expected token ids >= 0, got {int(a.min())}")
    return a


def tensor(name: str, t, dtypes=None, ndim: int | None = None, shape=None, contiguous: bool = False,
           device=None) -> torch.Tensor:
    """Type, dtype (one of `dtypes`), rank, shape (None entries: any size), contiguity, then device; no
    values."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and (t.dim() != len(shape) or any(
            s is not None and s != n for s, n in zip(shape, t.shape))):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous())")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected device {torch.device(device)}, got {t.device}")
    return t
