"""Time `read_run` + `read_token_batch` on a 10M-response-token run and report peak RSS.

Builds (once, in a temp dir or --dir) a canonical run of 20,000 samples x ~500 response + ~200 prompt tokens
over 4 steps with rollout/old/new streams, per-token advantages, reward and env, then loads it in a fresh
subprocess per repeat (so peak RSS is the loader's own) and prints wall time and ru_maxrss. Baseline side by
side: the hand-written pandas route (read with pyarrow, explode the list columns, filter the loss mask).

    python benchmarks/bench_read.py [--samples 20000] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pgdiag.data.writing import source_meta, stream_meta, write_rollouts  # noqa: E402


def _list_series(name: str, values: np.ndarray, offsets: np.ndarray, valid: np.ndarray | None) -> pl.Series:
    mask = None if valid is None else ~valid
    child = pa.array(values, mask=mask)
    return pl.Series(name, pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), child))


def build_run(out: Path, n_samples: int, seed: int = 0) -> None:
    """Write the benchmark run to `out` (a run directory)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(150, 250, n_samples)
    response = np.clip(rng.lognormal(np.log(450), 0.35, n_samples).astype(np.int64), 16, 2000)
    lengths = prompt + response
    offsets = np.zeros(n_samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n = int(offsets[-1])
    pos = np.arange(n) - np.repeat(offsets[:-1], lengths)
    loss = pos >= np.repeat(prompt, lengths)
    rollout = np.minimum(-rng.exponential(0.3, n), -1e-4).astype(np.float32)
    old = (rollout + rng.normal(0, 0.01, n)).astype(np.float32)
    old = np.minimum(old, -1e-5)
    new = np.minimum(old + rng.normal(0, 0.05, n), -1e-5).astype(np.float32)
    adv_seq = rng.normal(0, 1, n_samples).astype(np.float32)
    advantages = np.repeat(adv_seq, lengths)
    steps = np.repeat(np.arange(4), -(-n_samples // 4))[:n_samples]
    df = pl.DataFrame(
        [
            pl.Series("step", steps, dtype=pl.Int64),
            pl.Series("sample_id", [f"{s}:{i}" for i, s in enumerate(steps)]),
            pl.Series("group_id", [f"g{i // 8}" for i in range(n_samples)]),
            _list_series("input_ids", rng.integers(0, 150000, n).astype(np.int32), offsets, None),
            pl.Series("prompt_len", prompt, dtype=pl.Int32),
            _list_series("loss_mask", loss, offsets, None),
            _list_series("rollout_logprobs", rollout, offsets, loss),
            _list_series("old_logprobs", old, offsets, loss),
            _list_series("new_logprobs", new, offsets, loss),
            _list_series("advantages", advantages, offsets, loss),
            pl.Series("reward", rng.random(n_samples).astype(np.float32)),
            pl.Series("env", np.where(np.arange(n_samples) % 2 == 0, "math", "code")),
        ]
    )
    streams = {s: stream_meta(f"{s}_logprobs") for s in ("rollout", "old", "new")}
    write_rollouts(df, out, label="bench", source=source_meta("bench"), streams_meta=streams, overwrite=True)


LOAD_SNIPPET = """
import resource, sys, time, json
sys.path.insert(0, {repo!r})
t0 = time.perf_counter()
from pgdiag.data.runs import read_run, read_token_batch
t_import = time.perf_counter()
run = read_run({path!r})
loaded = read_token_batch(run, streams=["rollout", "old", "new"], env=True)
t1 = time.perf_counter()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"seconds": round(t1 - t0, 3), "seconds_after_import": round(t1 - t_import, 3),
                  "cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "tokens": loaded.batch.n_tokens,
                  "samples": loaded.batch.n_samples, "rss_mb": round(usage.ru_maxrss / 1024)}}))
"""

CHECK_SNIPPET = """
import resource, sys, time, json
sys.path.insert(0, {repo!r})
from pgdiag.checks.run import check_run
from pgdiag.data.runs import read_run
t0 = time.perf_counter()
result = check_run(read_run({path!r}))
t1 = time.perf_counter()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"seconds": round(t1 - t0, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
                  "issues": result.issues["code"].to_list(), "rss_mb": round(usage.ru_maxrss / 1024)}}))
"""

PHASES_SNIPPET = """
import sys, time, json
sys.path.insert(0, {repo!r})
from pgdiag.data.runs import batch_inputs, build_token_batch, load_rows, read_run
from pgdiag.data.validate import validate_rows
times = {{}}
t = time.perf_counter(); run = read_run({path!r}); times["read_run"] = time.perf_counter() - t
t = time.perf_counter()
rows = load_rows(run, streams=["rollout", "old", "new"], scalars=["advantage", "reward", "env"], lists=["advantages"])
times["collect_and_flatten"] = time.perf_counter() - t
t = time.perf_counter(); found = validate_rows(rows.table); times["validate"] = time.perf_counter() - t
t = time.perf_counter()
frame, view, keep = batch_inputs(rows, found)
build_token_batch(run, frame, view, streams=rows.streams, sample_row=keep, env=True)
times["build_batch"] = time.perf_counter() - t
print(json.dumps({{k: round(v, 3) for k, v in times.items()}}))
"""

PANDAS_SNIPPET = """
import resource, sys, time, json, glob
t0 = time.perf_counter()
import pyarrow.parquet as pq, pandas as pd
cols = ["step", "sample_id", "loss_mask", "input_ids", "rollout_logprobs", "old_logprobs", "new_logprobs",
        "advantages"]
df = pd.concat([pq.read_table(f, columns=cols).to_pandas() for f in sorted(glob.glob({path!r} + "/rollouts/**/*.parquet", recursive=True))])
lists = ["loss_mask", "input_ids", "rollout_logprobs", "old_logprobs", "new_logprobs", "advantages"]
tok = df.explode(lists)
tok = tok[tok["loss_mask"].astype(bool)]
arrays = {{c: tok[c].to_numpy(dtype="float64") for c in lists[2:]}}
t1 = time.perf_counter()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"seconds": round(t1 - t0, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
                  "tokens": int(len(tok)), "rss_mb": round(usage.ru_maxrss / 1024)}}))
"""


def _run(snippet: str) -> dict:
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--baseline", action="store_true", help="also time the pandas explode route")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="pgdiag-bench-read-"))
    run_dir = base / "run"
    if not (run_dir / "pgdiag.json").exists():
        t0 = time.perf_counter()
        build_run(run_dir, args.samples)
        print(f"built {run_dir} in {time.perf_counter() - t0:.1f} s")
    size_mb = sum(p.stat().st_size for p in run_dir.rglob("*.parquet")) / 2**20
    print(f"run: {size_mb:.0f} MB on disk")
    for k in range(args.repeats):
        result = _run(LOAD_SNIPPET.format(repo=str(REPO), path=str(run_dir)))
        print(f"pgdiag read_run + read_token_batch #{k}: {json.dumps(result)}")
    print(f"phases: {json.dumps(_run(PHASES_SNIPPET.format(repo=str(REPO), path=str(run_dir))))}")
    print(
        f"check_run (all streams, semantic checks): {json.dumps(_run(CHECK_SNIPPET.format(repo=str(REPO), path=str(run_dir))))}"
    )
    if args.baseline:
        result = _run(PANDAS_SNIPPET.format(path=str(run_dir)))
        print(f"pandas explode baseline: {json.dumps(result)}")


if __name__ == "__main__":
    main()
