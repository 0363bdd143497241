"""Compile, cache and launch the CUDA kernels of cuda/ (shipped as kdtree.cuda), and the argument checks every
family shares.

Contract:
  * `_module(name)` compiles cuda/<name>.cu once per process with NVRTC (CuPy RawModule, `-std=c++17`, the
    source folder on the include path, a `#line` directive so errors name the file); verify_attn is built for
    sm_90a with KDTREE_WGMMA=1 on a compute capability 9.0 GPU. KDTREE_LINEINFO=1 adds `-lineinfo`.
  * `_launch(module, kernel, grid, block, args, smem)` launches on torch's current CUDA stream with no host
    round trip (graph-capturable); above 48 KB of static + dynamic shared memory it opts the kernel in, up to
    the device's sharedMemPerBlockOptin (more raises ValueError). Pointer args go as `_p(tensor)` (uint64),
    int args as `_i(x)` (int32).
  * `compile_defines(name, {macro: value})`: a context in which cuda/<name>.cu compiles with -D options
    (its KDTREE_ABLATE_* switches; timing only).
  * Checks raise ValueError naming the argument: `_need` (type, dtype, rank, shape, contiguity; no device
    read), `_on_one_gpu` (every tensor on the current CUDA device), `_check_pages` (page indices in range,
    reads the device unless check_values is False).
  * `_empty` allocates outputs; with POISON set (tests set `kdtree.ops.loader.POISON`) they are filled with
    NaN, 0xA5 (uint8) or -7777 first, so that unwritten outputs show.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import checks

PAGE_SIZE = 64  # rows a page of the paged latent KV cache (kv_compact's and verify_attn's default)


# ----------------------------------------------------------------------------- module loading
def cuda_source_dir() -> Path:
    """kdtree/cuda/ inside an installed (non-editable) package, else the checkout's cuda/."""
    pkg = Path(__file__).resolve().parent.parent
    installed = pkg / "cuda"
    return installed if installed.is_dir() else pkg.parent / "cuda"


def cuda_sources() -> list[Path]:
    return sorted(cuda_source_dir().glob("*.cu"))  # headers (*.cuh) are included by these


@functools.cache
def _module(name: str):
    """Compile cuda/<name>.cu once per process (NVRTC via CuPy); `#line` keeps errors pointing at the file."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError("the kernel backend needs CuPy (pip install -e '.[gpu]') and a CUDA GPU") from e
    path = cuda_source_dir() / f"{name}.cu"
    code = f'#line 1 "{path}"\n' + path.read_text()
    options = ("-std=c++17", f"-I{cuda_source_dir()}")
    options += tuple(f"-D{k}={v}" for k, v in _DEFINES.get(name, ()))
    if os.environ.get("KDTREE_LINEINFO"):  # source lines for profilers (ncu's source page)
        options += ("-lineinfo",)
    if name in _SM90A_MODULES and _sm90():  # warpgroup MMA needs the arch-specific target
        options += ("-arch=sm_90a", "-DKDTREE_WGMMA=1")
    return cupy.RawModule(code=code, options=options)


_SM90A_MODULES = {"verify_attn"}
_DEFINES: dict[str, tuple[tuple[str, int], ...]] = {}   # compile_defines: name -> (macro, value), ...


@contextlib.contextmanager
def compile_defines(name: str, defines: dict):
    """Timing experiments only: while the block runs, cuda/<name>.cu compiles with the -D options
    {macro: int} (the .cu's KDTREE_ABLATE_* switches; each macro must occur in the source, else ValueError
    before anything compiles). An ablated kernel's outputs are not meant to be right."""
    src = (cuda_source_dir() / f"{name}.cu").read_text()
    items = []
    for k, v in dict(defines).items():
        if not (isinstance(k, str) and k.isidentifier() and k in src):
            raise ValueError(f"compile_defines: {k!r} is not a macro that cuda/{name}.cu reads")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"compile_defines: {k} must be an int, got {v!r}")
        items.append((k, v))
    prev = _DEFINES.get(name)
    _DEFINES[name] = tuple(items)
    _clear_compiled()
    try:
        yield
    finally:
        if prev is None:
            _DEFINES.pop(name, None)
        else:
            _DEFINES[name] = prev
        _clear_compiled()


