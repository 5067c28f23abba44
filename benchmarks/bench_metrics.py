"""Benchmark: `pgdiag metrics` end to end on a synthetic run of 10M response tokens vs a hand-written pandas version.

Target (design/performance.md §3, issue 2) on the 2-core CPU machine: <= 5 s wall, <= 3 GB peak RSS, >= 5x faster
than the pandas/numpy version users write today (explode list columns, compute, groupby). Both run as child
processes on the same Parquet files so wall time and peak RSS (ru_maxrss of the child) are measured alike.

The pandas version computes the core of the native set per step (ratio mean, k1/k3, band and binding clip
fractions, ESS, log-ratio quantiles, mismatch bias/abs-mean/k3, and the token_mean, sample_mean, prompt_mean and
constant losses); pgdiag computes every native metric and every aggregation mode, so the comparison favours pandas.

Run:  python benchmarks/bench_metrics.py [--tokens 10_000_000] [--steps 20] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa


def make_run(out: Path, *, n_tokens: int, n_steps: int, seed: int = 0) -> dict[str, float]:
    """Write a canonical run with about `n_tokens` response tokens; returns its shape."""
    from pgdiag.writing import source_meta, stream_meta, write_rollouts

    rng = np.random.default_rng(seed)
    mean_response, group_size = 500, 8
    n_samples = max(group_size, n_tokens // mean_response // group_size * group_size)
    prompt = rng.integers(100, 300, n_samples)
    response = np.clip(rng.lognormal(np.log(mean_response) - 0.18, 0.6, n_samples), 8, 4000).astype(np.int64)
    lengths = prompt + response
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    row = np.repeat(np.arange(n_samples), lengths)
    pos = np.arange(total) - offsets[:-1][row]
    loss = pos >= prompt[row]
    # a masked tool span of ~5% inside responses
    tool = loss & (rng.random(total) < 0.002)
    tool = np.convolve(tool, np.ones(24, dtype=bool), mode="same").astype(bool) & loss
    loss &= ~tool
    old = -rng.exponential(0.6, total).astype(np.float32) - 1e-3
    rollout = (old + rng.normal(0, 0.01, total)).astype(np.float32)
    rollout = np.minimum(rollout, -1e-4).astype(np.float32)
    new = (old + rng.normal(0, 0.08, total)).astype(np.float32)
    new = np.minimum(new, -1e-4).astype(np.float32)
    group = np.arange(n_samples) // group_size
    reward = rng.random(n_samples).astype(np.float32)
    group_mean = np.bincount(group, reward) / group_size
    advantage = (reward - group_mean[group]).astype(np.float32)
    adv_tok = advantage[row]

    def lists(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
        arr = pa.array(values, mask=None if valid is None else ~valid)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), arr)

    steps = np.arange(n_samples) * n_steps // n_samples
    table = pa.table(
        {
            "step": pa.array(steps, pa.int64()),
            "sample_id": pa.array([f"s{i}" for i in range(n_samples)]),
            "group_id": pa.array([f"g{g}" for g in group]),
            "input_ids": lists(rng.integers(0, 151936, total, dtype=np.int32)),
            "prompt_len": pa.array(prompt, pa.int32()),
            "loss_mask": lists(loss),
            "rollout_logprobs": lists(rollout, loss),
            "old_logprobs": lists(old, loss),
            "new_logprobs": lists(new, loss),
            "advantages": lists(adv_tok, loss),
            "reward": pa.array(reward),
        }
    )
    streams = {s: stream_meta(f"{s}_logprobs", tempered=False) for s in ("rollout", "old", "new")}
    write_rollouts(
        pl.from_arrow(table),
        out,
        label="bench",
        source=source_meta("synthetic"),
        streams_meta=streams,
        overwrite=True,
    )
    return {"samples": n_samples, "positions": total, "response_tokens": int(loss.sum())}


PANDAS_SCRIPT = r"""
import sys, glob, numpy as np, pandas as pd
files = sorted(glob.glob(sys.argv[1] + "/rollouts/**/*.parquet", recursive=True))
cols = ["step", "sample_id", "group_id", "loss_mask", "rollout_logprobs", "old_logprobs", "new_logprobs", "advantages"]
df = pd.concat([pd.read_parquet(f, columns=cols) for f in files], ignore_index=True)
df["row"] = np.arange(len(df))
tok = df[["row", "loss_mask", "rollout_logprobs", "old_logprobs", "new_logprobs", "advantages"]].explode(
    ["loss_mask", "rollout_logprobs", "old_logprobs", "new_logprobs", "advantages"])
