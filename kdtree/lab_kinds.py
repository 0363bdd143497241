"""The kinds a lab notebook's parameter may take (`Int`, `Float`, `OneOf`, `Folder`, `ListOf`, ...), each with
`expect` (what it must be, in words) and `ok(value, base)` (paths relative to `base`, the notebook's folder),
and `Param` (a kind, a default, one line of help). `kdtree.lab_params` declares the notebooks with them.

This module imports neither torch nor numpy, so that the runner refuses a bad name or value at once.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .config import CONFIG_DIR, PRESETS


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _path(v, base: Path | None) -> Path:
    p = Path(v)
    return p if p.is_absolute() or base is None else Path(base) / p


# ---------------------------------------------------------------------------------------------- kinds
class Kind:
    """What a value must be: `expect` in words ("an int >= 1"), `ok(value, base)` the test."""

    expect = "a value"

    def ok(self, v, base: Path | None) -> bool:
        raise NotImplementedError


class Int(Kind):
    def __init__(self, lo: int | None = None, hi: int | None = None):
        self.lo, self.hi = lo, hi
        self.expect = (f"an int in [{lo}, {hi}]" if lo is not None and hi is not None
                       else f"an int >= {lo}" if lo is not None else "an int")

    def ok(self, v, base):
        return _is_int(v) and (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)


class Float(Kind):
    """A finite number (ints too, never bools) within [lo, hi]; an open end excludes its bound."""

    def __init__(self, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False):
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        if lo is not None and hi is not None:
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            self.expect = f"a finite number in {left}{lo:g}, {hi:g}{right}"
        elif lo is not None:
            self.expect = f"a finite number {'>' if lo_open else '>='} {lo:g}"
        else:
            self.expect = "a finite number"

    def ok(self, v, base):
        if not _is_number(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)


class Flag(Kind):
    expect = "True or False"

    def ok(self, v, base):
        return isinstance(v, bool)


class OneOf(Kind):
    """One of the choices, compared with its type (1 is not True, "True" is not True)."""

    def __init__(self, *choices):
        self.choices = choices
        self.expect = f"one of {list(choices)!r}"

    def ok(self, v, base):
        return any(type(v) is type(c) and v == c for c in self.choices)


class Text(Kind):
    expect = "a non-empty string"

    def ok(self, v, base):
        return isinstance(v, str) and v.strip() != ""


class Device(Kind):
    expect = "'auto', 'cpu', 'cuda' or 'cuda:N'"

    def ok(self, v, base):
        return isinstance(v, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None


class Config(Kind):
    """A model configuration for kdtree.config.load_config: a preset, a name under data/configs/ or a path
    to a HF config.json; many=True: also a non-empty list of them."""

    def __init__(self, many: bool = False):
        self.many = many
        names = sorted(PRESETS) + sorted(q.stem for q in CONFIG_DIR.glob("*.json"))
        self.expect = (f"a preset or shipped name ({', '.join(names)}) or a path to a HF config.json"
                       + (", or a non-empty list of them" if many else ""))

    @staticmethod
    def _one(v, base) -> bool:
        if not isinstance(v, str) or not v:
            return False
        if v in PRESETS:
            return True
        shipped = CONFIG_DIR / (v if v.endswith(".json") else v + ".json")
        if "/" not in v and "\\" not in v and shipped.is_file():   # a shipped name, never a file of the cwd
            return True
        return _path(v, base).is_file()

    def ok(self, v, base):
        if self.many and isinstance(v, list):
            return len(v) > 0 and all(self._one(c, base) for c in v)
        return self._one(v, base)


class Folder(Kind):
    """An existing folder that holds the named subfolders."""

    def __init__(self, holding: tuple[str, ...] = ()):
        self.holding = holding
        self.expect = ("an existing folder" if not holding else
                       f"a folder holding {' and '.join(h + '/' for h in holding)}")

    def ok(self, v, base):
        if not isinstance(v, str) or not v:
            return False
        p = _path(v, base)
        return p.is_dir() and all((p / h).is_dir() for h in self.holding)


class WritableFolder(Kind):
    expect = "a folder path (not a file, nor under one)"

    def ok(self, v, base):
        if not isinstance(v, str) or not v.strip():
            return False
        p = _path(v, base)
        return not any(q.exists() and not q.is_dir() for q in (p, *p.parents))


class File(Kind):
    expect = "an existing file"

    def ok(self, v, base):
        return isinstance(v, str) and v != "" and _path(v, base).is_file()


class Maybe(Kind):
    def __init__(self, kind: Kind):
        self.kind = kind
        self.expect = f"None or {kind.expect}"

    def ok(self, v, base):
        return v is None or self.kind.ok(v, base)


class ListOf(Kind):
    """A list (not a tuple: the notebooks add lists) of `min_len` or more items of `kind`; `contains`: a
    value it must hold; `distinct`: no item twice."""

    def __init__(self, kind: Kind, min_len: int = 1, contains=None, distinct: bool = False):
        self.kind, self.min_len, self.contains, self.distinct = kind, min_len, contains, distinct
        self.expect = ("a non-empty list" if min_len == 1 else "a list") + (
            f" holding {contains!r}" if contains is not None else "") + (
            " of distinct items" if distinct else "") + f", each {kind.expect}"

    def ok(self, v, base):
        if not isinstance(v, list) or len(v) < self.min_len or not all(self.kind.ok(x, base) for x in v):
            return False
        if self.contains is not None and self.contains not in v:
            return False
        return not self.distinct or len(set(map(repr, v))) == len(v)


class Row(Kind):
    """A list [a, b, ...] of named items, each of its kind; `cond`: (test over the items, its words)."""

    def __init__(self, *items: tuple[str, Kind], cond: tuple[Callable, str] | None = None):
        self.items, self.cond = items, cond
        self.expect = (f"[{', '.join(n for n, _ in items)}] ("
                       + "; ".join(f"{n}: {k.expect}" for n, k in items)
                       + (f"; {cond[1]}" if cond else "") + ")")

    def ok(self, v, base):
        if not isinstance(v, (list, tuple)) or len(v) != len(self.items):
            return False
        if not all(k.ok(x, base) for (_, k), x in zip(self.items, v)):
            return False
        return self.cond is None or bool(self.cond[0](*v))


class Keys(Kind):
    """A dict whose keys are among `allowed` (their values are checked by whatever reads them)."""

    def __init__(self, allowed, what: str):
        self.allowed = frozenset(allowed)
        self.expect = f"a dict whose keys are {what}"

    def ok(self, v, base):
        return isinstance(v, dict) and all(isinstance(k, str) and k in self.allowed for k in v)


@dataclass(frozen=True)
class Param:
    kind: Kind
    default: object
    help: str

    def problem(self, v, base: Path | None = None) -> str | None:
        """None when v is allowed, else what was expected."""
        return None if self.kind.ok(v, base) else self.kind.expect
