"""Markdown tables for reports (bench.py's sections, scripts/compare_recipe.py): columns padded so that the
table also lines up in a terminal."""
from typing import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"  # right-aligned columns
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
