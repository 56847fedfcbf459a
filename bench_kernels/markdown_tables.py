"""Markdown tables of results: the bench scripts' printed tables and the results page's."""

import math


def fmt(v, spec=".3g"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def markdown_table(rows, columns):
    """rows: list of dicts; columns: list of (header, key, format spec or None)."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for _, key, spec in columns:
            v = r.get(key)
            cells.append(fmt(v, spec) if spec else ("-" if v is None else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
