"""Issue 22: what a new user met, and the malformed inputs a hostile user found, each a test.

Every test here failed on main at fefc33e (an exit 101, a traceback, a wrapped or multi-line message, a silently
accepted invalid input, a file written where none was asked for, or a missing hint).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from clean_error import error_code, files_under, run_cli
from rollout_factory import valid_rows, write_rollouts_file
from sample_paths import SAMPLE_DATA

import pgdiag
from pgdiag.errors import PgdiagError, UsageError

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_RUN, SAMPLE_RUN_B = SAMPLE_DATA / "run_a", SAMPLE_DATA / "run_b"


def test_error_messages_and_hints_of_the_api_are_one_line() -> None:
    error = UsageError("E501", "nothing matched run\nb", "pass\r\nanother")
    assert (error.message, error.hint) == ("nothing matched run\\nb", "pass\\r\\nanother")
    assert "\n" not in str(error)


def test_an_id_holding_a_newline_stays_one_line_in_check_findings(tmp_path: Path) -> None:
    rows = valid_rows()
    rows[0]["sample_id"] = "a\nb"
    rows[0]["old_logprobs"][2] = float("nan")
    result = pgdiag.check_run(pgdiag.read_run(write_rollouts_file(tmp_path / "run.parquet", rows)))
    assert result.issues["code"].to_list() == ["E207"]
    assert "sample a\\nb, pos 2" in result.issues["message"][0]


def test_check_run_refuses_another_type_for_other(tmp_path: Path) -> None:
    run = pgdiag.read_run(write_rollouts_file(tmp_path / "run.parquet", valid_rows()))
    with pytest.raises(PgdiagError) as raised:
        pgdiag.check_run(run, other="str")  # a path that matches nothing (was AttributeError: no .streams)
    assert raised.value.code == "E501"
    with pytest.raises(PgdiagError) as raised:
        pgdiag.check_run(run, other=5)
    assert raised.value.code == "E513" and "int" in raised.value.message
    assert pgdiag.check_run(run, other=str(tmp_path / "run.parquet")).exit_code == 0  # a path is read


def test_a_data_column_named_like_the_readers_file_column_is_ignored(tmp_path: Path) -> None:
    # `__file` collided with the reader's own file-path column: exit 101 from every command, a traceback from the API
    rows = valid_rows()
    for row in rows:
        row["__file"] = "mine"
    rows[0]["old_logprobs"][2] = float("nan")
    run = write_rollouts_file(tmp_path / "run.parquet", rows)
    result = pgdiag.check_run(pgdiag.read_run(run))
    assert result.issues["code"].to_list() == ["E207"]
    assert result.issues["message"][0].startswith(
        f"{run}: old_logprobs"
    )  # the real file, not the column's text
    for args in (["check"], ["metrics", "--new", "old", "--old", "rollout"], ["compare", run], ["whatif"]):
        cli = run_cli([args[0], run, *args[1:]])
        assert error_code(cli, check=args[0] == "check") == "E207"


def test_steps_absent_from_the_run_list_the_steps_present() -> None:
    result = run_cli(["metrics", SAMPLE_RUN, "--steps", "1,9"])
    assert result.exit_code == 2 and error_code(result) == "E503", result.output
    assert result.output.splitlines()[-1] == "hint: steps present: 0-3"


def test_an_unknown_gate_metric_suggests_the_closest_key_of_the_report() -> None:
    # a compare report has no policy/ keys: the stat's closest key is suggested (no hint before)
    result = run_cli(["compare", SAMPLE_RUN, SAMPLE_RUN_B, "--fail-on", "policy/kl_k33>1"])
    assert error_code(result) == "E110"
    assert result.output.splitlines()[-1] == "hint: did you mean 'mismatch/kl_k3'?"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--identity-tol", "-1", "--identity-tol must be a number >= 0, got -1.0"),
        ("--zero-std-atol", "-0.5", "--zero-std-atol must be a number >= 0, got -0.5"),
    ],
)
def test_negative_tolerances_are_usage_errors(option: str, value: str, message: str) -> None:
    result = run_cli(["metrics", SAMPLE_RUN, "--identity", option, value])  # --identity-tol -1 exited 1
    assert error_code(result) == "E503"
    assert result.output.splitlines()[0] == f"error[E503] {message}"
    with pytest.raises(UsageError):
        pgdiag.MetricSettings(**{option[2:].replace("-", "_"): float(value)})


@pytest.mark.parametrize(
    ("option", "value"), [("--temperature", "-1"), ("--top-p", "0"), ("--min-p", "2"), ("--top-k", "-2")]
)
def test_import_sampling_values_outside_their_range_are_refused(
    tmp_path: Path, option: str, value: str
) -> None:
    result = run_cli(["import", "--preset", "canonical", SAMPLE_RUN, tmp_path / "out", option, value])
    assert error_code(result) == "E503" and option in result.output
    assert files_under(tmp_path / "out") == set()


def _check_codes(tmp_path: Path, rows: list[dict], **raw: object) -> list[str]:
    run = write_rollouts_file(tmp_path / "run.parquet", rows, **raw)
    result = run_cli(["check", run])
    assert result.exit_code == 3, result.output
    return pgdiag.check_run(pgdiag.read_run(run)).issues["code"].to_list()


def test_ragged_per_token_policy_version_is_e201(tmp_path: Path) -> None:
    import polars as pl

    rows = valid_rows()
    for row in rows:
        row["policy_version_tok"] = [3] * len(row["input_ids"])
    rows[1]["policy_version_tok"] = [3, 3]  # 4 tokens
    codes = _check_codes(tmp_path, rows, raw_types={"policy_version_tok": pl.List(pl.Int64)})
    assert codes == ["E201"]


def test_temperature_tok_of_the_wrong_length_is_e201(tmp_path: Path) -> None:
    rows = valid_rows()
    for row in rows:
        row["temperature_tok"] = [0.7] * len(row["input_ids"])
    rows[2]["temperature_tok"] = [0.7] * 7  # 6 tokens
    assert _check_codes(tmp_path, rows) == ["E201"]


def test_nan_temperature_is_e207(tmp_path: Path) -> None:
    rows = valid_rows()
    for row in rows:
        row["temperature"] = 0.7
        row["temperature_tok"] = [0.7] * len(row["input_ids"])
    rows[3]["temperature"] = float("nan")
    rows[0]["temperature_tok"][0] = float("inf")  # a prompt position: metadata is checked everywhere
    result = pgdiag.check_run(pgdiag.read_run(write_rollouts_file(tmp_path / "run.parquet", rows)))
    messages = dict(zip(result.issues["message"].to_list(), result.issues["code"].to_list(), strict=True))
    assert sorted(messages.values()) == ["E207", "E207"], messages
    assert any("temperature: NaN or inf" in m and "step 1, sample 1:1" in m for m in messages), messages
    assert any("temperature_tok: NaN or inf" in m and "sample 0:0, pos 0" in m for m in messages), messages


def test_a_run_without_any_log_prob_stream_fails_check(tmp_path: Path) -> None:
    rows = valid_rows()
    for row in rows:
        del row["old_logprobs"], row["rollout_logprobs"]
    assert _check_codes(tmp_path, rows) == ["E102"]


def test_plot_of_a_report_with_zero_rows_is_e511(tmp_path: Path) -> None:
    from dataclasses import replace

    out = tmp_path / "cmp"
    assert run_cli(["compare", SAMPLE_RUN, SAMPLE_RUN_B, "--out", out]).exit_code == 0
    report = pgdiag.load_report(out)
    replace(report, summary=report.summary.head(0)).write(tmp_path / "empty", overwrite=True)
    result = run_cli(
        ["plot", tmp_path / "empty", "--out", tmp_path / "figs"]
    )  # exit 0, nothing drawn, before
    assert error_code(result) == "E511"
    assert files_under(tmp_path / "figs") == set()


def test_plot_html_writes_only_the_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "cmp"
    assert run_cli(["compare", SAMPLE_RUN, SAMPLE_RUN_B, "--out", out]).exit_code == 0
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the second run failed: ./plots/ held the PNGs of the first (E502)
        page = tmp_path / "page.html"
        page.unlink(missing_ok=True)
        result = run_cli(["plot", out, "--html", page])
        assert result.exit_code == 0, result.output
        assert page.stat().st_size > 10_000 and "data:image/png;base64," in page.read_text()
        assert not (tmp_path / "plots").exists()
    result = run_cli(["plot", out, "--html", tmp_path / "p2.html", "--out", tmp_path / "figs"])
    assert result.exit_code == 0 and (tmp_path / "figs" / "by-step.png").is_file(), result.output


def test_garbage_tokenizer_json_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    for text in ("garbage{", '{"a": 1}'):
        bad.write_text(text)
        for given in (bad, tmp_path):
            result = run_cli(["compare", SAMPLE_RUN, SAMPLE_RUN_B, "--tokenizer", given])  # exit 101 before
            assert error_code(result) == "E112"
            assert "not a tokenizers tokenizer.json" in result.output


def test_trls_own_completion_table_is_e702_from_its_output_dir(tmp_path: Path) -> None:
    # TRL 1.16.0 GRPOTrainer.log (grpo_trainer.py): with log_completions, pandas.DataFrame(table).to_parquet(
    # f"{output_dir}/completions/completions_{global_step:05d}.parquet"); table = step, prompt, completion, the
    # reward functions' columns and advantage: text, no token ids. The output_dir was E703 (no hook file).
    import pandas as pd

    output_dir = tmp_path / "grpo_out"
    (output_dir / "completions").mkdir(parents=True)
    (output_dir / "checkpoint-10").mkdir()
    table = {
        "step": [10, 10],
        "prompt": ["What is 2+2?", "Name a prime."],
        "completion": ["4", "7"],
        "accuracy_reward": [1.0, 1.0],
        "advantage": [0.0, 0.0],
    }
    pd.DataFrame(table).to_parquet(output_dir / "completions" / "completions_00010.parquet")
    for src in (
        output_dir,
        output_dir / "completions",
        output_dir / "completions" / "completions_00010.parquet",
    ):
        result = run_cli(["import", "--preset", "trl", src, tmp_path / "out"])
        assert error_code(result) == "E702", result.output
        assert "TRL's completion table holds text" in result.output and "pgdiag.capture.trl" in result.output
        assert files_under(tmp_path / "out") == set()


def test_csv_input_names_write_run(tmp_path: Path) -> None:
    import polars as pl

    frame = pl.DataFrame({"step": [0], "sample_id": ["a"], "reward": [1.0]})
    for name in ("rollouts.csv", "rollouts.parquet"):  # a CSV under a Parquet name too
        path = tmp_path / name
        frame.write_csv(path)
        for args in (["check", path], ["import", "--preset", "canonical", path, tmp_path / "out"]):
            result = run_cli(args)  # was E101 "not a readable Parquet file" / E703 "truncated?"
            assert error_code(result, check=True) == "E101", result.output
            assert "a CSV file, not Parquet" in result.output and "pgdiag.write_run(df, OUT)" in result.output
        with pytest.raises(PgdiagError, match="a CSV file"):
            pgdiag.read_run(path)


def test_canonical_import_warns_on_unread_float_lists(tmp_path: Path) -> None:
    import polars as pl

    frame = pl.read_parquet(SAMPLE_RUN / "rollouts").rename({"old_logprobs": "old_log_probs"})
    frame.write_parquet(tmp_path / "mine.parquet")
    result = run_cli(["import", "--preset", "canonical", tmp_path / "mine.parquet", tmp_path / "out"])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.output.splitlines() if line.startswith("warning[W704]")]
    assert warned == [
        "warning[W704] old_log_probs: per-token floats of no canonical name, kept but read as no stream; if they "
        "are log-probs, pass --map old_log_probs=old_logprobs (docs/schema.md)"
    ]  # once, not once per step
    assert pgdiag.read_run(tmp_path / "out").streams == ("rollout", "new")
    again = run_cli(
        [
            "import",
            "--preset",
            "canonical",
            tmp_path / "mine.parquet",
            tmp_path / "out2",
            "--map",
            "old_log_probs=old_logprobs",
        ]
    )
    assert again.exit_code == 0 and "W704" not in again.output
    assert pgdiag.read_run(tmp_path / "out2").streams == ("rollout", "old", "new")


def test_report_prints_a_scope_column_and_the_verdict(tmp_path: Path) -> None:
    import json

    out = tmp_path / "cmp"
    assert run_cli(["compare", SAMPLE_RUN, SAMPLE_RUN_B, "--out", out, "--by", "step"]).exit_code == 0
    saved = pgdiag.load_report(out).meta["verdict"]["line"]
    result = run_cli(["report", out])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "metric" in line and "pair" in line)
    assert header.split()[1:6] == ["pair", "┃", "scope", "┃", "bucket"], header
    assert (
        result.output.rstrip("\n").split("\n")[-1] == saved
    )  # the verdict the compare stored, derived again
    failed = run_cli(["report", out, "--fail-on", "abs_mean>1e-9", "--json"])
    assert failed.exit_code == 1
    assert failed.output.rstrip("\n").split("\n")[-2].startswith("compare: DISAGREE (1 gates)")
    assert json.loads(failed.output.rstrip("\n").split("\n")[-1])["verdict"]["status"] == "DISAGREE"
