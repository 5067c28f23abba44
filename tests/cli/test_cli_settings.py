"""Every option of `pgdiag metrics` and `pgdiag compare` reaches the library: the library calls are patched and
the settings objects they receive are compared with objects built by hand from the same non-default values.

A new option that is not listed here fails `test_every_option_is_accounted_for`, so an option cannot be added
without a place in the settings (the way `--eps-low` once reached only half of `compare --metrics`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.compare.settings import CompareSettings
from pgdiag.data.validate import CheckSettings
from pgdiag.errors import UsageError
from pgdiag.metrics.settings import ClipBand, MetricSettings, StyleOptions

TOKENIZER = SAMPLE_DATA / "tiny-qwen" / "tokenizer.json"  # read first
READ_OPTIONS = {"steps", "run_name", "label", "attach", "label_a", "label_b"}  # read_run's arguments
GATE_OPTIONS = {"fail_on", "warn_on", "profile", "strict", "exit_zero"}  # GateSettings
RENDER_OPTIONS = {
    "json_out",
    "out",
    "overwrite",
    "all_steps",
    "show_all",
    "list_metrics",
    "quiet",
    "verbose",
    "tokens_out",
    "html",
    "to_tensorboard",  # report/export.py: the report's per-step rows, tests/report/test_export.py
    "to_wandb",  # the same rows as a W&B run, also tests/report/test_export.py
    "wandb_dir",
}


class _Stop(UsageError):
    def __init__(self) -> None:
        super().__init__("E503", "stopped by the test")  # a catalogued code: pgdiag refuses any other


def _capture(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake(*args: Any, **kwargs: Any) -> Any:
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Stop

    monkeypatch.setattr(f"{module}.{name}", fake)
    return seen


def _capture_reads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    reads: list[dict[str, Any]] = []

    def fake_read_run(path: Any, **kwargs: Any) -> str:
        reads.append({"path": str(path), **kwargs})
        return f"run:{path}"

    monkeypatch.setattr("pgdiag.data.runs.read_run", fake_read_run)
    return reads


def _params(command: str) -> set[str]:
    group = typer.main.get_command(build_app())
    return {p.name for p in group.commands[command].params if p.name}  # type: ignore[attr-defined]


def _invoke(*args: str) -> None:
    result = CliRunner().invoke(build_app(), [str(a) for a in args])
    assert result.exit_code == 2 and "error[E503] stopped by the test" in result.stderr, result.stderr


METRIC_ARGS = (
    "metrics", "RUN", "--steps", "1-2", "--run", "trainer", "--label", "L", "--attach", "extra",
    "--new", "n", "--old", "o", "--stream-a", "sa", "--stream-b", "sb", "--ref", "r", "--entropy", "e",
    "--aggregation", "constant", "--divisor", "7", "--grad-divisor", "3", "--eps-low", "0.1",
    "--eps-high", "0.3", "--dual-clip", "4", "--level", "sequence", "--empty-seqs", "skip",
    "--metric-reduction", "sample", "--docs-per-step", "2", "--zero-std-atol", "0.01", "--identity",
    "--identity-tol", "0.5", "--ignore", "W217", "--max-examples", "9", "--by", "lag",
)  # fmt: skip

STYLE_ARGS = (
    "--loss-name", "x", "--rollout-is", "token", "--rollout-is-threshold", "1.5", "--beta", "0.1",
    "--no-vllm-is", "--no-kl-bias-correction", "--pad-width", "12", "--tis", "--batch-size", "6", "--group-normalize", "--kl-coef", "0.2",
)  # fmt: skip


def test_every_option_is_accounted_for() -> None:
    metric_fields = {f for f in MetricSettings().to_dict()} | {"no_vllm_is", "no_kl_bias_correction"}
    check_fields = {"ignore", "max_examples"}
    metrics_known = metric_fields | check_fields | READ_OPTIONS | GATE_OPTIONS | RENDER_OPTIONS | {"run"}
    metrics_known |= {"losses"}  # LossParitySettings', tests/analysis/test_loss_fold.py
    assert _params("metrics") - metrics_known == set()
    compare_fields = {
        "stream_a", "stream_b", "join", "by", "worst_k", "eps_low", "eps_high", "model", "tokenizer",
        "side_by_side", "aggregation", "divisor", "key_style", "routing_replay", "exact",
    }  # fmt: skip
    compare_known = compare_fields | check_fields | READ_OPTIONS | GATE_OPTIONS | RENDER_OPTIONS
    compare_known |= {"routing_replay"}  # routing_attribution's, tests/recompute/test_routing_replay.py
    compare_known |= {"baseline"}  # compare_many's, tests/compare/test_nway.py
    compare_known |= {"losses"}  # LossParitySettings', tests/analysis/test_loss_fold.py
    assert _params("compare") - compare_known - {"run_a", "run_b"} == set()


def test_metrics_options_arrive_in_metric_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture(monkeypatch, "pgdiag.metrics.api", "compute_metrics")
    reads = _capture_reads(monkeypatch)
    _invoke(*METRIC_ARGS)
    assert reads == [
        {"path": "RUN", "label": "L", "attach": (Path("extra"),), "steps": "1-2", "run": "trainer"}
    ]
    assert seen["args"] == ("run:RUN", MetricSettings(
        new="n", old="o", stream_a="sa", stream_b="sb", ref="r", entropy="e", aggregation="constant",
        divisor=7.0, grad_divisor=3.0, clip=ClipBand(eps_low=0.1, eps_high=0.3, dual_clip=4.0), level="sequence",
        empty_seqs="skip", metric_reduction="sample", docs_per_step=2, key_style="pgdiag", zero_std_atol=0.01,
        identity=True, identity_tol=0.5, by=("lag",),
    ))  # fmt: skip
    checks = CheckSettings(ignore=("W217",), max_examples=9)
    assert seen["kwargs"] == {"checks": checks, "progress": None, "accumulators": []}  # no --losses


def test_style_options_arrive_in_style_options(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture(monkeypatch, "pgdiag.metrics.api", "compute_metrics")
    _capture_reads(monkeypatch)
    style = StyleOptions(
        loss_name="x", rollout_is="token", rollout_is_threshold=1.5, beta=0.1, vllm_is=False, pad_width=12,
        kl_bias_correction=False, tis=True, batch_size=6, group_normalize=True, kl_coef=0.2,
    )  # fmt: skip
    _invoke("metrics", "RUN", *STYLE_ARGS)
    assert seen["args"][1] == MetricSettings(style=style)


def test_metrics_defaults_are_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture(monkeypatch, "pgdiag.metrics.api", "compute_metrics")
    _capture_reads(monkeypatch)
    _invoke("metrics", "RUN")
    assert seen["args"][1] == MetricSettings()
    assert seen["kwargs"] == {
        "checks": CheckSettings(),
        "progress": None,
        "accumulators": [],
    }  # no bar off a tty


COMPARE_ARGS = (
    "compare", "A", "B", "--steps", "3", "--run", "trainer", "--label-a", "LA", "--label-b", "LB",
    "--attach", "extra", "--stream-a", "old", "--stream-b", "new", "--join", "hash", "--ignore", "E306",
    "--max-examples", "2", "--eps-low", "0.05", "--eps-high", "0.07", "--by", "step", "--by", "position",
    "--metrics", "--aggregation", "constant", "--divisor", "9", "--key-style", "verl", "--model", "ckpt",
    "--tokenizer", str(TOKENIZER), "--worst-k", "4", "--exact",
)  # fmt: skip


def test_compare_options_arrive_in_compare_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture(monkeypatch, "pgdiag.compare.api", "compare_runs")
    reads = _capture_reads(monkeypatch)
    _invoke(*COMPARE_ARGS)
    assert reads == [
        {"path": "A", "attach": (Path("extra"),), "steps": "3", "run": "trainer"},
        {"path": "B", "steps": "3", "run": "trainer"},
    ]
    clip = ClipBand(eps_low=0.05, eps_high=0.07)
    assert seen["args"] == ("run:A", "run:B", CompareSettings(
        stream_a="old", stream_b="new", join="hash", by=("step", "position"), worst_k=4, clip=clip,
        label_a="LA", label_b="LB",
        metrics=MetricSettings(aggregation="constant", divisor=9.0, key_style="verl", clip=clip),
        checks=CheckSettings(ignore=("E306",), max_examples=2), model=Path("ckpt"), tokenizer=TOKENIZER,
        exact=True,
    ))  # fmt: skip
    assert seen["args"][2].checks.ignore == ("E306", "E207")  # --exact compares NaN and inf
    assert seen["args"][2].metrics.clip == clip  # the side-by-side metrics use the same band


def test_compare_defaults_are_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture(monkeypatch, "pgdiag.compare.api", "compare_runs")
    _capture_reads(monkeypatch)
    _invoke("compare", "A")
    assert seen["args"] == ("run:A", None, CompareSettings())


GATE_ARGS = (
    "--fail-on", "k3>1", "--fail-on", "mismatch/abs_mean>2", "--warn-on", "tmpe>3", "--profile", "nemo",
    "--strict", "--exit-zero",
)  # fmt: skip


@pytest.mark.parametrize("command", ["metrics", "compare"])
def test_gate_options_arrive_in_gate_settings(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    from pgdiag.report.gates import GateSettings
    from pgdiag.report.report import Report, summary_frame

    report = Report(command, summary_frame([]))
    if command == "metrics":
        monkeypatch.setattr("pgdiag.metrics.api.compute_metrics", lambda *a, **k: report)
    else:
        monkeypatch.setattr(
            "pgdiag.compare.api.compare_runs", lambda *a, **k: type("C", (), {"report": report})
        )
    _capture_reads(monkeypatch)
    seen = _capture(monkeypatch, "pgdiag.report.gates", "outcome")
    _invoke(command, "RUN", *GATE_ARGS)
    expected = GateSettings(
        fail_on=("k3>1", "mismatch/abs_mean>2"),
        warn_on=("tmpe>3",),
        profile="nemo",
        strict=True,
        exit_zero=True,
    )
    assert seen["args"] == (report, expected)
    _invoke(command, "RUN")
    assert seen["args"] == (report, GateSettings())


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--kl-coef", "-1"), ("--beta", "-0.04"), ("--rollout-is-threshold", "0"), ("--kl-coef", "nan")],
)
def test_style_coefficients_no_framework_runs_with_are_e503(flag: str, value: str) -> None:
    """A negative KL coefficient (a reward for leaving the reference) or a TIS threshold <= 0 is refused by
    StyleOptions before any data is read: exit 2, E503 naming the flag."""
    result = CliRunner().invoke(
        build_app(), ["metrics", str(SAMPLE_DATA / "run_a"), "--key-style", "pipelinerl", flag, value]
    )
    assert result.exit_code == 2
    assert "E503" in result.output and f"{flag} must be a number" in result.output
    with pytest.raises(UsageError, match=flag):
        StyleOptions(**{flag[2:].replace("-", "_"): float(value)})
    assert StyleOptions(kl_coef=0.0, beta=0.0, rollout_is_threshold=2.0).kl_coef == 0.0
