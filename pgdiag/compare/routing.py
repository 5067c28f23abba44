"""How much of an engine-vs-trainer mismatch is MoE routing: one run recomputed both ways (docs/metrics.md).

What: `routing_attribution(run, stream_a="rollout", recompute="rc", replay="rp")` compares the engine stream with
a recompute whose router chose the experts (``pgdiag logprobs --routing recompute``) and with one that replayed
the engine's experts (``--routing replay``), per step and over all steps. The mismatch the replay removes is the
part routing explains: ``routing/mismatch_share = 1 - abs_mean(replay) / abs_mean(recompute)`` of the token-level
mean |Δ|. The recompute stream's ``_routing.parquet`` adds ``routing/disagree_frac`` (tokens x MoE layers whose
top-k set differs from the recorded one).

Why a function of its own: `compare_runs` compares two streams; attribution needs three, and the routing counts
the recompute wrote, so it composes two comparisons instead of widening the parity table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from pgdiag.compare.api import compare_runs
from pgdiag.data.schema import ROUTING_FILE
from pgdiag.errors import Code, UsageError

ATTRIBUTION_COLUMNS = (
    "step",
    "abs_mean_recompute",
    "abs_mean_replay",
    "routing/mismatch_share",
    "routing/disagree_frac",
)


def routing_attribution(run: Any, *, stream_a: str, recompute: str, replay: str) -> pl.DataFrame:
    """Rows "all" then one per step: token-level mean |Δ| of `recompute` and `replay` against `stream_a`, the
    share of it routing explains, and the recompute's routing/disagree_frac (null when it recorded none)."""
    from pgdiag.data.runs import read_run

    source = read_run(run) if isinstance(run, (str, Path)) else run
    reports = [
        compare_runs(source, stream_a=stream_a, stream_b=stream, by=["step"]).report
        for stream in (recompute, replay)
    ]
    cells = [_abs_means(report) for report in reports]
    disagree = _disagree(source, recompute)
    rows = []
    for step in cells[0]:
        rc, rp = cells[0][step], cells[1].get(step)
        share = None if rc is None or rp is None or rc == 0 else 1.0 - rp / rc
        rows.append((step, rc, rp, share, disagree.get(step)))
    return pl.DataFrame(rows, schema=list(ATTRIBUTION_COLUMNS), orient="row")


def _abs_means(report: Any) -> dict[str, float | None]:
    """{"all": value, "<step>": value, ...} of the token-scope mismatch/abs_mean."""
    frame = report.summary.filter(
        (pl.col("metric") == "mismatch/abs_mean")
        & (pl.col("scope") == "token")
        & pl.col("breakdown").is_in(["all", "step"])
    )
    return {bucket: value for bucket, value in zip(frame["bucket"], frame["value"], strict=True)}


def _disagree(run: Any, tag: str) -> dict[str, float]:
    """Token-weighted disagree fraction over layers, per step and "all", from the stream's _routing.parquet."""
    if run.root is None:
        return {}
    path = Path(run.root) / "logprobs" / tag / ROUTING_FILE
    if not path.is_file():
        if not (Path(run.root) / "logprobs" / tag).is_dir():
            raise UsageError(
                Code.STREAM_NOT_FOUND, f"{run.root}: no recompute stream {tag!r} under logprobs/"
            )
        return {}
    table = pl.read_parquet(path)
    per_step = table.group_by("step").agg(pl.col("disagree").sum() / pl.col("tokens").sum()).sort("step")
    out = {str(step): float(frac) for step, frac in per_step.iter_rows()}
    out["all"] = float(table["disagree"].sum() / max(int(table["tokens"].sum()), 1))
    return out
