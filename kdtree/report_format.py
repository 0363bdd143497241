"""Numbers and tables for the results page (kdtree.report): every number in positional notation (thousands
separators, fixed decimals), never in exponent form; a table is markdown lines ending in a blank line."""
from __future__ import annotations

import math


def _num(x, digits: int = 3) -> str:
    """A number for a table: None as a dash, integers with separators, floats to `digits` significant digits
    in positional notation (999.6 -> "1,000", 0.000012 -> "0.000012"; never "1e+03")."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "nan" if x != x else ("inf" if x > 0 else "-inf")
        if x == 0:
            return "0"
        dec = digits - 1 - math.floor(math.log10(abs(x)))
        if dec <= 0:
            return f"{x:,.0f}"
        text = f"{x:,.{dec}f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    return str(x)


def _x(r) -> str:
    """A ratio as "1.29x" (two decimals)."""
    return "-" if r is None else f"{r:.2f}x"


def _ms(s) -> str:
    return "-" if s is None else f"{1e3 * s:.3f}"


def _us(s) -> str:
    return "-" if s is None else f"{1e6 * s:.1f}"


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(c if isinstance(c, str) else _num(c) for c in r) + " |" for r in rows]
    return out + [""]
