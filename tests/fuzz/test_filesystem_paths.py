"""File-system errors on every path a command takes: one E5xx line, never exit 101, never a hang.

Inputs (RUN of check, metrics, compare, logprobs; the report of plot and report): a path too long
(ENAMETOOLONG), a path under a regular file (ENOTDIR), a loop of links, a dangling link, `/dev/zero` and a FIFO
(refused as not a regular file: reading either would never end) and a file this user may not read are E516.
Outputs (`--out`, `--markdown`): a path too long, a loop, a folder this user may not write are E517, a file
where a folder must be E502. A permission is tested as a user other than root (root ignores file modes): the
test forks, drops to `nobody` after every module the command needs is imported, and runs the command there.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from clean_error import error_code, files_under, run_cli
from sample_paths import SAMPLE_DATA

SAMPLE = SAMPLE_DATA
RUN = SAMPLE / "run_a"
MODEL = SAMPLE / "tiny-qwen"
NOBODY = 65534

INPUT_COMMANDS = {
    "check": ["check", "{p}"],
    "metrics": ["metrics", "{p}"],
    "compare-a": ["compare", "{p}", RUN],
    "compare-b": ["compare", RUN, "{p}"],
    "logprobs": ["logprobs", "{p}", "--model", MODEL, "--tag", "fs", "--out", "{tmp}/lp"],
    "plot": ["plot", "{p}", "--out", "{tmp}/plots"],
    "report": ["report", "{p}"],
}
OUTPUT_COMMANDS = {
    "metrics --out": ["metrics", RUN, "--out", "{p}"],
    "compare --out": ["compare", RUN, RUN, "--out", "{p}"],
    "plot --out": ["plot", "{report}", "--out", "{p}"],
    "report --markdown": ["report", "{report}", "--markdown", "{p}/summary.md"],
}


@pytest.fixture(scope="module")
def place() -> Iterator[Path]:
    """A folder every user may enter (pytest's tmp folders are root's only), with a file, a FIFO, two links
    that loop, a dangling link and a saved metrics report."""
    root = Path(tempfile.mkdtemp(prefix="pgdiag-fs-"))
    root.chmod(0o755)
    (root / "afile").write_text("not a folder\n")
    os.mkfifo(root / "fifo")
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    (root / "dangling").symlink_to(root / "nowhere")
    assert run_cli(["metrics", RUN, "--out", root / "m"]).exit_code == 0
    yield root
    shutil.rmtree(root, ignore_errors=True)


BAD_INPUTS = {
    "too long": lambda root: root / ("x" * 300),
    "path too long": lambda root: root / "/".join(["y" * 200] * 25),
    "under a file": lambda root: root / "afile" / "run",
    "link loop": lambda root: root / "loop1",
    "dangling link": lambda root: root / "dangling",
    "/dev/zero": lambda root: Path("/dev/zero"),
    "fifo": lambda root: root / "fifo",
}


def _args(template: list, place: Path, path: Path, tmp: Path) -> list[str]:
    report = place / "m" / "metrics.parquet"
    return [str(a).format(p=path, tmp=tmp, report=report) for a in template]


def _run_bounded(args: list[str], seconds: float = 120):
    """`run_cli(args)` in a thread: a command that blocks on a FIFO or reads /dev/zero fails the test, not hangs it."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", run_cli(args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"pgdiag {' '.join(args)} still running after {seconds} s"
    return box["result"]


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
@pytest.mark.parametrize("command", sorted(INPUT_COMMANDS))
def test_bad_input_path_is_e516(place: Path, tmp_path: Path, command: str, bad: str) -> None:
    path = BAD_INPUTS[bad](place)
    result = _run_bounded(_args(INPUT_COMMANDS[command], place, path, tmp_path))
    assert error_code(result) == "E516", result.output
    assert files_under(tmp_path) == set(), result.output


def test_fifo_inside_a_run_is_refused(place: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    os.mkfifo(run / "rollouts" / "step=1" / "part-00001.parquet")
    for command in ("check", "metrics"):
        result = _run_bounded([command, str(run)])
        assert error_code(result) == "E516", result.output
        assert "part-00001.parquet: cannot be read (a FIFO" in result.output


BAD_OUTPUTS = {
    "too long": (lambda root: root / ("x" * 300), "E517"),
    "link loop": (lambda root: root / "loop1" / "out", "E517"),
    "under a file": (lambda root: root / "afile" / "out", "E502"),
    "a device": (lambda root: Path("/dev/zero") / "out", "E502"),
}


@pytest.mark.parametrize("bad", sorted(BAD_OUTPUTS))
@pytest.mark.parametrize("command", sorted(OUTPUT_COMMANDS))
def test_bad_output_path_is_one_error_line(place: Path, command: str, bad: str) -> None:
    make, code = BAD_OUTPUTS[bad]
    result = _run_bounded(_args(OUTPUT_COMMANDS[command], place, make(place), place))
    assert error_code(result) == code, result.output


def _as_nobody(args: list[str], tmp: Path) -> tuple[int, str]:
    """Run `pgdiag ARGS` as the user nobody (in a fork of this process, whose modules are imported already)."""
    out_file = tmp / "output.txt"
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        code = 99
        sys.stdout = sys.stderr = open(out_file, "w", encoding="utf-8")  # noqa: SIM115 (closed by the exit)
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            from pgdiag.cli import run

            code = run(args)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out_file.read_text()


def test_permission_denied_is_e516_and_e517(place: Path) -> None:
    work = place / "perm"
    work.mkdir()
    work.chmod(0o777)
    shutil.copytree(RUN, work / "run")
    for path in (work / "run").rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    secret = work / "run" / "rollouts" / "step=2" / "part-00000.parquet"
    report = work / "report.parquet"
    shutil.copy(place / "m" / "metrics.parquet", report)
    locked = work / "locked"
    locked.mkdir()
    # warm up: every module the commands import is loaded before the fork drops privileges
    for args in (
        ["metrics", str(work / "run")],
        ["plot", str(report), "--out", str(work / "warm")],
        ["report", str(report)],
    ):
        assert run_cli(args).exit_code == 0
    shutil.rmtree(work / "warm")
    secret.chmod(0)
    report.chmod(0)
    locked.chmod(0o555)
    cases = [
        (["check", str(work / "run")], "E516", str(secret)),
        (["metrics", str(secret)], "E516", str(secret)),
        (["compare", str(RUN), str(work / "run")], "E516", str(secret)),
        (["plot", str(report), "--out", str(work / "plots")], "E516", str(report)),
        (["report", str(report)], "E516", str(report)),
        (["metrics", str(RUN), "--out", str(locked / "m")], "E517", str(locked)),
    ]
    for args, code, named in cases:
        exit_code, output = _as_nobody(args, work)
        lines = output.strip().splitlines()
        assert lines and lines[0].startswith(f"error[{code}] {named}: cannot be"), (args, output)
        assert "Permission denied" in lines[0] or "permission denied" in lines[0], output
        assert exit_code == 2 and all(line.startswith("hint: ") for line in lines[1:]), (args, output)
    assert not (work / "plots").exists() and not any(locked.iterdir())
    assert stat.S_IMODE(secret.stat().st_mode) == 0
