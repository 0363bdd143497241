"""weights.save / save_drafter never destroy what a folder holds: the other kind of checkpoint, stray shards,
an empty path or a bad model / dtype are refused before anything is written, and a write that fails part way
leaves the folder's earlier files byte for byte. The loaders and the engine name a bad argument."""
import pytest
import torch

from kdtree import weights
from kdtree.config import TINY_A
from kdtree.drafter import build_drafter
from kdtree.engine import Engine
from kdtree.model import build_model


@pytest.fixture(scope="module")
def pair():
    t = build_model(TINY_A, seed=4)
    return t, build_drafter(t, block_size=4)


def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_save_refuses_an_empty_or_missing_path(pair, tmp_path, monkeypatch):
    t, d = pair
    monkeypatch.chdir(tmp_path)
    for bad in ("", "  ", None, 3):
        with pytest.raises(ValueError, match=r"save: path=.*expected a checkpoint folder"):
            weights.save(t, bad)
    assert list(tmp_path.iterdir()) == []


def test_one_kind_of_checkpoint_never_overwrites_the_other(pair, tmp_path):
    t, d = pair
    tf, df = weights.save(t, tmp_path / "target"), weights.save_drafter(d, tmp_path / "drafter")
    before = _snapshot(tf), _snapshot(df)
    with pytest.raises(ValueError, match="holds a target checkpoint"):
        weights.save_drafter(d, tf)
    with pytest.raises(ValueError, match="holds a drafter checkpoint"):
        weights.save(t, df)
    assert (_snapshot(tf), _snapshot(df)) == before
    weights.save(t, tf)                      # the same kind again: replaced in place
    weights.save_drafter(d, df)
    assert weights.checkpoint_kind(tf) == "target" and weights.checkpoint_kind(df) == "drafter"


def test_stray_shards_and_files_are_refused(pair, tmp_path):
    t, _ = pair
    d = weights.save(t, tmp_path / "a")
    (d / "model-00002-of-00002.safetensors").write_bytes(b"old")
    with pytest.raises(ValueError, match=r"other checkpoint files \(model-00002-of-00002.safetensors\)"):
        weights.save(t, d)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        weights.save(t, f)


def test_the_model_and_dtype_are_checked_before_writing(pair, tmp_path):
    t, d = pair
    with pytest.raises(ValueError, match="save_drafter: drafter: expected a DFlashDrafter"):
        weights.save_drafter(t, tmp_path / "x")
    with pytest.raises(ValueError, match="save_drafter: dtype=torch.int8"):
        weights.save_drafter(d, tmp_path / "x", dtype=torch.int8)
    with pytest.raises(ValueError, match="save: model: expected a kdtree Transformer"):
        weights.save(d, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_failed_write_leaves_the_earlier_files(pair, tmp_path, monkeypatch):
    t, _ = pair
    d = weights.save(t, tmp_path / "a")
    before = _snapshot(d)

    def boom(sd, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(weights, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        weights.save(build_model(TINY_A, seed=9), d)
    assert _snapshot(d) == before
    assert [p.name for p in tmp_path.iterdir()] == ["a"]      # no temporary folder left beside it


def test_loaders_name_a_bad_argument(pair, tmp_path):
    t, d = pair
    tf = weights.save(t, tmp_path / "t")
    with pytest.raises(ValueError, match=r"load: path=None"):
        weights.load(None)
    with pytest.raises(ValueError, match=r"load: dtype='int8': expected a floating torch dtype"):
        weights.load(tf, dtype="int8")
    assert weights.load(tf, dtype="float16").dtype == torch.float16   # a dtype by its torch name
    with pytest.raises(ValueError, match="allow_nonfinite='no': expected True or False"):
        weights.load(tf, allow_nonfinite="no")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="load: device='cuda': no CUDA device"):
            weights.load(tf, device="cuda")
    with pytest.raises(ValueError, match="load_drafter: target: expected the kdtree Transformer"):
        weights.load_drafter(tmp_path / "d", None)


@pytest.mark.parametrize("name", ["graphs", "debug", "compile", "graph_sampling"])
def test_engine_flags_are_booleans(pair, name):
    t, _ = pair
    for bad in ("no", "false", 0, None):
        with pytest.raises(ValueError, match=f"{name}={bad!r}: expected True or False"):
            Engine(t, mode="ar", max_batch=1, max_len=64, **{name: bad})
