"""The cells and tables of the one-file HTML page (`report.html`, `report.explain_page`): escaped text, numbers
with their unit, and a scrolling table."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from pgdiag.report.format import format_value

__all__ = ["_e", "_num", "_table"]


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, unit: str = "") -> str:
    """A number for a cell: counts as integers, others with 6 significant digits; None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    value = float(value)
    if math.isnan(value):
        return "—"
    return format_value(value, unit)


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1, small: Sequence[bool] = ()
) -> str:
    """An HTML table; `rows` hold ready HTML cells (``<td ...>``) or plain strings (escaped, right-aligned
    except the first `left` columns); rows flagged in `small` are greyed (a bucket with few tokens)."""
    head = "".join(
        f'<th class="name">{_e(h)}</th>' if i < left else f"<th>{_e(h)}</th>" for i, h in enumerate(header)
    )
    body = []
    for index, row in enumerate(rows):
        cells = []
        for i, cell in enumerate(row):
            if cell.startswith("<td"):
                cells.append(cell)
            else:
                cells.append(f'<td class="name">{_e(cell)}</td>' if i < left else f"<td>{_e(cell)}</td>")
        muted = ' class="small"' if index < len(small) and small[index] else ""
        body.append(f"<tr{muted}>{''.join(cells)}</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
