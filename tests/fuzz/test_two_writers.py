"""Two processes writing one `--out` report at the same time never mix their files (docs/reliability.md).

Writers of one output directory take turns on an ``flock`` of that directory: without ``--overwrite`` the
second finds the first's report and exits E502; with ``--overwrite`` the last writer's whole set wins.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sample_paths import SAMPLE_DATA

from pgdiag.report.report import load_report

ROOT = Path(__file__).resolve().parents[2]
RUNS = (SAMPLE_DATA / "run_a", SAMPLE_DATA / "run_b")


def start_both(out: Path, *extra: str) -> list[subprocess.CompletedProcess]:
    """Start `pgdiag metrics RUN --out OUT` on both sample runs at once; wait for both."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pgdiag", "metrics", str(run), "--out", str(out), "--quiet", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for run in RUNS
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs]


def report_runs(out: Path) -> tuple[list[str], list[str]]:
    """The run named by the report's JSON and by its Parquet footer (equal when one writer wrote both)."""
    result = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    return result["inputs"]["runs"], load_report(out).meta["inputs"]["runs"]


def test_second_writer_without_overwrite_gets_e502(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = start_both(out)
    codes = sorted(p.returncode for p in done)
    assert codes == [0, 2], [(p.returncode, p.stderr) for p in done]
    loser = next(p for p in done if p.returncode == 2)
    assert loser.stderr.strip().splitlines()[0].startswith("error[E502] "), loser.stderr
    from_json, from_parquet = report_runs(out)
    assert from_json == from_parquet
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "metrics.parquet"]


def test_two_writers_with_overwrite_leave_one_whole_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = start_both(out, "--overwrite")
    assert [p.returncode for p in done] == [0, 0], [p.stderr for p in done]
    from_json, from_parquet = report_runs(out)
    assert from_json == from_parquet and from_json in (["run_a"], ["run_b"])
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "metrics.parquet"]


def test_report_writers_take_turns_even_in_the_race_window(tmp_path: Path, monkeypatch) -> None:
    # Deterministic form of the race: each writer sleeps inside its first file write, so both pass the
    # "exists?" check at once unless the directory lock serialises them (before: both exited 0, files mixed).
    import threading
    import time

    from clean_error import run_cli

    import pgdiag.data.writing as writing

    source = tmp_path / "source"
    assert run_cli(["metrics", str(RUNS[0]), "--out", str(source), "--quiet"]).exit_code == 0
    report = load_report(source)
    real_write_parquet = writing.write_parquet

    def slow_write_parquet(*args, **kwargs):
        time.sleep(0.5)
        return real_write_parquet(*args, **kwargs)

    monkeypatch.setattr(writing, "write_parquet", slow_write_parquet)
    out = tmp_path / "out"
    out.mkdir()
    outcomes: list[str] = []

    def write() -> None:
        try:
            report.write(out)
            outcomes.append("written")
        except Exception as error:
            outcomes.append(getattr(error, "code", repr(error)))

    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["E502", "written"]


# ---- two `pgdiag logprobs` of one recompute tag ------------------------------------------------------------------
# The writer holds the tag directory's lock from its decision to its final manifest; a second writer is refused
# at once with E519 (a recompute can run for hours: it does not wait), or, when the first has already finished,
# finds its complete result (E502). Before, both wrote parts and manifests into one directory.

TINY = SAMPLE_DATA / "tiny-qwen"
LOGPROBS = ["--model", str(TINY), "--tag", "rc", "--dtype", "fp32", "--part-samples", "4", "--device", "cpu"]


def one_step_run(tmp_path: Path) -> Path:
    import shutil

    run = tmp_path / "run_a"
    shutil.copytree(RUNS[0], run, ignore=shutil.ignore_patterns("logprobs", "step=[123]"))
    return run


def stream_table(directory: Path):
    import polars as pl

    parts = sorted(directory.glob("step=*/part-*.parquet"))
    return pl.concat([pl.read_parquet(p) for p in parts]).sort("sample_id").select("sample_id", "logprobs")