tok = tok[tok["loss_mask"].astype(bool)]
tok = tok.merge(df[["row", "step", "group_id"]], on="row")
for c in ["rollout_logprobs", "old_logprobs", "new_logprobs", "advantages"]:
    tok[c] = tok[c].astype("float64")
eps = 0.2
tok["d"] = tok["new_logprobs"] - tok["old_logprobs"]
tok["r"] = np.exp(tok["d"])
tok["k3"] = tok["r"] - 1 - tok["d"]
tok["band"] = (tok["r"] < 1 - eps) | (tok["r"] > 1 + eps)
A = tok["advantages"]
tok["binding"] = ((A > 0) & (tok["r"] > 1 + eps)) | ((A < 0) & (tok["r"] < 1 - eps))
tok["loss"] = np.maximum(-A * tok["r"], -A * tok["r"].clip(1 - eps, 1 + eps))
tok["delta"] = tok["old_logprobs"] - tok["rollout_logprobs"]
tok["rho"] = np.exp(tok["delta"])
out = {}
for step, g in tok.groupby("step"):
    n = len(g)
    per_sample = g.groupby("row")["loss"].agg(["sum", "count"])
    per_group = g.groupby("group_id")["loss"].agg(["sum", "count"])
    S = int((df["step"] == step).sum())
    out[int(step)] = {
        "ratio_mean": g["r"].mean(), "kl_k1": -g["d"].mean(), "kl_k3": g["k3"].mean(),
        "clip_frac_band": g["band"].mean(), "clip_frac_binding": g["binding"].mean(),
        "ess_token": g["r"].sum() ** 2 / (n * (g["r"] ** 2).sum()),
        "logratio_q": list(np.quantile(g["d"], [0.01, 0.05, 0.5, 0.95, 0.99, 0.999])),
        "mismatch_bias": g["delta"].mean(), "mismatch_abs_mean": g["delta"].abs().mean(),
        "mismatch_k3": (g["rho"] - 1 - g["delta"]).mean(),
        "token_mean": g["loss"].sum() / n, "sample_mean": (per_sample["sum"] / per_sample["count"]).sum() / S,
        "prompt_mean": (per_group["sum"] / per_group["count"]).mean(), "constant": g["loss"].sum() / (40960 * S),
    }
print(len(out))
"""


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (GiB, from the child's own rusage via wait4) and stdout of a child process."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}): {err.read().decode()[-2000:]}")
        return wall, usage.ru_maxrss / 2**20, out.read().decode()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--keep", type=Path, default=None, help="Write the synthetic run here and keep it.")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="pgdiag-bench-")) if args.keep is None else args.keep
    run = workdir / "run"
    t0 = time.perf_counter()
    shape = make_run(run, n_tokens=args.tokens, n_steps=args.steps)
    print(f"synthetic run: {shape} written in {time.perf_counter() - t0:.1f} s to {run}", file=sys.stderr)
    env = dict(os.environ)
    pgdiag_cmd = [sys.executable, "-m", "pgdiag", "metrics", str(run), "--aggregation", "constant",
                  "--divisor", "40960", "--json", "-q"]  # fmt: skip
    pandas_cmd = [sys.executable, "-c", PANDAS_SCRIPT, str(run)]
    pgdiag_runs = [timed(pgdiag_cmd, env) for _ in range(args.repeats)]
    result = json.loads(pgdiag_runs[-1][2])
    pandas_wall, pandas_rss, _ = timed(pandas_cmd, env)
    wall = min(r[0] for r in pgdiag_runs)
    rss = max(r[1] for r in pgdiag_runs)
    print(
        json.dumps(
            {
                "shape": shape,
                "pgdiag_wall_s": [round(r[0], 2) for r in pgdiag_runs],
                "pgdiag_peak_rss_gib": round(rss, 2),
                "pgdiag_n_tokens": result["inputs"]["n_tokens"],
                "pandas_wall_s": round(pandas_wall, 2),
                "pandas_peak_rss_gib": round(pandas_rss, 2),
                "speedup": round(pandas_wall / wall, 1),
                "cpus": os.cpu_count(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
