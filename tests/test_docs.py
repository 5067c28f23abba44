"""The README and docs stay true: the Python API block runs, CI installs and tests exactly as the README says,
and every CLI command is documented (the sqlite-utils pattern)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sample_paths import SAMPLE_CWD

from pgdiag.cli.app import build_app

ROOT = Path(__file__).resolve().parent.parent


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def test_readme_python_block_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (block,) = _blocks((ROOT / "README.md").read_text(), "python")
    monkeypatch.chdir(SAMPLE_CWD)  # its sample_data/ is the clean copy
    namespace: dict = {}
    exec(compile(block.replace("/tmp/parity-api", str(tmp_path / "parity")), "README.md", "exec"), namespace)
    report = namespace["report"]
    assert report.value("loss/pg") == report.value("loss/constant") is not None
    assert (tmp_path / "parity" / "compare.parquet").exists()


def test_ci_runs_the_readme_setup_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = _blocks(readme.split("## Set up", 1)[1], "bash")[0].strip().splitlines()
    assert len(setup) == 2, setup  # exactly two set-up commands: install; run the tests
    install, run_tests = setup
    # the install command creates and activates a virtual environment, then installs into it
    assert re.fullmatch(r"python3 -m venv (\S+) && source \1/bin/activate && pip install .+", install), (
        install
    )
    assert run_tests == "python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in setup:
        assert command in ci, command
    # and CI does exactly that: no environment or install of its own beside the README's (apt-get for system
    # packages aside), and the lint and tests run after the install, inside its environment
    own = [
        line
        for line in ci
        if not line.startswith("#") and re.search(r"\bvenv\b|activate|pip install", line) and line != install
    ]
    assert not own, own
    assert ci.index(install) < ci.index(run_tests)
    assert ci.index(install) < ci.index("ruff check .")


def test_every_command_is_documented() -> None:
    app = build_app()
    names = [c.name for c in app.registered_commands if not c.hidden]
    assert {"check", "metrics", "compare", "plot", "logprobs"} <= set(names)
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    for name in names:
        assert f"pgdiag {name}" in cli_doc, name


def test_readme_comments_are_true(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the README's API block and its loop say: wide() rows, parity.write's files, the verdict lines."""
    import polars as pl
    from typer.testing import CliRunner

    import pgdiag

    (block,) = _blocks((ROOT / "README.md").read_text(), "python")
    assert '# one row per pair and step (+ each pair\'s "all")' in block
    monkeypatch.chdir(SAMPLE_CWD)  # its sample_data/ is the clean copy
    namespace: dict = {}
    exec(compile(block.replace("/tmp/parity-api", str(tmp_path / "parity")), "README.md", "exec"), namespace)
    report, parity = namespace["report"], namespace["parity"]
    wide = report.wide()
    pairs = report.summary["pair"].unique().to_list()
    assert wide.height == len(pairs) * 5  # 4 steps + "all", per pair
    assert set(wide.select("pair", "bucket").iter_rows()) == {
        (p, b) for p in pairs for b in ("0", "1", "2", "3", "all")
    }
    assert set(report.summary["metric"].unique()) <= set(wide.columns)
    assert wide.filter((pl.col("bucket") == "all") & pl.col("policy/clip_frac_binding").is_not_null()).item(
        0, "policy/clip_frac_binding"
    ) == report.value("policy/clip_frac_binding")
    # parity.write: the report files that compare --out writes, loaded back identically
    out = tmp_path / "cli"
    runner = CliRunner()
    args = ["compare", "sample_data/run_a", "sample_data/run_b", "--out", str(out)]
    assert runner.invoke(build_app(), args).exit_code == 0
    api_files = {p.name for p in (tmp_path / "parity").iterdir()}
    assert api_files == {
        "compare.parquet",
        "compare.json",
        "compare.worst_tokens.parquet",
        "compare.worst_seqs.parquet",
    }
    assert api_files <= {p.name for p in out.iterdir()}
    loaded = pgdiag.load_report(tmp_path / "parity" / "compare.parquet")
    assert loaded.summary.equals(parity.summary) and loaded.meta == parity.meta
    cli_report = pgdiag.load_report(out)
    assert cli_report.summary.equals(parity.summary)
    # check, metrics, compare, whatif, drift and report end with their verdict line
    commands = {
        "check": ["check", "sample_data/run_a"],
        "metrics": ["metrics", "sample_data/run_a"],
        "compare": ["compare", "sample_data/run_a", "sample_data/run_b"],
        "whatif": ["whatif", "sample_data/run_a"],
        "drift": ["drift", "sample_data/run_a", "--new", "new"],
        "report": ["report", str(out)],
    }
    for name, command in commands.items():
        result = runner.invoke(build_app(), command, env={"COLUMNS": "100"})
        assert result.exit_code in (0, 1), (name, result.output)
        head = "compare" if name == "report" else name
        assert result.stdout.rstrip("\n").split("\n")[-1].startswith(f"{head}: "), (  # the verdict: stdout
            name,
            result.stdout[-300:],
        )


def test_drift_doc_examples_run_verbatim_on_the_shipped_long_run(tmp_path: Path) -> None:
    """docs/drift.md's commands on sample_data/long_run (only /tmp is moved under the test's folder), and the
    verdict line it quotes."""
    import json
    import os
    import subprocess
    import sys

    doc = (ROOT / "docs" / "drift.md").read_text()
    block = _blocks(doc, "bash")[0]
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(lines) == 3 and all(line.startswith("pgdiag drift sample_data/long_run ") for line in lines)
    env = {**os.environ, "COLUMNS": "200"}
    outputs = []
    for line in lines:
        command, _, jq_filter = line.replace("/tmp/", f"{tmp_path}/").partition(" | jq ")
        argv = [sys.executable, "-m", "pgdiag", *command.split()[1:]]
        done = subprocess.run(argv, cwd=SAMPLE_CWD, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, (line, done.stderr)
        if jq_filter:
            assert jq_filter == ".change_points"
            found = json.loads(done.stdout)["change_points"]
            assert [(cp["metric"], cp["step"]) for cp in found] == [("rollout_corr/k3_kl", 15)]
        shown = done.stderr if jq_filter else done.stdout  # the verdict: stdout, or stderr beside --json
        outputs.append(shown.rstrip("\n").split("\n")[-1])
    assert (tmp_path / "drift" / "drift.parquet").is_file() and (
        tmp_path / "drift.png"
    ).stat().st_size > 10_000
    assert (tmp_path / "drift.html").read_text().count("mismatch/abs_mean") > 0
    quoted = re.search(r"`(drift: 3 change points over 24 steps: [^`]*?); \.\.\.`", doc)
    assert quoted, "docs/drift.md quotes the verdict of the long run"
    assert outputs[0].startswith(quoted.group(1)), (outputs[0], quoted.group(1))
    assert outputs[2] == outputs[0]