def _clear_compiled() -> None:
    _module.cache_clear()
    _kernel.cache_clear()
    _SMEM_OPTIN.clear()


@functools.cache
def _sm90() -> bool:
    """The current GPU is a Hopper (compute capability 9.0): sm_90a builds and the wgmma kernels."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@functools.cache
def _sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


@functools.cache
def _kernel(module: str, name: str):
    return _module(module).get_function(name)


_SMEM_OPTIN: dict = {}


def _launch(module: str, name: str, grid, block, args, smem: int = 0) -> None:
    import cupy
    k = _kernel(module, name)
    total = smem + k.shared_size_bytes  # the 48 KB default limit counts static + dynamic shared memory
    if total > 48 * 1024 and not _SMEM_OPTIN.get((module, name)):
        dev = torch.cuda.current_device()
        limit = cupy.cuda.runtime.getDeviceProperties(dev)["sharedMemPerBlockOptin"]
        if total > limit:
            raise ValueError(f"{name}: needs {total} bytes of shared memory, the device allows {limit}")
        k.max_dynamic_shared_size_bytes = limit - k.shared_size_bytes
        _SMEM_OPTIN[(module, name)] = True
    with _cupy_stream(torch.cuda.current_stream().cuda_stream):
        k(grid, block, args, shared_mem=smem)


@functools.cache
def _cupy_stream(ptr: int):
    """CuPy's handle on one of torch's streams (by its raw pointer), made once."""
    import cupy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers Stream.from_external
        return cupy.cuda.ExternalStream(ptr)


def _p(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _i(x) -> np.int32:
    return np.int32(x)


# ----------------------------------------------------------------------------- checks
POISON = False  # tests set this: outputs are filled with NaN / -7777 before every launch


def _empty(*shape, dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan") if dtype.is_floating_point else 0xA5 if dtype == torch.uint8 else -7777)
    return t


def _need(name: str, t, dtypes, ndim=None, shape=None, contiguous=True) -> None:
    """Type, dtype, rank, shape, contiguity, then device (so the first four are checkable on a CPU)."""
    checks.tensor(name, t, dtypes, ndim=ndim, shape=shape, contiguous=contiguous)


def _need_page_size(page_size) -> None:
    checks.positive_int("page_size", page_size)


def _on_one_gpu(**tensors) -> None:
    """After the static checks: every tensor on the same CUDA device, the current one (kernels launch on the
    current device's current stream)."""
    for k, v in tensors.items():
        if v.device.type != "cuda":
            raise ValueError(f"{k}: expected a CUDA tensor, got device {v.device}")
    devs = {k: v.device for k, v in tensors.items()}
    if len(set(devs.values())) > 1:
        raise ValueError(f"tensors on different devices: {devs}")
    dev, cur = next(iter(devs.values())), torch.cuda.current_device()
    if dev.index != cur:
        raise ValueError(f"tensors on {dev} but the current CUDA device is cuda:{cur}: call under "
                         f"torch.cuda.device({dev.index}) (or torch.cuda.set_device)")


def _aligned(**tensors) -> None:
    """Tensors the kernels read 16 bytes at a time start on a 16-byte boundary (a view's offset may not)."""
    for name, t in tensors.items():
        if t is not None and t.data_ptr() % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned start (a view at an odd offset? a copy is)")


def _check_pages(page_table: torch.Tensor, num_pages: int, check_values: bool) -> None:
    """Every page index in [0, num_pages) (reads the device; skipped unless check_values)."""
    if check_values and page_table.numel():
        lo, hi = int(page_table.min()), int(page_table.max())
        if lo < 0 or hi >= num_pages:
            raise ValueError(f"page_table: page index out of range: expected [0, {num_pages}), "
                             f"got [{lo}, {hi}]")
