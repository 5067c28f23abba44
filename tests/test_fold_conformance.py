"""Every stage that folds pieces (docs/reliability.md, "Folds") gives the same JSON from pieces of one step as
from the run read whole, through one harness.

The stages: check (one run, two runs), metrics (native and two framework key styles), compare (two runs, one
run's streams, N-way), drift and whatif (the default grid, with the run's `new` stream), each run on sample_data's runs (4 steps of 32 samples, one `step=N/` file per
step) once with a row budget of 1 (every step its own piece: the planner never joins steps of separate files)
and once with a budget larger than the run (one piece). Their result objects as JSON must agree: strings,
integers, keys and lengths exactly, floats within the golden tolerance (tests/golden/test_golden.py: sums
pooled in another order move by rounding).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from sample_paths import SAMPLE_DATA

from pgdiag.analysis.drift import drift
from pgdiag.analysis.settings import WhatifSettings, parse_rule
from pgdiag.analysis.whatif import whatif
from pgdiag.checks.run import RunChecks, check_run
from pgdiag.compare.api import compare_runs
from pgdiag.compare.nway import compare_many
from pgdiag.compare.settings import CompareSettings
from pgdiag.data.fold import Fold, fold
from pgdiag.data.load import read_token_batch
from pgdiag.data.pieces import plan_step_pieces
from pgdiag.data.runs import read_run, restrict_steps
from pgdiag.metrics.api import StreamSettings, compute_metrics, metric_streams, resolve_streams
from pgdiag.metrics.engine import NativeStream
from pgdiag.metrics.pooled import QuantileSettings
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.styles.steps import StyleStream

ONE_STEP, WHOLE = 1, 10**9
RUN_A, RUN_B = SAMPLE_DATA / "run_a", SAMPLE_DATA / "run_b"


def _report_json(report: Any) -> Any:
    """The report's JSON without `meta` (it says how many pieces were read), with its worst-K tables."""
    found = {k: v for k, v in report.to_json_dict().items() if k != "meta"}
    for name in ("worst_tokens", "worst_seqs"):
        table = getattr(report, name)
        found[name] = None if table is None else table.to_dicts()
    return json.loads(json.dumps(found, default=str))


def _check(rows: int, two: bool) -> Any:
    other = read_run(RUN_B) if two else None
    result = check_run(read_run(RUN_A), other, chunk_rows=rows)
    return {"issues": result.issues.to_dicts(), "hints": list(result.hints), "exit": result.exit_code}


def _metrics(rows: int, style: str) -> Any:
    settings = MetricSettings(key_style=style) if style != "pgdiag" else MetricSettings()
    report = compute_metrics(read_run(RUN_A), settings, stream=StreamSettings(max_rows=rows))
    assert report.meta["chunks"] == (4 if rows == ONE_STEP else 1)  # really read in pieces
    return _report_json(report) | {"steps": report.meta.get("steps")}


def _compare(rows: int, mode: str) -> Any:
    settings = CompareSettings(chunk_rows=rows)
    if mode == "nway":
        many = compare_many([read_run(RUN_A), read_run(RUN_B), read_run(RUN_A)], settings)
        assert all((c.pair is None) == (rows == ONE_STEP) for c in many.comparisons)
        return [_report_json(c.report) for c in many.comparisons] + [many.matrix.to_dicts()]
    b = read_run(RUN_B) if mode == "two" else None
    comparison = compare_runs(read_run(RUN_A), b, settings)
    assert (comparison.pair is None) == (rows == ONE_STEP)  # a comparison read in pieces keeps no token pair
    return _report_json(comparison.report) | {"trace": comparison.worst_trace.to_dicts()}


def _drift(rows: int) -> Any:
    report = drift(read_run(RUN_A), stream=StreamSettings(max_rows=rows))
    return _report_json(report)


def _whatif(rows: int, settings: WhatifSettings | None = None) -> Any:
    report = whatif(read_run(RUN_A), settings, max_rows=rows)
    assert report.meta["pieces"] == (4 if rows == ONE_STEP else 1)  # really read in pieces
    assert settings is None or report.summary["breakdown"].is_in(["losses", "losses/step"]).sum() == 4 * 5
    return _report_json(report) | {"settings": report.meta["settings"], "inputs": report.meta["inputs"]}


STAGES: dict[str, Callable[[int], Any]] = {
    "check": lambda rows: _check(rows, two=False),
    "check-two-runs": lambda rows: _check(rows, two=True),
    "metrics": lambda rows: _metrics(rows, "pgdiag"),
    "metrics-verl": lambda rows: _metrics(rows, "verl"),
    "metrics-fast-llm": lambda rows: _metrics(rows, "fast-llm"),
    "compare-two-runs": lambda rows: _compare(rows, "two"),
    "compare-one-run": lambda rows: _compare(rows, "one"),
    "compare-nway": lambda rows: _compare(rows, "nway"),
    "drift": _drift,
    "whatif": _whatif,
    "whatif-losses-m2po-mb": lambda rows: _whatif(
        rows,
        WhatifSettings(
            rules=tuple(
                parse_rule(r)
                for r in ("m2po:0.04,scope=mb:2", "seq_tis_bn:2", "token_tis_bn:2", "cispo:0.2,0.28")
            ),
            losses="cispo:0.2,0.28@token_mean,vanilla@prompt_mean",
        ),
    ),
}


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return [] if math.isnan(a) and math.isnan(b) else [f"{where}: {a} != {b}"]
        return [] if abs(a - b) <= 1e-9 * max(abs(a), abs(b)) + 1e-12 else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_sample_runs_are_cut_into_one_piece_per_step() -> None:
    run_a, run_b = read_run(RUN_A), read_run(RUN_B)
    assert [p.steps for p in plan_step_pieces([run_a, run_b], ONE_STEP).pieces] == [(0,), (1,), (2,), (3,)]
    assert [p.steps for p in plan_step_pieces([run_a, run_b], WHOLE).pieces] == [None]


@pytest.mark.parametrize("stage", list(STAGES))
def test_pieces_of_one_step_give_the_whole_run_json(stage: str) -> None:
    whole, pieces = STAGES[stage](WHOLE), STAGES[stage](ONE_STEP)
    found = _differences(whole, pieces)
    assert not found, f"{len(found)} differences, first: " + "; ".join(found[:10])


def test_the_metric_engines_are_folds() -> None:
    """The native engine fed the pieces of one step by `fold` gives the pooled `all` row compute_metrics reports."""
    run = read_run(RUN_A)
    settings = resolve_streams(run, MetricSettings())
    native = NativeStream(settings, QuantileSettings(), pooled=True)
    assert isinstance(native, Fold) and isinstance(StyleStream(MetricSettings(key_style="verl")), Fold)
    assert isinstance(RunChecks(run, list(run.streams)), Fold)
    batches = (
        read_token_batch(restrict_steps(run, p.steps), streams=metric_streams(settings)).batch
        for p in plan_step_pieces([run], ONE_STEP).pieces
    )
    label, pooled = fold(native, batches)
    report = compute_metrics(run, MetricSettings())
    assert label == "all"
    for key in ("mismatch/abs_mean", "policy/kl_k3", "loss/token_mean"):
        assert pooled.by_key()[key].value == pytest.approx(report.value(key), rel=1e-12), key
