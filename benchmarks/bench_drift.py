"""Benchmark: `pgdiag drift` end to end on a long synthetic run (default 200 steps x 500k response tokens).

Target (issue 13) on the 2-core CPU machine: <= 60 s wall and <= 2 GB peak RSS, and memory flat as steps grow
(drift reads one step at a time). The run is written step by step (hive partitions `rollouts/step=S/`, each
step built by `bench_metrics.make_run` and its `step` column set), so writing it needs one step in memory too.
`pgdiag drift RUN --json -q` runs as a child process; wall = its wall time, peak RSS = its own `ru_maxrss`.

Run:  python benchmarks/bench_drift.py [--steps 200] [--tokens-per-step 500_000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_metrics import make_run, timed


def make_long_run(out: Path, *, n_steps: int, tokens_per_step: int) -> int:
    """Write `n_steps` steps of about `tokens_per_step` response tokens each; returns the response tokens."""
    total = 0
    with tempfile.TemporaryDirectory() as scratch:
        for step in range(n_steps):
            one = Path(scratch) / f"s{step}"
            shape = make_run(one, n_tokens=tokens_per_step, n_steps=1, seed=step)
            total += int(shape["response_tokens"])
            (part,) = sorted((one / "rollouts").rglob("*.parquet"))
            table = pq.read_table(part)
            metadata = table.schema.metadata
            index = table.schema.get_field_index("step")
            table = table.set_column(index, "step", pa.array([step] * table.num_rows, pa.int64()))
            ids = pa.array([f"{step}:{s}" for s in table.column("sample_id").to_pylist()])
            table = table.set_column(table.schema.get_field_index("sample_id"), "sample_id", ids)
            table = table.replace_schema_metadata(metadata)
            target = out / "rollouts" / f"step={step}" / "part-00000.parquet"
            target.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, target, compression="zstd", compression_level=3)
            shutil.rmtree(one)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens-per-step", type=int, default=500_000)
    parser.add_argument("--keep", type=Path, default=None, help="Write the synthetic run here and keep it.")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_drift_"))
    try:
        if not (root / "rollouts").exists():
            tokens = make_long_run(root, n_steps=args.steps, tokens_per_step=args.tokens_per_step)
        else:
            tokens = None
        env = dict(os.environ)
        load_before = os.getloadavg()
        wall, rss, out = timed([sys.executable, "-m", "pgdiag", "drift", str(root), "--json", "-q"], env)
        result = json.loads(out.strip().splitlines()[-1])
        print(
            json.dumps(
                {
                    "steps": len(result["inputs"]["steps"]),
                    "response_tokens": tokens,
                    "wall_s": round(wall, 2),
                    "peak_rss_gib": round(rss, 3),
                    "change_points": len(result["change_points"]),
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                }
            )
        )
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
