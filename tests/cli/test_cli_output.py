"""What a user sees on the sample data: tables that fit 80 columns with no cut name, user strings never read as
markup or emoji, the verdict line last (and the same in --json and saved reports), outputs refused before any
work, the files written listed, plain flags and readable help."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from sample_paths import SAMPLE_DATA
from typer.testing import CliRunner

from pgdiag.cli.app import build_app

ROOT = Path(__file__).resolve().parents[2]
RUN_A, RUN_B = str(SAMPLE_DATA / "run_a"), str(SAMPLE_DATA / "run_b")
TINY = SAMPLE_DATA / "tiny-qwen"
ENV_80 = {"COLUMNS": "80", "NO_COLOR": "1", "TERMINAL_WIDTH": "80"}
TEXT_RECORD = re.compile(r"^(\w+: |\d+ of \d+ steps? not shown|(error|warning)\[|\s*hint: )")
METRIC_NAME = re.compile(r"^\s*([a-z_]+/[A-Za-z0-9_./]+)")


def invoke(*args: object, env: dict[str, str] | None = None):
    return CliRunner().invoke(build_app(), [str(a) for a in args], env=env or ENV_80)


def table_lines(lines: list[str]) -> list[str]:
    """The lines of the tables: a line of text (a note, a finding, a hint, the verdict) is one line however
    long off a terminal, so that `grep` and `tail -1` read it whole."""
    return [line for line in lines if not TEXT_RECORD.match(line)]


def _json(result) -> dict:
    return json.loads(result.stdout)


@pytest.mark.parametrize("extra", [(), ("--all",), ("--all-steps",), ("--key-style", "verl")])
def test_metrics_fits_80_columns_and_no_name_is_cut(extra: tuple[str, ...]) -> None:
    result = invoke("metrics", RUN_A, "--json", *extra)
    assert result.exit_code == 0, result.stderr
    known = {key for pair in _json(result)["summary"].values() for key in pair}
    lines = result.stderr.splitlines()
    assert lines[-1].startswith("metrics: ")  # the verdict, one line however long (never wrapped off a TTY)
    assert max(len(line) for line in table_lines(lines)) <= 80
    assert "…" not in result.stderr
    shown = [m.group(1) for line in lines if (m := METRIC_NAME.match(line)) and "/" in m.group(1)]
    table_rows = [name for name in shown if not name.startswith(("docs/", "run_a"))]
    assert len(table_rows) >= 20
    assert set(table_rows) <= known, set(table_rows) - known  # every name whole: a cut one is not a key
    if "--all" in extra or "--key-style" in extra:
        assert set(table_rows) == {k for k in known if "." not in k}  # every metric, none left out
    else:
        assert {"policy/ess_token", "policy/ratio_max", "loss/pg", "mismatch/kl_k3"} <= set(table_rows)


def test_metrics_says_which_steps_did_not_fit() -> None:
    narrow = invoke("metrics", RUN_A, env={**ENV_80, "COLUMNS": "70", "TERMINAL_WIDTH": "70"})
    assert narrow.exit_code == 0, narrow.stderr
    text = " ".join(narrow.stdout.split())  # the table is a result: stdout
    match = re.search(r"(\d) of 4 steps not shown at 70 columns", text)
    assert match, text
    hidden = int(match.group(1))
    header = next(line for line in narrow.stdout.splitlines() if line.lstrip().startswith("metric "))
    assert header.count("step ") == 4 - hidden
    assert "--json or --out show them" in text
    wide = invoke("metrics", RUN_A, env={**ENV_80, "COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert "steps not shown" not in wide.stdout


def test_metrics_verdict_names_each_anomaly_with_its_step(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = invoke("metrics", RUN_A, "--json", "--out", out)
    assert result.exit_code == 0, result.stderr
    last = " ".join(result.stderr.split()).rsplit("metrics: ", 1)[1]
    assert last.startswith("3 anomalies")
    assert "step 1: policy/ess_token 0.0146 < 0.1" in last
    assert "step 1: policy/ratio_max 275 > 10" in last
    assert "step 1: policy/kl_k3 jumps to 0.641" in last
    verdict = _json(result)["verdict"]
    assert verdict["status"] == "anomalies"
    kinds = {(f["kind"], f["step"]) for f in verdict["findings"]}
    assert kinds == {("ess_low", "1"), ("ratio_max", "1"), ("kl_jump", "1")}
    per_step = _json(result)["per_step"]
    assert per_step["1"]["policy/ess_token"] == pytest.approx(verdict["findings"][0]["value"])
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["verdict"] == verdict
    import pgdiag

    assert pgdiag.load_report(out).meta["verdict"] == verdict  # the report itself carries it


def test_compare_run_with_itself_keeps_labels_as_text_and_agrees() -> None:
    result = invoke("compare", RUN_A, RUN_A, "--json")
    assert result.exit_code == 0, result.stderr
    assert "run_a:a:new vs run_a:b:new" in result.stderr
    assert not re.search(r"[\U0001F100-\U0001FAFF]", result.stderr)  # no emoji anywhere
    lines = result.stderr.splitlines()
    assert max(len(line) for line in table_lines(lines)) <= 80 and "…" not in result.stderr
    from pgdiag.cli.compare_render import TABLE_STATS

    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["metric"])
    end = next(i for i in range(start + 2, len(lines)) if "│" not in lines[i])
    rows = [line.split()[0] for line in lines[start + 2 : end]]
    assert rows == [s for s in TABLE_STATS if s in rows] and len(rows) >= 20  # whole names, in order
    assert " ".join(lines[-3:]).split().count("compare:") == 1
    assert "compare: AGREE" in " ".join(result.stderr.split())
    assert _json(result)["verdict"]["status"] == "AGREE"


def test_user_strings_are_never_markup_or_emoji() -> None:
    result = invoke("compare", RUN_A, RUN_B, "--label-a", "[bold]x:new:", "--label-b", "y:cool:")
    assert result.exit_code == 0, result.stderr
    assert "[bold]x:new:" in result.stdout and "y:cool:" in result.stdout
    error = invoke("compare", RUN_A, "--stream-a", ":new:")
    assert error.exit_code == 2
    assert error.stderr.startswith("error[E111]") and "':new:'" in error.stderr
    assert "🆕" not in error.stderr


def test_compare_verdict_names_the_worst_statistic_and_where(tmp_path: Path) -> None:
    result = invoke("compare", RUN_A, RUN_B, "--json", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.stderr
    verdict = _json(result)["verdict"]
    summary = _json(result)["summary"]["run_a:new vs run_b:new"]
    line = verdict["line"]
    # the worst statistic relative to its threshold (recommended profile) is abs_mean here, 0.00567 < 0.02
    assert summary["mismatch/abs_mean"] / 0.02 > summary["mismatch/kl_k3"] / 1e-2
    # without a gate the recommended profile's 5 fail gates ran (docs/cli.md)
    assert line.startswith("compare: AGREE (5 gates passed): worst mismatch/abs_mean 0.00567")
    assert "position 1 " in line and "step 1 " in line and "token step 3 sample 3:3 pos 23" in line
    failing = invoke("compare", RUN_A, RUN_B, "--json", "--fail-on", "abs_mean>1e-3")
    assert failing.exit_code == 1
    assert _json(failing)["verdict"]["line"].startswith("compare: DISAGREE (1 gates): ")
    assert "abs_mean>1e-3" in _json(failing)["verdict"]["line"]
    markdown = (tmp_path / "p" / "compare.md").read_text()
    assert f"**{line}**" in markdown


def test_compare_lists_what_it_wrote_and_the_json_lists_the_same(tmp_path: Path) -> None:
    out = tmp_path / "parity"
    result = invoke(
        "compare", RUN_A, RUN_B, "--out", out, "--tokens-out", tmp_path / "tokens.parquet", "--json"
    )
    assert result.exit_code == 0, result.stderr
    files = _json(result)["files"]
    saved = json.loads((out / "compare.json").read_text())["files"]
    assert saved == files
    flat = [files[k] for k in files if k not in ("plots", "plots_skipped")] + list(files["plots"].values())
    assert len(flat) >= 12 and all(Path(p).is_file() for p in flat)
    assert {"report", "json", "worst_tokens", "worst_seqs", "worst_trace", "markdown", "tokens"} <= set(files)
    on_disk = {str(p) for p in out.rglob("*") if p.is_file()} | {str(tmp_path / "tokens.parquet")}
    assert set(flat) == on_disk  # every file written is listed, and only those
    for path in flat:
        assert path in result.stderr
    assert f"wrote {len(flat)} files:" in result.stderr


@pytest.mark.parametrize("command", ["metrics", "compare"])
def test_existing_output_is_refused_before_any_work(command: str, tmp_path: Path) -> None:
    args = (command, RUN_A) if command == "metrics" else (command, RUN_A, RUN_B)
    existing = tmp_path / f"{command}.parquet"
    existing.write_bytes(b"keep")
    result = invoke(*args, "--out", existing)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"error[E502] {existing} exists")
    assert "metric " not in result.stderr and "parity" not in result.stderr  # nothing computed or printed
    assert existing.read_bytes() == b"keep"
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out in (a_file, a_file / "sub"):
        result = invoke(*args, "--out", out)
        assert result.exit_code == 2 and result.stderr.startswith(
            f"error[E502] {a_file} is a file, not a directory"
        )
        assert "internal error" not in result.stderr


def test_plot_refuses_existing_figures_unless_overwrite(tmp_path: Path) -> None:
    report = tmp_path / "r"
    assert invoke("compare", RUN_A, RUN_B, "--out", report, "-q").exit_code == 0
    out = tmp_path / "figs"
    first = invoke("plot", report, "--kind", "by-prob", "--out", out, "--json")
    assert first.exit_code == 0, first.stderr
    assert _json(first)["files"] == {"plots": {"by-prob": str(out / "by-prob.png")}}
    assert str(out / "by-prob.png") in first.stderr
    before = (out / "by-prob.png").stat().st_mtime_ns
    again = invoke("plot", report, "--kind", "by-prob", "--out", out)
    assert again.exit_code == 2 and again.stderr.startswith(f"error[E502] {out / 'by-prob.png'} exists")
    assert (out / "by-prob.png").stat().st_mtime_ns == before
    forced = invoke("plot", report, "--kind", "by-prob", "--out", out, "--overwrite")
    assert forced.exit_code == 0 and (out / "by-prob.png").stat().st_mtime_ns > before
    (tmp_path / "f").write_text("x")
    blocked = invoke("plot", report, "--out", tmp_path / "f")
    assert blocked.exit_code == 2 and "is a file, not a directory" in blocked.stderr


def test_check_verdict_is_clean_or_the_first_problem(tmp_path: Path) -> None:
    clean = invoke("check", RUN_A, "--json")
    assert (
        clean.exit_code == 0 and clean.stderr.strip().splitlines()[-1] == "check: clean"
    )  # --json: stdout is the JSON alone
    assert _json(clean)["verdict"] == {
        "command": "check",
        "status": "clean",
        "line": "check: clean",
        "findings": [],
    }


def test_flags_are_plain_switches_and_help_paragraphs_are_not_broken() -> None:
    app = build_app()
    wide = {"COLUMNS": "200", "NO_COLOR": "1", "TERMINAL_WIDTH": "200"}
    for name in ("check", "metrics", "compare", "plot", "logprobs"):
        text = CliRunner().invoke(app, [name, "--help"], env=wide).stdout
        assert "<bool>" not in text, name
    check_help = CliRunner().invoke(app, ["check", "--help"], env=wide).stdout
    assert "--strict" in check_help and "--no-strict" in check_help
    # the docstring's second paragraph is one line at 200 columns: no hard break inside it
    assert any(
        "processed-logprob hints. Each finding is one line" in line for line in check_help.splitlines()
    )
    assert invoke("check", RUN_A, "--no-strict").exit_code == 0
    root = CliRunner().invoke(app, [], env=wide).stdout
    assert re.search(r"recompute\s+Alias of `logprobs`", root)


def test_sample_tokenizer_matches_the_tiny_models_vocabulary() -> None:
    from tokenizers import Tokenizer

    import pgdiag

    tokenizer = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    vocab = json.loads((TINY / "vocab.json").read_text())
    assert tokenizer.get_vocab() == vocab  # the same ids, word for word
    ids = pgdiag.read_run(RUN_A).collect(["input_ids"])["input_ids"].to_list()
    for sample in ids[:16]:  # decode then encode gives back the stored token ids
        text = tokenizer.decode(sample, skip_special_tokens=False)
        assert tokenizer.encode(text).ids == sample
    assert tokenizer.decode(ids[0][:3], skip_special_tokens=False) == " ".join(
        {v: k for k, v in vocab.items()}[i] for i in ids[0][:3]
    )


def test_compare_shows_the_worst_tokens_with_their_text() -> None:
    plain = invoke("compare", RUN_A, RUN_B)  # without a tokenizer: ids only, and a pointer to the option
    assert plain.exit_code == 0 and "--tokenizer PATH shows each token's text" in plain.stdout
    result = invoke("compare", RUN_A, RUN_B, "--tokenizer", TINY, env={**ENV_80, "COLUMNS": "120"})
    assert result.exit_code == 0, result.stderr
    vocab = {v: k for k, v in json.loads((TINY / "vocab.json").read_text()).items()}
    import pgdiag

    top = pgdiag.compare_runs(RUN_A, RUN_B).report.worst_tokens.row(0, named=True)
    table = result.stdout[result.stdout.index("worst tokens") :]
    first = next(line for line in table.splitlines() if line.split()[:2] == [str(top["step"]), "│"])
    assert f"'{vocab[top['token_id']]}'" in first  # the token itself, as text
    assert "text (±8 tokens)" in table and "<eos>" in table


def test_step_progress_draws_a_bar_on_a_terminal_only() -> None:
    import io

    from rich.console import Console

    from pgdiag.cli.common import step_progress
    from pgdiag.data.runs import read_run
    from pgdiag.metrics.api import compute_metrics

    seen: list[tuple[int, int]] = []
    terminal = Console(file=io.StringIO(), force_terminal=True, width=100)
    with step_progress(terminal, "metrics") as progress:
        assert progress is not None

        def record(done: int, total: int) -> None:
            seen.append((done, total))
            progress(done, total)

        compute_metrics(read_run(str(SAMPLE_DATA / "run_a")), progress=record)
    assert seen and seen[-1] == (4, 4)  # run_a has 4 steps; the last call says all were read
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert "steps" in terminal.file.getvalue()
    pipe = Console(file=io.StringIO(), force_terminal=False)
    with step_progress(pipe, "metrics") as progress:
        assert progress is None
    quiet = Console(file=io.StringIO(), force_terminal=True, quiet=True)
    with step_progress(quiet, "drift") as progress:
        assert progress is None
