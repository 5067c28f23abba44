"""Messages longer than the terminal, under a pipe: every finding, hint, error and verdict stays one line.

Off a terminal (CliRunner's streams, like a pipe, are not TTYs) rich used to fold a verdict or a message wider
than COLUMNS onto a second line, which broke the one-line rule and ``| tail -1``. Each example plants a NaN in
a run whose sample ids are long (any text, newlines included) and reads the output at a narrow width.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_factory import valid_rows, write_rollouts_file
from typer.testing import CliRunner

from pgdiag.cli.app import build_app

# A line of a command's stderr: a finding or an error, its hint, or the verdict.
RECORD = re.compile(r"^(error\[[EW]\d{3}\] |warning\[[EW]\d{3}\] |  hint: |hint: |check: |metrics: )")


def long_id_run(path: Path, sample_id: str) -> Path:
    rows = valid_rows()
    for index, row in enumerate(rows):
        row["sample_id"] = f"{sample_id}{index}"
    rows[0]["old_logprobs"][2] = float("nan")  # E207, whose message names the sample
    return write_rollouts_file(path, rows)


def test_long_messages_stay_one_line_at_any_width(tmp_path: Path, fuzz_examples: int) -> None:
    @settings(
        max_examples=fuzz_examples * 2,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        sample_id=st.text(
            st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=40, max_size=400
        ),
        columns=st.integers(20, 120),
        command=st.sampled_from((("check",), ("metrics", "--new", "old", "--old", "rollout"))),
    )
    def case(sample_id: str, columns: int, command: tuple[str, ...]) -> None:
        run = long_id_run(tmp_path / "run.parquet", sample_id)
        result = CliRunner().invoke(
            build_app(), [command[0], str(run), *command[1:]], env={"COLUMNS": str(columns)}
        )
        assert result.exit_code == 3, result.output
        lines = result.output.rstrip("\n").split("\n")  # what `tail` and `grep` see as lines
        assert lines[0].startswith("error[E207] "), result.output
        assert all(RECORD.match(line) for line in lines), result.output

    case()


def test_verdict_is_the_last_line_of_a_real_pipe(tmp_path: Path) -> None:
    # the verdict of `pgdiag check RUN 2>&1 | tail -1`, with a finding of 600 characters
    run = long_id_run(tmp_path / "run.parquet", "sample-" + "x" * 300)
    done = subprocess.run(
        [sys.executable, "-m", "pgdiag", "check", str(run)],
        capture_output=True,
        text=True,
        env={k: v for k, v in __import__("os").environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")},
    )
    lines = done.stderr.splitlines()  # the finding: a diagnostic, on stderr
    assert done.returncode == 3, done.stderr
    assert [line[:12] for line in lines] == ["error[E207] "], done.stderr
    verdict = done.stdout.splitlines()  # the verdict: a result, on stdout, one line
    assert [line[:12] for line in verdict] == ["check: error"], done.stdout
    assert verdict[-1].endswith("x0)") or "x" * 300 in verdict[-1], verdict[-1]
