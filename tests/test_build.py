"""Every CUDA source compiles for Hopper with nvcc (a build check that runs on CPU machines)."""
import subprocess

import pytest

from kdtree.kernels import cuda_sources

SOURCES = cuda_sources()


def test_sources_ship_with_the_package():
    names = {p.name for p in SOURCES}
    assert {"tree_build.cu", "tree_walk.cu", "verify_attn.cu"} <= names
    for p in SOURCES:
        head = p.read_text().splitlines()[:3]
        assert head[0].startswith("//") and "Golden twin" in p.read_text()[:800], p.name


@pytest.mark.parametrize("src", SOURCES, ids=[p.name for p in SOURCES])
def test_compiles_for_sm90a(src, nvcc, tmp_path):
    # KDTREE_WGMMA: the loader's sm_90a build, with the warpgroup-MMA kernels
    r = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-DKDTREE_WGMMA=1",
                        "-Xptxas", "-v", "-c", str(src), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "spill stores" in r.stderr
    import re
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and max(spills) == 0, r.stderr[-2000:]
    # ptxas serialises a kernel's wgmma pipeline when other instructions may touch in-flight accumulators
    assert "C7515" not in r.stderr, r.stderr[-2000:]


def test_split_limit_matches_the_kernel():
    """verify_attn_combine sizes its shared weights by verify_attn.cu's MAX_SPLITS; the wrapper's limit is
    it."""
    import re

    from kdtree import kernels
    src = next(p for p in SOURCES if p.name == "verify_attn.cu").read_text()
    assert int(re.search(r"#define MAX_SPLITS (\d+)", src).group(1)) == kernels.MAX_SPLITS


def test_fused_moe_grid_matches_the_kernel():
    """moe_fused_t8's persistent grid is FUSED_BLOCKS_PER_SM blocks per SM; the kernel's launch bounds promise
    that many resident blocks (MOE_FUSED_MINB), so that every block of the grid runs at once."""
    import re

    from kdtree import kernels
    src = next(p for p in SOURCES if p.name == "moe_int4.cu").read_text()
    assert int(re.search(r"#define MOE_FUSED_MINB (\d+)", src).group(1)) == kernels.FUSED_BLOCKS_PER_SM


def _ptx(nvcc, src, out, defines=()):
    return subprocess.Popen([nvcc, "-std=c++17", "-O3", "-ptx", "-arch=sm_90a", "-DKDTREE_WGMMA=1",
                             f"-I{src.parent}", *defines, str(src), "-o", str(out)],
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_verify_ablations_build_and_their_defaults_leave_the_kernel_as_it_is(nvcc, tmp_path):
    """bench.VERIFY_ABLATIONS set verify_attn.cu's KDTREE_ABLATE_* switches: every ablation compiles and
    changes the PTX (one that did not would time the full kernel under an ablation's name), and the switches
    set to their defaults give the PTX of the plain build."""
    from kdtree import bench
    src = next(p for p in SOURCES if p.name == "verify_attn.cu")
    defaults = ["-DKDTREE_ABLATE_S_STEPS=36", "-DKDTREE_ABLATE_NO_PV=0", "-DKDTREE_ABLATE_NO_EXP=0",
                "-DKDTREE_ABLATE_NO_LOADS=0"]
    builds = {"plain": (), "defaults": defaults}
    for name, defines in bench.VERIFY_ABLATIONS.items():
        if defines:
            builds[name] = [f"-D{k}={v}" for k, v in defines.items()]
    procs = {k: _ptx(nvcc, src, tmp_path / f"{i}.ptx", d) for i, (k, d) in enumerate(builds.items())}
    ptx = {}
    for i, (k, p) in enumerate(procs.items()):
        err = p.communicate(timeout=900)[1]
        assert p.returncode == 0, (k, err[-4000:])
        ptx[k] = [ln for ln in (tmp_path / f"{i}.ptx").read_text().splitlines() if not ln.startswith("//")]
    assert ptx["defaults"] == ptx["plain"]
    for name in builds:
        if name not in ("plain", "defaults"):
            assert ptx[name] != ptx["plain"], name


def test_compile_defines_refuse_unknown_switches_and_restore():
    from kdtree import kernels
    with pytest.raises(ValueError, match="not a macro that cuda/verify_attn.cu reads"):
        with kernels.compile_defines("verify_attn", {"KDTREE_ABLATE_NO_SUCH_PART": 1}):
            pass
    with pytest.raises(ValueError, match="must be an int"):
        with kernels.compile_defines("verify_attn", {"KDTREE_ABLATE_NO_PV": "1"}):
            pass
    assert "verify_attn" not in kernels._DEFINES
    with pytest.raises(RuntimeError, match="inside"):
        with kernels.compile_defines("verify_attn", {"KDTREE_ABLATE_NO_PV": 1}):
            assert kernels._DEFINES["verify_attn"] == (("KDTREE_ABLATE_NO_PV", 1),)
            raise RuntimeError("inside")
    assert "verify_attn" not in kernels._DEFINES
