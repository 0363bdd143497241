"""An offline corpus and tokenizer: Python sources already on the machine.

Sources: the Python standard library ("stdlib") and the lab's own hard dependencies' Python sources ("torch",
"numpy"): every machine that runs the lab has them, so the corpus needs no download. A system interpreter's
stdlib can be small (Debian's ships about 10 MB of .py files without its test suite: ~2.8 M tokens, which a
6.7 M-parameter target memorizes within a few minutes of an H200), so the trained pair reads stdlib + torch.
Files are split into train and held-out by a hash of "<source>/<path inside it>" (the stdlib's files by their
path alone), stable across machines; the exact file set depends on the interpreter and package versions, which
`corpus_info` records. The tokenizer is a byte-level
BPE trained with `tokenizers` on the train split and saved to data/tokenizer/tokenizer.json (shipped in the
package as kdtree/tokenizer), so that every run encodes with the same vocabulary.

    files = corpus_files(("stdlib", "torch"))       # {"train": [...], "heldout": [...]}
    tok = train_tokenizer(files["train"], 4096)     # or load_tokenizer(path)
    ids = encode_files(tok, files["train"])         # one uint16 stream, documents separated by <|endoftext|>
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
import sysconfig
from pathlib import Path

import numpy as np

SPECIAL = ["<|endoftext|>", "<|mask|>"]  # document separator; the drafter's mask token
HELDOUT_PERCENT = 5


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


SOURCES = ("stdlib", "torch", "numpy")


def source_root(name: str) -> Path:
    """The folder of a corpus source: the stdlib, or an installed package's directory."""
    if name == "stdlib":
        return stdlib_root()
    if name not in SOURCES:
        raise ValueError(f"corpus source {name!r}: expected one of {SOURCES}")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"corpus source {name!r}: the package is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def split_of(rel: str, heldout_percent: int = HELDOUT_PERCENT) -> str:
    """'heldout' for about heldout_percent% of paths (by a hash of the relative path), else 'train'."""
    h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if h < heldout_percent else "train"


def corpus_files(sources=("stdlib",), root: Path | None = None, heldout_percent: int = HELDOUT_PERCENT,
                 max_bytes: int = 400_000) -> dict[str, list[Path]]:
    """The .py files of the given sources (or of one folder `root`), site-packages excluded and files over
    max_bytes skipped, sorted, split by path. sources: names from SOURCES, e.g. ("stdlib", "torch")."""
    if isinstance(sources, str):
        sources = (sources,)
    roots = [(None, Path(root))] if root else [(s, source_root(s)) for s in dict.fromkeys(sources)]
    if not roots:
        raise ValueError(f"sources={sources!r}: expected at least one of {SOURCES}")
    out: dict[str, list[Path]] = {"train": [], "heldout": []}
    for name, base in roots:
        if not base.is_dir():
            raise FileNotFoundError(f"corpus root {base} is not a directory")
        for p in sorted(base.rglob("*.py")):
            rel = p.relative_to(base).as_posix()
            if rel.startswith(("site-packages/", "dist-packages/")) or p.stat().st_size > max_bytes:
                continue
            key = rel if name in (None, "stdlib") else f"{name}/{rel}"
            out[split_of(key, heldout_percent)].append(p)
    if not out["train"] or not out["heldout"]:
        raise ValueError(f"corpus of {sources if not root else root}: expected .py files in both splits, got "
                         f"{len(out['train'])} train and {len(out['heldout'])} held-out")
    return out


def corpus_info(files: dict[str, list[Path]], sources=("stdlib",)) -> dict:
    """What a corpus was made of: interpreter and package versions, roots, file and byte counts per split."""
    if isinstance(sources, str):
        sources = (sources,)
    vers = {}
    for s in sources:
        if s != "stdlib":
            spec = importlib.util.find_spec(s)
            vers[s] = getattr(__import__(s), "__version__", "?") if spec else None
    return {"python": sys.version.split()[0], "sources": list(sources), "versions": vers,
            "roots": {s: str(source_root(s)) for s in sources},
            **{f"{k}_files": len(v) for k, v in files.items()},
            **{f"{k}_bytes": int(sum(p.stat().st_size for p in v)) for k, v in files.items()}}


def read_text(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int = 4096, min_frequency: int = 2):
    """Byte-level BPE on the given files; <|endoftext|> and <|mask|> are special tokens (ids 0 and 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if not 256 + len(SPECIAL) < vocab_size <= 65535:
        raise ValueError(f"vocab_size={vocab_size}: expected in ({256 + len(SPECIAL)}, 65535]")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return tok


def tokenizer_path() -> Path:
    """The lab's tokenizer (byte-level BPE, 4096 tokens, made by train_tokenizer on the train split of Python
    3.11.7's stdlib): kdtree/tokenizer/ inside an installed package, else the checkout's data/tokenizer/."""
    here = Path(__file__).resolve().parent
    installed = here / "tokenizer" / "tokenizer.json"
    return installed if installed.is_file() else here.parent / "data" / "tokenizer" / "tokenizer.json"


def load_tokenizer(path: str | Path | None = None):
    from tokenizers import Tokenizer
    p = Path(path) if path else tokenizer_path()
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer {p} not found (train one with kdtree.data.train_tokenizer)")
    return Tokenizer.from_file(str(p))


def encode_files(tok, files: list[Path]) -> np.ndarray:
    """All files as one uint16 token stream, each followed by <|endoftext|>."""
    eot = tok.token_to_id(SPECIAL[0])
    parts = []
    for enc in tok.encode_batch([read_text(p) for p in files]):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.array([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def windows(stream: np.ndarray, length: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random windows [n, length] (int64) from a token stream."""
    if stream.size <= length:
        raise ValueError(f"stream of {stream.size} tokens: expected more than length={length}")
    starts = rng.integers(0, stream.size - length, size=n)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int64)


def heldout_prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    """n windows of `length` tokens from the held-out split of the lab's corpus (notebook 02's prompts)."""
    tok = load_tokenizer()
    files = corpus_files(("stdlib", "torch"))
    ids = encode_files(tok, files["heldout"][:200])
    return [w.tolist() for w in windows(ids, length, n, np.random.default_rng(seed))]
