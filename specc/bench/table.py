"""Markdown tables for terminals and reports."""
from __future__ import annotations


def table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A Markdown table (also readable in a terminal)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = align or "l" + "r" * (len(headers) - 1)
    line = lambda vals: "| " + " | ".join(v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(vals, widths, align)) + " |"
    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
