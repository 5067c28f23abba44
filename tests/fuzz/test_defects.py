"""The ten worst defects of the reliability campaign (and the smaller ones listed with them), each a test.

Every test here failed before its fix: an exit 101, a traceback, a multi-line message, a silently accepted
invalid input or a half-written output. See docs/reliability.md.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from clean_error import error_code, files_under, run_cli
from rollout_factory import valid_rows, write_rollouts_file
from sample_paths import SAMPLE_DATA

from pgdiag.cli import run
from pgdiag.report.report import load_report

SAMPLE_RUN = SAMPLE_DATA / "run_a"


def long_samples(n_tokens: int, gap: float) -> list[dict]:
    """Two samples of `n_tokens` response tokens whose two streams differ by `gap` and 2·`gap` nats per token."""
    rows = []
    for s in range(2):
        rows.append(
            {
                "step": 0,
                "sample_id": f"s{s}",
                "group_id": "g",
                "input_ids": [5] * (n_tokens + 1),
                "prompt_len": 1,
                "loss_mask": [False] + [True] * n_tokens,
                "old_logprobs": [None] + [-0.1] * n_tokens,
                "rollout_logprobs": [None] + [-0.1 - gap * (s + 1)] * n_tokens,
                "advantages": [None] + [1.0] * n_tokens,
                "reward": 1.0,
            }
        )
    return rows


def test_summed_log_ratio_past_exp_range_is_inf_not_overflow(tmp_path: Path) -> None:
    # (1) 3,000 tokens 0.3 nats apart: Σd = 900 nats > 709.78, where math.exp overflowed (exit 101).
    run = write_rollouts_file(tmp_path / "run.parquet", long_samples(3000, 0.3))
    out = tmp_path / "out"
    result = run_cli(["metrics", run, "--new", "old", "--old", "rollout", "--out", out])
    assert result.exit_code == 0, result.output
    report = load_report(out)
    assert report.value("mismatch/seq_sum_delta_p99") is not None
    value = report.value("mismatch/seq_ratio_p99")
    assert value is not None and math.isinf(value) and value > 0


def test_footer_of_the_wrong_json_shape_is_e105(tmp_path: Path) -> None:
    # (10) valid JSON of the wrong shape: every command crashed with AttributeError on `.get` (exit 101).
    cases = {"streams": ["old"], "source": "x", "sampling": [0.7]}
    for key, value in cases.items():
        run = write_rollouts_file(tmp_path / f"{key}.parquet", valid_rows(), **{key: value})
        for command in (["check", run], ["metrics", run, "--new", "old", "--old", "rollout"]):
            result = run_cli(command)
            assert error_code(result) == "E105", result.output
            assert f"pgdiag.{key} is a" in result.output
    run = write_rollouts_file(tmp_path / "stream.parquet", valid_rows(), streams={"old": [1]})
    assert error_code(run_cli(["check", run])) == "E105"


def test_manifest_that_is_a_list_is_an_incomplete_recompute(tmp_path: Path) -> None:
    # (10) a recompute `_manifest.json` holding a JSON list crashed check/metrics/compare (exit 101).
    run = tmp_path / "run"
    shutil.copytree(SAMPLE_RUN, run)
    (run / "logprobs" / "t1").mkdir(parents=True)
    (run / "logprobs" / "t1" / "_manifest.json").write_text("[1, 2]", encoding="utf-8")
    before = files_under(run)
    result = run_cli(["check", run])  # read as an incomplete recompute: warned about, not read
    assert result.exit_code == 0 and "warning[W504]" in result.output, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    assert files_under(run) == before


def test_bad_command_line_is_one_error_line(capsys) -> None:
    # Typer printed a multi-line box for an unknown option or a bad choice; now one error line, exit 2.
    for args, code in (
        (["metrics", "run", "--bogus"], "E515"),
        (["metrics", str(SAMPLE_RUN), "--level", "zzz"], "E503"),
        (["compare"], "E515"),
    ):
        assert run(args) == 2
        err = capsys.readouterr()
        text = err.out + err.err
        lines = text.strip().splitlines()
        assert lines[0].startswith(f"error[{code}] "), text
        assert all(line.startswith("hint: ") for line in lines[1:]), text
        assert "╭" not in text


def test_newline_in_a_message_keeps_the_one_line_rule(tmp_path: Path) -> None:
    # a path (or id) holding a newline broke the one-line rule: it is written as a backslash and n.
    missing = tmp_path / "no\nsuch"
    result = run_cli(["check", missing])
    assert error_code(result) == "E501"
    assert "no\\nsuch" in result.output


def test_path_with_glob_characters_is_read_as_a_name(tmp_path: Path) -> None:
    # (6) polars expanded `run[1].parquet` as a pattern and read run1.parquet (another step) instead.
    rows = valid_rows()
    write_rollouts_file(tmp_path / "run[1].parquet", [r for r in rows if r["step"] == 0])
    write_rollouts_file(tmp_path / "run1.parquet", [r for r in rows if r["step"] == 1])
    result = run_cli(["metrics", tmp_path / "run[1].parquet", "--new", "old", "--old", "rollout", "--json"])
    assert result.exit_code == 0, result.output
    inputs = json.loads(result.output.strip().splitlines()[-1])["inputs"]
    assert inputs["steps"] == ["0"]


def test_unreadable_step_folder_is_e516_not_skipped(tmp_path: Path, monkeypatch) -> None:
    # (3) an unreadable step=N/ folder was skipped silently: every command exited 0 on part of the run.
    run = tmp_path / "run"
    shutil.copytree(SAMPLE_RUN, run)
    link = run / "rollouts" / "step=7"
    link.symlink_to(tmp_path / "nowhere")
    assert error_code(run_cli(["check", run])) == "E516"
    link.unlink()
    link.symlink_to(link.name)  # a loop
    assert error_code(run_cli(["check", run])) == "E516"
    link.unlink()
    assert run_cli(["check", run]).exit_code == 0
    # a folder the user may not list (root reads every folder, so the denial is simulated)
    real_scandir = os.scandir

    def denied(path="."):
        if str(path).endswith("step=2"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    result = run_cli(["metrics", run, "--new", "old", "--old", "rollout"])
    assert error_code(result) == "E516"
    assert "step=2: cannot be read (Permission denied)" in result.output
