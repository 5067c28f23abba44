"""benchmarks/bench_explain.py --tiny on the CPU: its JSON gives tokens/s for every configuration, also when the
budget takes only part of the run (the case that left `tokens_per_s` null on the GPU), counted on the samples
the budget took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl

from pgdiag.data.runs import read_run

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_explain.py"


def test_tiny_bench_reports_tokens_per_second(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, str(BENCH), "--tiny", "--device", "cpu", "--samples", "8", "--tokens", "120",
               "--workdir", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=BENCH.parent, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    tokens = read_run(tmp_path / "work" / "explain" / "tokens").lazy.select(pl.col("input_ids").list.len())
    forwarded = int(tokens.collect()["input_ids"].sum())
    assert report["tokens_forwarded"] == forwarded < report["tokens"]  # the budget took part of the run
    assert report["loss_tokens"] < report["loss_tokens_in_run"]
    rows = {r["configuration"]: r for r in report["configurations"]}
    assert set(rows) == {"grid", "ex_ref", "ex_bf16", "ex_bf16_head", "ex_fp16", "ex_b1"}
    for row in rows.values():
        # the JSON rounds seconds to the ms and the rates to the unit, both from the unrounded time: the rate
        # lies between the counts over seconds ± 0.5 ms, ± 0.5 of rounding
        fastest, slowest = row["seconds"] - 0.0005, row["seconds"] + 0.0005
        for rate, count in (
            (row["tokens_per_s"], forwarded),
            (row["loss_tokens_per_s"], report["loss_tokens"]),
        ):
            assert count / slowest - 0.5 <= rate <= count / fastest + 0.5
    assert report["cost_line"].startswith(
        f"recompute matrix: {report['loss_tokens']} tokens x 6 configurations"
    )
