"""libkdtree.so (include/kdtree.h): built with nvcc where nvcc is present; its constants and launch choices
against kdtree/kernels.py and the .cu sources, its argument checks (which run before any CUDA call, so also
on machines without a GPU), and on a GPU its outputs against the CuPy path's (marker gpu)."""
import ctypes as C
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kdtree import capi, kernels
from kdtree.ops import moe_int4

ROOT = Path(__file__).resolve().parent.parent
HEADER = (ROOT / "include" / "kdtree.h").read_text()
SOURCE = (ROOT / "cuda" / "capi" / "kdtree_capi.cpp").read_text()

pytestmark = pytest.mark.slow  # the library's build: ~20 s of nvcc


@pytest.fixture(scope="session")
def lib(tmp_path_factory):
    """The library: KDTREE_LIB if set, else `make lib` into a scratch folder, which KDTREE_LIB then names
    for the session (skips without nvcc)."""
    if os.environ.get("KDTREE_LIB"):
        yield capi.library(os.environ["KDTREE_LIB"])
        return
    if shutil.which("nvcc") is None or shutil.which("bin2c") is None:
        pytest.skip("nvcc / bin2c not on PATH: libkdtree.so cannot be built here")
    out = tmp_path_factory.mktemp("lib")
    r = subprocess.run(["make", "-s", "lib", f"LIB_DIR={out}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    # the wrappers (capi.tree_build, ...) load capi.library() with no path: point it at this build
    os.environ["KDTREE_LIB"] = str(out / "libkdtree.so")
    try:
        yield capi.library(os.environ["KDTREE_LIB"])
    finally:
        del os.environ["KDTREE_LIB"]


def _define(name: str, text: str = HEADER) -> int:
    return int(re.search(rf"#define {name} (\d+)", text).group(1))


def test_shared_constants_are_equal():
    assert _define("KDTREE_MAX_BUDGET") == kernels.MAX_BUDGET
    assert _define("KDTREE_MAX_VOCAB") == kernels.MAX_VOCAB
    assert _define("KDTREE_MAX_DEPTH") == kernels.MAX_DEPTH
    assert _define("KDTREE_D_QK") == kernels.D_QK and _define("KDTREE_D_V") == kernels.D_V
    assert _define("KDTREE_MAX_SPLITS") == kernels.MAX_SPLITS == _define(
        "MAX_SPLITS", (ROOT / "cuda" / "verify_attn.cu").read_text())
    assert _define("KDTREE_MAX_GROUP_EXPERTS") == kernels.MAX_GROUP_EXPERTS
    moe = (ROOT / "cuda" / "moe_int4.cu").read_text()
    assert _define("KDTREE_FUSED_MAX_PAIRS") == kernels.FUSED_MAX_PAIRS == _define("FUSED_MAX_PAIRS", moe)
    assert _define("KDTREE_MAX_GROUP_PAIRS") == kernels.MAX_GROUP_PAIRS == 2 ** (64 - _define(
        "GROUP_PAIRS_SHIFT", moe)) - 1
    cst = dict(re.findall(r"(\w+) = ([\d.e*+\- ]+)[,;]", SOURCE))
    assert int(cst["kMaxGridY"]) == moe_int4.MAX_GRID_Y
    for name in ("MAX_CHUNK", "MAX_CANDIDATES", "TOPK_SMALL_K", "TREE_SMEM_LIMIT", "TOPK_BLOCK_FIXED_S",
                 "TOPK_COLUMN_S", "FUSED_BLOCKS_PER_SM"):
        assert eval(cst[name]) == getattr(kernels, name), name
    smem = re.findall(r'\{"(verify_attn_\w+)", ([\d*+ ]+), (\d+)\}', SOURCE)
    want = {v[0]: (v[1], v[2]) for v in kernels._VERIFY_KERNELS.values()}
    assert {n: (eval(s), int(t)) for n, s, t in smem} == want


def test_version_and_error_strings(lib):
    assert lib.kdtree_abi_version() == _define("KDTREE_ABI_VERSION") == 1
    for code, name in capi.STATUS.items():
        assert lib.kdtree_error_string(code).decode().startswith(name)
    assert b"unknown" in lib.kdtree_error_string(99)


def test_launch_choices_equal_the_python_loaders(lib):
    rng = np.random.default_rng(0)
    n, ch = C.c_int(), C.c_int()
    cases = [(15, 163840, 64, 132), (480, 163840, 1024, 132), (1, 7, 5, 132), (64, 262144, 16, 114)]
    cases += [(int(rng.integers(1, 2000)), int(rng.integers(1, 262145)), int(rng.integers(1, 1025)),
               int(rng.integers(16, 200))) for _ in range(300)]
    for R, V, K, sms in cases:
        assert lib.kdtree_topk_chunking(R, V, K, sms, C.byref(n), C.byref(ch)) == 0
        assert (n.value, ch.value) == kernels._chunking(R, V, min(K, V), sms), (R, V, K, sms)
    for _ in range(300):
        b, NH, keys = int(rng.integers(1, 64)), int(rng.integers(1, 70000)), int(rng.integers(1, 140000))
        sms, tile = int(rng.integers(16, 200)), int(rng.choice([32, 64]))
        assert lib.kdtree_default_splits(b, NH, keys, sms, tile) == kernels.default_splits.__wrapped__(
            b, NH, keys, sms, tile), (b, NH, keys, sms, tile)


FAKE = 1 << 20  # an aligned non-null address: argument checks never read it


def _tree_args(**kw):
    a = dict(logits=FAKE, dtype=capi.BF16, batch=2, L=15, V=163840, budget=64, root=FAKE, start=FAKE,
             tokens=FAKE, positions=FAKE, parents=FAKE, depths=FAKE, scores=FAKE, mask=FAKE, n_nodes=FAKE,
             ws=FAKE,
             ws_bytes=1 << 30, stream=None)
    a.update(kw)
    return list(a.values())


@pytest.mark.parametrize("edit,code,needle", [
    (dict(budget=0), 3, "budget=0"), (dict(budget=1025), 4, "budget=1025"), (dict(L=64), 4, "L=64"),
    (dict(V=262145), 4, "V=262145"), (dict(batch=0), 3, "batch=0"), (dict(dtype=7), 3, "dtype=7"),
    (dict(logits=None), 1, "logits is NULL"), (dict(logits=FAKE + 2), 2, "logits"),
    (dict(mask=None), 1, "mask is NULL"), (dict(scores=FAKE + 1), 2, "scores"),
    (dict(ws_bytes=100), 5, "workspace"),
])
def test_tree_build_refuses_bad_arguments_before_any_launch(lib, edit, code, needle):
    rc = lib.kdtree_tree_build(*_tree_args(**edit))
    assert rc == code, lib.kdtree_last_error()
    msg = lib.kdtree_last_error().decode()
    assert needle in msg and "kdtree_tree_build" in msg


def _verify_args(scale=0.1, max_seq_len=4096, impl=0, n_splits=0):
    F = FAKE
    return (F, F, 8192, F, 64, 64, F, F, 1, 65, 64, scale, max_seq_len, impl, n_splits, F, F, F, 1 << 30,
            None)


def _moe_args(T=1, D=7168, E=384, tile=0, fused=-1, ws=1 << 30):
    F = FAKE
    return (F, F, 2, F, T, 8, F, F, F, F, E, D, 2048, tile, fused, F, F, ws, None)


def test_other_entries_refuse_bad_arguments(lib):
    F = FAKE
    cases = [
        (lib.kdtree_tree_walk, (F, F, F, 1, 65, 0, F, F, F, None), 3, "max_accept=0"),
        (lib.kdtree_tree_walk, (F, F, F, 1, 2000, 8, F, F, F, None), 4, "N=2000"),
        (lib.kdtree_tree_walk, (F, None, F, 1, 65, 8, F, F, F, None), 1, "parents is NULL"),
        (lib.kdtree_kv_compact, (F, 4, 4000, 1152, F, 2, 64, 64, F, F, 16, F, None), 3, "whole number"),
        (lib.kdtree_kv_compact, (F, 4, 4096, 1000, F, 2, 64, 64, F, F, 16, F, None), 3, "row_bytes=1000"),
        (lib.kdtree_kv_compact, (F + 8, 4, 4096, 1152, F, 2, 64, 64, F, F, 16, F, None), 2, "cache"),
        (lib.kdtree_verify_attn, _verify_args(), 0, ""),
        (lib.kdtree_verify_attn, _verify_args(scale=-1.0), 3, "scale"),
        (lib.kdtree_verify_attn, _verify_args(max_seq_len=5000), 4, "max_seq_len=5000"),
        (lib.kdtree_verify_attn, _verify_args(n_splits=129), 4, "n_splits=129"),
        (lib.kdtree_verify_attn, _verify_args(impl=5), 4, "impl=5"),
        (lib.kdtree_moe_int4, _moe_args(fused=1), 0, ""),
        (lib.kdtree_moe_int4, _moe_args(T=16, fused=1), 4, "fused=1 takes"),
        (lib.kdtree_moe_int4, _moe_args(D=7000), 3, "multiples of 32"),
        (lib.kdtree_moe_int4, _moe_args(E=5000), 4, "E=5000"),
        (lib.kdtree_moe_int4, _moe_args(tile=12), 4, "tile_tokens=12"),
        (lib.kdtree_moe_int4, _moe_args(ws=64), 5, "workspace"),
        (lib.kdtree_moe_repack, (F, F, 4, 100, 64, F, F, None), 3, "multiple of 16"),
    ]
    cuda = torch.cuda.is_available()
    for fn, args, code, needle in cases:
        if code == 0:  # valid: past the checks it needs CUDA; on a GPU it would launch on the fake pointers
            if not cuda:
                assert fn(*args) == 6, lib.kdtree_last_error()  # KDTREE_ERR_NO_CUDA: checks passed, no driver
            continue
        rc = fn(*args)
        assert rc == code, (fn.__name__, rc, lib.kdtree_last_error())
        assert needle in lib.kdtree_last_error().decode(), (needle, lib.kdtree_last_error())


def test_workspace_queries(lib):
    assert lib.kdtree_tree_build_workspace(1, 15, 163840, 64) > 15 * 64 * 8
    assert lib.kdtree_tree_build_workspace(1, 15, 163840, 2000) == 0
    assert b"budget=2000" in lib.kdtree_last_error()
    assert lib.kdtree_moe_workspace(1, 8, 384, 7168, 2048) >= 8 * 2048 * 2 + 272
    assert lib.kdtree_moe_workspace(1, 8, 384, 7168, 2047) == 0


# ------------------------------------------------------------------------ on the GPU: equal to the CuPy path


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("b,L,V,budget,dtype", [
    (1, 15, 163840, 64, torch.bfloat16), (4, 8, 5000, 16, torch.float32),
    (32, 15, 163840, 1024, torch.bfloat16), (3, 63, 300, 127, torch.float32),
    (2, 4, 262144, 1000, torch.bfloat16)])
def test_tree_build_and_walk_equal_the_cupy_path(lib, b, L, V, budget, dtype):
    g = torch.Generator(device="cuda").manual_seed(b * L + budget)
    x = ((torch.randn(b, L, V, device="cuda", generator=g) * 6).round() / 2).to(dtype)  # many exact ties
    root = torch.randint(0, V, (b,), device="cuda", dtype=torch.int32, generator=g)
    start = torch.randint(0, 5000, (b,), device="cuda", dtype=torch.int32, generator=g)
    want = kernels.tree_build(x, budget, root, start)
    got = capi.tree_build(x, budget, root, start)
    for name in ("tokens", "positions", "parents", "depths", "scores", "mask", "n_nodes"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    choice = torch.where(torch.rand(b, budget + 1, device="cuda", generator=g) < 0.7, want.tokens.roll(-1, 1),
                         torch.randint(0, V, (b, budget + 1), device="cuda", generator=g)).to(torch.int32)
    for w, c in zip(kernels.tree_walk(want.tokens, want.parents, choice, 64),
                    capi.tree_walk(want.tokens, want.parents, choice, 64)):
        assert torch.equal(w, c)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
def test_kv_compact_equals_the_cupy_path(lib):
    g = torch.Generator(device="cuda").manual_seed(3)
    layers, pages, ps, b, A = 3, 40, 64, 4, 16
    cache = torch.randn(layers, pages * ps, 576, device="cuda", generator=g).to(torch.bfloat16)
    pt = torch.randperm(pages, device="cuda", generator=g)[:b * 8].view(b, 8).to(torch.int32)
    start = torch.tensor([10, 70, 200, 5], device="cuda", dtype=torch.int32)
    acc = torch.sort(torch.randperm(40, device="cuda", generator=g)[:A])[0].repeat(b, 1).to(torch.int32)
    n = torch.tensor([1, 5, 16, 9], device="cuda", dtype=torch.int32)
    a, c = cache.clone(), cache.clone()
    kernels.kv_compact(a, pt, start, acc, n, page_size=ps)
    capi.kv_compact(c, pt, start, acc, n, page_size=ps)
    assert torch.equal(a, c) and not torch.equal(a, cache)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("impl", [None, "wgmma", "ws", "mma"])
@pytest.mark.parametrize("b,N,ctx", [(1, 65, 4096), (8, 1, 32768), (2, 17, 1000)])
def test_verify_attn_equals_the_cupy_path(lib, impl, b, N, ctx):
    if impl in ("wgmma", "ws") and not kernels._sm90():
        pytest.skip("warpgroup MMA needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(b * N + ctx)
    H, ps = 16, 64
    S = ctx + N
    pages = -(-S // ps)
    cache = (torch.randn(b * pages * ps, 576, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    pt = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
    q = (torch.randn(b, N, H, 576, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    seq = torch.full((b,), S, device="cuda", dtype=torch.int32)
    mask = torch.tril(torch.ones(N, N, dtype=torch.bool, device="cuda")).expand(b, N, N)
    words = kernels.pack_mask(mask.contiguous())
    scale = float(np.float32(576 ** -0.5))
    want = kernels.verify_attn(q, cache, pt, seq, words, scale, page_size=ps, impl=impl,
                               max_seq_len=pages * ps, check_values=False)
    got = capi.verify_attn(q, cache, pt, seq, words, scale, page_size=ps, impl=impl, max_seq_len=pages * ps)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("case,mode", [(0, (None, None)), (1, (8, False)), (1, (8, True)), (2, (16, False)),
                                       (3, (None, None)), (4, (None, None)), (5, (16, False))])
def test_moe_equals_the_cupy_path(lib, case, mode):
    from test_moe_gpu import CASES, _case, _check_golden
    tile, fused = mode
    x, ids, wts, p13, s13, p2, s2 = _case(CASES[case], seed=case + 40)
    dev = [t.cuda() for t in (p13, s13, p2, s2)]
    want_w, got_w = kernels.repack_moe(*dev), capi.repack_moe(*dev)
    for name in ("w13", "s13", "w2", "s2"):
        assert torch.equal(getattr(got_w, name), getattr(want_w, name)), name
    for ids_dt in (torch.int32, torch.int64):
        args = (x.cuda(), ids.to(ids_dt).cuda(), wts.cuda())
        want = kernels.moe_int4(*args, want_w, tile_tokens=tile, fused=fused)
        got = capi.moe_int4(*args, got_w, tile_tokens=tile, fused=fused)
        _check_golden(got, x, ids, wts, p13, s13, p2, s2)
        rel = float((got - want).norm() / want.norm())
        assert rel <= 1e-5, rel  # fp32 atomics: the order of a token's experts may differ


@pytest.mark.gpu
def test_c_program_links_and_runs(lib, tmp_path):
    """tests/capi/smoke.c, built against the library: a tree built, walked and checked in C, verify attention
    and the INT4 MoE against float64 references in C, and the host cost of a call (KDTREE_SMOKE_JSON gets its
    timings)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    so = Path(lib._name)
    exe = tmp_path / "smoke"
    r = subprocess.run([cc, "-O2", "-std=c11", str(ROOT / "tests" / "capi" / "smoke.c"),
                        f"-I{ROOT / 'include'}", f"-L{so.parent}", "-lkdtree", f"-Wl,-rpath,{so.parent}",
                        "-ldl", "-lm", "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "smoke: ok" in r.stdout
