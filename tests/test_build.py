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
    r = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-DKDTREE_WGMMA=1", "-Xptxas", "-v",
                        "-c", str(src), "-o", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "spill stores" in r.stderr
    import re
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and max(spills) == 0, r.stderr[-2000:]
    # ptxas serialises a kernel's wgmma pipeline when other instructions may touch in-flight accumulators
    assert "C7515" not in r.stderr, r.stderr[-2000:]


def test_split_limit_matches_the_kernel():
    """verify_attn_combine sizes its shared weights by verify_attn.cu's MAX_SPLITS; the wrapper's limit is it."""
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


def test_verify_ablations_apply_and_compile(nvcc, tmp_path):
    """bench.VERIFY_ABLATIONS edit verify_attn.cu's text: each edit must still find its text (an edit that no
    longer matches would time the full kernel under an ablation's name), and the edited source must compile."""
    from kdtree import bench, kernels
    src = next(p for p in SOURCES if p.name == "verify_attn.cu").read_text()
    for name, edits in bench.VERIFY_ABLATIONS.items():
        for old, new in edits:
            assert src.count(old) >= 1, (name, old)
        edited = kernels._edited("verify_attn", src, edits)
        assert (edited != src) == bool(edits), name
    (tmp_path / "abl.cu").write_text(edited)  # the last: no S, no P V, no cp.async
    r = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-DKDTREE_WGMMA=1",
                        f"-I{kernels.cuda_source_dir()}", "-c", str(tmp_path / "abl.cu"), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def test_source_edits_reject_missing_text_and_restore():
    from kdtree import kernels
    with pytest.raises(ValueError, match="does not occur in cuda/verify_attn.cu"):
        with kernels.source_edits("verify_attn", [("no such text in the kernel", "")]):
            pass
    assert "verify_attn" not in kernels._SOURCE_EDITS
    with pytest.raises(RuntimeError, match="inside"):
        with kernels.source_edits("verify_attn", [("ks < 36", "ks < 4")]):
            assert kernels._SOURCE_EDITS["verify_attn"] == (("ks < 36", "ks < 4"),)
            raise RuntimeError("inside")
    assert "verify_attn" not in kernels._SOURCE_EDITS
