"""Golden outputs of the CLI on sample_data/, saved at `fefc33e` (issue 21) and compared by test_golden.py.

Each case runs one command with `--json` (and `--out` where the command writes report tables) on a temporary
copy of sample_data/'s tracked runs (so recompute streams left under `sample_data/*/logprobs/` never leak in),
and keeps the result object and every report table as JSON records (gzipped: `outputs/NAME.json.gz`).

Regenerate (only when a change of numbers is intended and explained in the commit):

    PYTHONPATH=. python tests/golden/make_golden.py
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import polars as pl

REPO = Path(__file__).resolve().parents[2]
SAMPLE_DATA = REPO / "sample_data"  # only its tracked rollouts and footers are copied (below)
GOLDEN = Path(__file__).resolve().parent / "outputs"
RUNS = ("run_a", "run_b", "synthetic_a", "synthetic_b")
KEY_STYLES = ("fast-llm", "verl", "trl", "liger", "miles", "pipelinerl")

# result-object keys that are not results: wall time, version, argv, output paths, and the gate/verdict layer
# (compare's default gates are a CLI decision of issue 21 item 4, not a number of the stage)
NOT_COMPARED = ("timing_s", "pgdiag", "argv", "files", "gates", "verdict", "status", "exit_code")

# name -> (argv, writes report tables with --out)
CASES: dict[str, tuple[tuple[str, ...], bool]] = {
    "check-run_a": (("check", "run_a"), False),
    "check-synthetic_a": (("check", "synthetic_a"), False),
    "check-run_a-run_b": (("check", "run_a", "run_b"), False),
    "metrics-run_a": (("metrics", "run_a"), True),
    "metrics-synthetic_a": (("metrics", "synthetic_a"), True),
    "metrics-run_a-constant": (("metrics", "run_a", "--aggregation", "constant", "--divisor", "4096"), True),
    **{
        f"metrics-synthetic_a-{style}": (("metrics", "synthetic_a", "--key-style", style), True)
        for style in KEY_STYLES
    },
    "metrics-synthetic_a-docs8": (("metrics", "synthetic_a", "--docs-per-step", "8"), True),
    "metrics-synthetic_a-fast-llm-docs8": (
        ("metrics", "synthetic_a", "--key-style", "fast-llm", "--docs-per-step", "8"),
        True,
    ),
    "compare-run_a-run_b": (("compare", "run_a", "run_b"), True),
    "compare-synthetic_a-synthetic_b": (("compare", "synthetic_a", "synthetic_b"), True),
    "compare-run_a": (("compare", "run_a"), True),
    "compare-run_a-rollout-new": (("compare", "run_a", "--stream-a", "rollout", "--stream-b", "new"), True),
    "compare-synthetic_a-synthetic_b-metrics": (("compare", "synthetic_a", "synthetic_b", "--metrics"), True),
    "compare-run_a-metrics": (("compare", "run_a", "--metrics"), True),
    "compare-run_a-run_b-hash-any-step": (("compare", "run_a", "run_b", "--join", "hash-any-step"), True),
    "compare-nway": (("compare", "run_a", "run_b", "run_c"), True),
    "whatif-run_a": (("whatif", "run_a"), True),
    "whatif-synthetic_a": (("whatif", "synthetic_a"), True),
    "drift-run_a": (("drift", "run_a"), True),
    "drift-synthetic_a": (("drift", "synthetic_a"), True),
}


def copy_sample_data(dest: Path) -> None:
    """The tracked runs of sample_data/ (rollouts and pgdiag.json only) under `dest`, plus `run_c`: run_b
    again, labelled run_c, the third run of the N-way case."""
    for run in RUNS:
        (dest / run).mkdir(parents=True)
        shutil.copytree(SAMPLE_DATA / run / "rollouts", dest / run / "rollouts")
        shutil.copy(SAMPLE_DATA / run / "pgdiag.json", dest / run / "pgdiag.json")
    shutil.copytree(dest / "run_b", dest / "run_c")
    meta = json.loads((dest / "run_c" / "pgdiag.json").read_text())
    meta["label"] = "run_c"
    (dest / "run_c" / "pgdiag.json").write_text(json.dumps(meta, indent=2))


def _records(path: Path) -> list[dict[str, Any]]:
    return pl.read_parquet(path).to_dicts()


def run_case(name: str, data: Path) -> dict[str, Any]:
    """Run one case in `data` (a copy made by copy_sample_data): {"result": ..., "tables": {file: records}}."""
    argv, writes_tables = CASES[name]
    out = data / "out" / name
    extra = ("--out", str(out / "report.parquet")) if writes_tables else ()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, "-m", "pgdiag", *argv, "--json", "-q", *extra],
        cwd=data,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if not proc.stdout.strip():
        raise RuntimeError(f"{name}: no JSON on stdout (exit {proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout)
    tables = {}
    if writes_tables:
        tables = {p.name: _records(p) for p in sorted(out.glob("*.parquet"))}
    return {"result": {k: v for k, v in result.items() if k not in NOT_COMPARED}, "tables": tables}


def _jsonable(value: Any) -> Any:
    """NaN and infinities as strings (strict JSON), everything else as is."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def main() -> None:
    GOLDEN.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        copy_sample_data(Path(tmp))
        for name in CASES:
            payload = _jsonable(run_case(name, Path(tmp)))
            text = json.dumps(payload, separators=(",", ":"), sort_keys=True)
            (GOLDEN / f"{name}.json.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
            print(name)


if __name__ == "__main__":
    main()
