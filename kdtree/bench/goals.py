"""The lab's goals, one data file (goals.json beside this module) read by every benchmark and by the report.

    target(key, measured, **fields) -> {"key", "name", "measured", "goal", "met", "info"?, **fields}

A goal is {name, goal, higher (default true), info (default false), record}: `name` may hold {fields} that
the benchmark fills in (a batch size, a dtype); `met` is measured >= goal when higher, else <= goal, and
False for a missing measurement. `key_of(t)` gives the goal a record's target belongs to, also for records
written before targets carried their key (by matching the name against the goal's template).
"""
from __future__ import annotations

import functools
import json
import re
import string
from pathlib import Path

PATH = Path(__file__).with_name("goals.json")


@functools.cache
def goals() -> dict[str, dict]:
    """{key: goal} from goals.json (its "_doc" entry left out)."""
    raw = json.loads(PATH.read_text())
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def goal(key: str) -> dict:
    g = goals().get(key)
    if g is None:
        raise KeyError(f"key={key!r}: not a goal of {PATH.name} (known: {', '.join(sorted(goals()))})")
    return g


def target(key: str, measured, **fields) -> dict:
    """A record's target for goal `key` (module docstring); `fields` fill the name's {fields} and are kept."""
    g = goal(key)
    fields = {**{f: g[f] for f in ("batch", "budget") if f in g}, **fields}
    names = {f for _, f, _, _ in string.Formatter().parse(g["name"]) if f}
    missing = names - fields.keys()
    if missing:
        raise ValueError(f"target({key!r}): the name needs {sorted(missing)}, got fields {sorted(fields)}")
    measured = None if measured is None else float(measured)
    out = {"key": key, "name": g["name"].format(**fields), "measured": measured, "goal": g["goal"],
           "met": met(key, measured)}
    if g.get("info"):
        out["info"] = True
    return {**out, **{k: v for k, v in fields.items() if k not in out}}


def shown_name(t: dict) -> str:
    """A target's name as tables and logs show it: a goal fixed to a batch and budget (the bridges'; older
    bridge records' {what, batch, budget}) names them after its name."""
    name = t.get("name") or t.get("what", "?")
    key = key_of(t)
    if "what" in t or (key is not None and "batch" in goals()[key]):
        name += "".join(f", {k} {t[k]}" for k in ("batch", "budget") if t.get(k) is not None)
    return name


def line(t: dict) -> str:
    """One target as a line of text, "[met] name: measured (goal g)" (older bridge records' {what, batch,
    budget, value} too; a missing measurement as "-")."""
    v = t.get("measured", t.get("value"))
    name = shown_name(t)
    status = "info" if t.get("info") else "met" if t.get("met") else "MISSED"
    return f"[{status}] {name}: {'-' if v is None else f'{v:.3g}'} (goal {t.get('goal')})"


def met(key: str, measured) -> bool:
    """measured reaches goal `key` (>= when higher, else <=); False for None."""
    g = goal(key)
    if measured is None:
        return False
    return bool(measured >= g["goal"] if g.get("higher", True) else measured <= g["goal"])


@functools.cache
def _pattern(key: str) -> re.Pattern:
    parts = []
    for text, field, _, _ in string.Formatter().parse(goal(key)["name"]):
        parts.append(re.escape(text))
        if field:
            parts.append(r"(?:[^()]|\([^()]*\))+?")   # a field may hold one level of parentheses
    return re.compile("".join(parts) + r"\Z")


def key_of(t: dict) -> str | None:
    """The goal key of a record's target: its "key", else the goal whose name template matches its name
    (bridge records' {what, batch, budget} by what and the batch and budget)."""
    if t.get("key") in goals():
        return t["key"]
    name = t.get("name") or t.get("what") or ""
    for key, g in goals().items():
        if any(f in g and t.get(f) != g[f] for f in ("batch", "budget")):
            continue
        if _pattern(key).match(name):
            return key
    return None
