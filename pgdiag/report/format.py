"""How report values are written for a person: numbers in cells, and the parity statistics shown first.

Shared by the terminal tables (`pgdiag.cli.render`), the HTML page (`report.html`) and the markdown summary of
`compare --out` (`compare.output`), so the three show the same digits and the same headline rows.
"""

from __future__ import annotations

import math

PARITY_HEADLINE_STATS = (  # the parity table's first rows (metric `mismatch/<stat>`); the others fold under them
    "abs_mean",
    "bias",
    "rms",
    "abs_p99",
    "abs_max",
    "kl_k3",
    "tmpe",
    "frac_out_clip",
    "frac_out_2x",
    "pearson_r",
    "fit_slope",
    "ess_token",
)


def format_value(value: float | None, unit: str, *, digits: int = 6) -> str:
    """A number for a table cell: counts as integers, others with `digits` significant digits (scientific
    below 1e-4 and from 1e5); None as '—'."""
    if value is None:
        return "—"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if unit == "count":
        return f"{int(value):,}"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-4):
        return f"{value:.{max(digits - 2, 1)}e}"
    return f"{value:.{digits}g}"
