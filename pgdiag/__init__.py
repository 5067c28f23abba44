"""pgdiag: offline log-prob diagnostics for reinforcement-learning training of LLMs.

The Python API that the CLI and notebooks use::

    import pgdiag
    run = pgdiag.read_run("sample_data/run_a")
    pgdiag.check_run(run).issues                       # validation and alignment verdict
    report = pgdiag.compute_metrics(run, aggregation="constant", divisor=40960)
    report.wide()                                      # polars DataFrame, one column per metric
    pgdiag.compare_runs(run, pgdiag.read_run("sample_data/run_b")).report.summary
    pgdiag.write_run(df, "runs/mine")                   # your own rollouts (a polars DataFrame) as a run

Names are resolved lazily (PEP 562), so ``import pgdiag`` is cheap and imports neither torch nor polars
until a function that needs them is used; ``import pgdiag.kernels`` works with torch alone.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "PgdiagError": "pgdiag.errors",
    "UsageError": "pgdiag.errors",
    "InvalidInputError": "pgdiag.errors",
    "read_run": "pgdiag.data.runs",
    "Run": "pgdiag.data.runs",
    "read_token_batch": "pgdiag.data.load",
    "check_run": "pgdiag.checks.run",
    "CheckResult": "pgdiag.data.validate",
    "TokenBatch": "pgdiag.data.batch",
    "compute_metrics": "pgdiag.metrics.api",
    "MetricSettings": "pgdiag.metrics.settings",
    "ClipBand": "pgdiag.metrics.settings",
    "StyleOptions": "pgdiag.metrics.settings",
    "CompareSettings": "pgdiag.compare.settings",
    "CheckSettings": "pgdiag.data.validate",
    "Comparison": "pgdiag.compare.pair_report",
    "Report": "pgdiag.report.report",
    "load_report": "pgdiag.report.report",
    "evaluate_gates": "pgdiag.report.gates",
    "Verdict": "pgdiag.report.verdict",
    "metrics_verdict": "pgdiag.report.verdict",
    "compare_verdict": "pgdiag.report.verdict",
    "check_verdict": "pgdiag.report.verdict",
    "whatif_verdict": "pgdiag.report.verdict",
    "drift_verdict": "pgdiag.report.verdict",
    "report_verdict": "pgdiag.report.verdict",
    "GateResult": "pgdiag.report.gates",
    "GateSettings": "pgdiag.report.gates",
    "Outcome": "pgdiag.report.gates",
    "outcome": "pgdiag.report.gates",
    "compare_runs": "pgdiag.compare.api",
    "recompute_logprobs": "pgdiag.recompute.jobs",
    "RecomputeResult": "pgdiag.recompute.logprobs",
    "RecomputeSettings": "pgdiag.recompute.settings",
    "load_model": "pgdiag.model",
    "lm_head_logprobs": "pgdiag.kernels",
    "TokenLogprobs": "pgdiag.kernels",
    "import_run": "pgdiag.importers.api",
    "write_run": "pgdiag.importers.api",
    "ImportResult": "pgdiag.importers.writer",
    "ImportOptions": "pgdiag.importers.base",
    "plot_hexbin": "pgdiag.report.plots",
    "plot_dlogp_hist": "pgdiag.report.plots",
    "plot_by_prob": "pgdiag.report.plots",
    "plot_by_position": "pgdiag.report.plots",
    "plot_by_step": "pgdiag.report.plots",
    "plot_worst_trace": "pgdiag.report.plots",
    "plot_dlogp_vs_logprob": "pgdiag.report.plots",
    "plot_trend": "pgdiag.report.plots",
    "build_figures": "pgdiag.report.plots",
    "render_html": "pgdiag.report.html",
    "write_html": "pgdiag.report.html",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pgdiag' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