def test_two_logprobs_writers_of_one_tag_leave_one_whole_dataset(tmp_path: Path) -> None:
    run = one_step_run(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pgdiag", "logprobs", str(run), *LOGPROBS, "-q"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    done = [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs]
    assert sorted(p.returncode for p in done) == [0, 2], [(p.returncode, p.stderr) for p in done]
    loser = next(p for p in done if p.returncode == 2)
    first = loser.stderr.strip().splitlines()[0]
    assert first.startswith(("error[E519] ", "error[E502] ")), loser.stderr
    out_dir = run / "logprobs" / "rc"
    assert json.loads((out_dir / "_manifest.json").read_text())["complete"] is True
    assert not [p for p in out_dir.rglob("*") if ".tmp-" in p.name]
    from clean_error import run_cli

    assert (
        run_cli(["logprobs", str(run), "--model", str(TINY), "--tag", "single", *LOGPROBS[4:]]).exit_code == 0
    )
    ours, reference = stream_table(out_dir), stream_table(run / "logprobs" / "single")
    assert ours.height == 32 and ours.equals(reference)  # every sample once, the values of one writer


def test_logprobs_second_writer_is_refused_while_the_first_holds_the_tag(tmp_path: Path, monkeypatch) -> None:
    # Deterministic form of the race: the first writer waits inside its first part write, holding the tag's
    # lock; a second writer is refused with E519 and touches nothing; even --overwrite cannot take the tag.
    import threading

    import pgdiag.recompute.forward as forward
    import pgdiag.recompute.model_spec as model_spec
    from pgdiag.recompute.jobs import recompute_logprobs

    run = one_step_run(tmp_path)
    real_write_part = forward.write_part
    started, release = threading.Event(), threading.Event()

    def slow_write_part(*args, **kwargs):
        if threading.current_thread() is first:
            started.set()
            release.wait(timeout=300)
        return real_write_part(*args, **kwargs)

    monkeypatch.setattr(forward, "write_part", slow_write_part)
    options = {"tag": "rc", "dtype": "fp32", "part_samples": 4, "device": "cpu"}
    outcomes: dict[str, str] = {}

    def write(name: str, model: Path = TINY, **extra) -> None:
        try:
            recompute_logprobs(run, model, **options, **extra)
            outcomes[name] = "written"
        except Exception as error:
            outcomes[name] = f"{getattr(error, 'code', repr(error))} {error}"

    first = threading.Thread(target=write, args=("first",))
    first.start()
    assert started.wait(timeout=300)  # the first writer is inside its first part
    # a checkpoint whose weights fail to load (E60x) when read: the lock refuses its writer before any load
    unloadable = tmp_path / "unloadable"
    shutil.copytree(TINY, unloadable)
    (unloadable / "model.safetensors").write_bytes(b"not safetensors")
    loads: list[str] = []
    real_load = model_spec.ModelSpec.load

    def counted_load(self, **kwargs):
        loads.append(threading.current_thread().name)
        return real_load(self, **kwargs)

    monkeypatch.setattr(model_spec.ModelSpec, "load", counted_load)
    for name, extra in (
        ("second", {}),
        ("overwrite", {"overwrite": True}),
        ("unloadable", {"overwrite": True}),
    ):
        write(name, **({"model": unloadable} if name == "unloadable" else {}), **extra)
    assert loads == []  # none of the refused writers loaded a model (the first had loaded before waiting)
    release.set()
    first.join()
    assert outcomes["first"] == "written", outcomes
    for name in ("second", "overwrite", "unloadable"):
        assert outcomes[name].startswith("E519 E519: ") and "another process is writing" in outcomes[name]
    out_dir = run / "logprobs" / "rc"
    assert json.loads((out_dir / "_manifest.json").read_text())["complete"] is True
    assert stream_table(out_dir).height == 32
