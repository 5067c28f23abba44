"""Benchmark: `pgdiag metrics` end to end on a synthetic run of 10M response tokens vs a hand-written pandas version.

Target (issue 2) on the 2-core CPU machine: <= 5 s wall, <= 3 GB peak RSS, >= 5x faster
than the pandas/numpy version users write today (explode list columns, compute, groupby). Both run as child
processes on the same Parquet files so wall time and peak RSS (ru_maxrss of the child) are measured alike.
The synthetic run is written by a child process of its own too: on Linux a child's ru_maxrss starts from its
parent's peak RSS (the kernel keeps the parent's high-water mark when the spawned child calls exec), and writing
the run in this process took it to 1.0 GiB, which every measured child then reported as at least its peak.

The pandas version computes a representative part of the native set per step, written as users do (explode,
then groupby step and sample): ratio stats, k1/k3/reverse k3, band and binding clip fractions, token and
sequence ESS, log-ratio and sequence-ratio quantiles, the mismatch family (bias, sd, |Δ| quantiles, Pearson,
fit, k3, tmpe, chi²), all nine loss modes incl. the GSPO ones, two gradient scales and advantage stats. pgdiag
computes every native metric (about 180 keys) and every aggregation mode, so the comparison still favours pandas.

Run:  python benchmarks/bench_metrics.py [--tokens 10_000_000] [--steps 20] [--keep DIR] [--skip-pandas] [--tree NAME=PATH ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa


def make_run(out: Path, *, n_tokens: int, n_steps: int, seed: int = 0) -> dict[str, float]:
    """Write a canonical run with about `n_tokens` response tokens; returns its shape."""
    from pgdiag.data.writing import source_meta, stream_meta, write_rollouts

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
lists = ["loss_mask", "rollout_logprobs", "old_logprobs", "new_logprobs", "advantages"]
tok = df[["row", *lists]].explode(lists)
tok = tok[tok["loss_mask"].astype(bool)]
tok = tok.merge(df[["row", "step", "group_id"]], on="row")
for c in lists[1:]:
    tok[c] = tok[c].astype("float64")
eps, L = 0.2, 40960
A = tok["advantages"]
tok["d"] = tok["new_logprobs"] - tok["old_logprobs"]
tok["r"] = np.exp(tok["d"])
tok["k3"] = tok["r"] - 1 - tok["d"]
tok["band"] = (tok["r"] < 1 - eps) | (tok["r"] > 1 + eps)
tok["binding"] = ((A > 0) & (tok["r"] > 1 + eps)) | ((A < 0) & (tok["r"] < 1 - eps))
tok["loss"] = np.maximum(-A * tok["r"], -A * tok["r"].clip(1 - eps, 1 + eps))
tok["g"] = np.where(tok["binding"], 0.0, (A * tok["r"]).abs())
tok["delta"] = tok["old_logprobs"] - tok["rollout_logprobs"]
tok["rho"] = np.exp(tok["delta"])
out = {}
for step, g in tok.groupby("step"):
    n = len(g)
    S = int((df["step"] == step).sum())
    seq = g.groupby("row").agg(n=("d", "size"), dsum=("d", "sum"), lsum=("loss", "sum"), adv=("advantages", "mean"),
                               gsum=("g", "sum"), delta_sum=("delta", "sum"))
    seq["R"] = np.exp(seq["dsum"] / seq["n"])
    gl = g.merge(seq[["R"]], left_on="row", right_index=True)
    gl["loss_gspo"] = np.maximum(-gl["advantages"] * gl["R"], -gl["advantages"] * gl["R"].clip(1 - eps, 1 + eps))
    gseq = gl.groupby("row")["loss_gspo"].sum()
    grp = g.groupby("group_id")["loss"].agg(["sum", "count"])
    dabs = g["delta"].abs()
    out[int(step)] = {
        "ratio_mean": g["r"].mean(), "ratio_std": g["r"].std(ddof=0), "kl_k1": -g["d"].mean(), "kl_k3": g["k3"].mean(),
        "kl_rev_k3": (1 - g["r"] + g["r"] * g["d"]).mean(),
        "clip_frac_band": g["band"].mean(), "clip_frac_binding": g["binding"].mean(),
        "ess_token": g["r"].sum() ** 2 / (n * (g["r"] ** 2).sum()),
        "logratio_q": list(np.quantile(g["d"], [0.01, 0.05, 0.5, 0.95, 0.99, 0.999])),
        "seq_ratio_q": list(np.quantile(seq["R"], [0.01, 0.05, 0.5, 0.95, 0.99])),
        "seq_logratio_sum_q": list(np.quantile(seq["dsum"], [0.01, 0.05, 0.5, 0.95, 0.99])),
        "ess_seq": np.exp(2 * np.logaddexp.reduce(seq["dsum"]) - np.log(len(seq)) - np.logaddexp.reduce(2 * seq["dsum"])),
        "mismatch_bias": g["delta"].mean(), "mismatch_sd": g["delta"].std(ddof=0), "mismatch_abs_mean": dabs.mean(),
        "mismatch_abs_q": list(np.quantile(dabs, [0.5, 0.95, 0.99, 1.0])),
        "mismatch_pearson": np.corrcoef(g["rollout_logprobs"], g["old_logprobs"])[0, 1],
        "mismatch_fit": list(np.polyfit(g["rollout_logprobs"], g["old_logprobs"], 1)),
        "mismatch_k3": (g["rho"] - 1 - g["delta"]).mean(), "tmpe": np.exp(dabs).mean(),
        "chi2_token": (g["rho"] ** 2).mean() - 1, "chi2_seq": np.exp(2 * seq["delta_sum"]).mean() - 1,
        "token_mean": g["loss"].sum() / n, "sample_mean": (seq["lsum"] / seq["n"]).sum() / S,
        "prompt_mean": (grp["sum"] / grp["count"]).mean(), "constant": g["loss"].sum() / (L * S),
        "seq_mean_token_sum": g["loss"].sum() / S, "gspo_seq_mean": (gseq / seq["n"]).sum() / S,
        "gspo_length_prop": gseq.sum() / S, "gspo_token_mean": gl["loss_gspo"].sum() / n,
        "grad_token_mean_scale": g["g"].sum() / n, "grad_sample_mean_scale": (seq["gsum"] / seq["n"]).sum() / S,
        "adv_mean": A.loc[g.index].mean(), "adv_frac_zero": (g["advantages"] == 0).mean(),
    }
print(len(out))
"""


def timed(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[float, float, str, float]:
    """Wall seconds, peak RSS (GiB, from the child's own rusage via wait4), stdout and CPU seconds (user +
    system) of a child process."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}): {err.read().decode()[-2000:]}")
        return wall, usage.ru_maxrss / 2**20, out.read().decode(), usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--keep", type=Path, default=None, help="Write the synthetic run here and keep it.")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-pandas", action="store_true")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also time pgdiag from this source tree (a `git worktree` of an older commit), interleaved with the "
        "current one in each repeat (the child runs in PATH: `-m` puts the cwd first on sys.path)",
    )
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="pgdiag-bench-")) if args.keep is None else args.keep
    run = workdir / "run"
    t0 = time.perf_counter()
    # written in a child, so this process stays small (module docstring)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as writer:
        shape = writer.submit(make_run, run, n_tokens=args.tokens, n_steps=args.steps).result()
    print(f"synthetic run: {shape} written in {time.perf_counter() - t0:.1f} s to {run}", file=sys.stderr)
    env = dict(os.environ)
    pgdiag_cmd = [sys.executable, "-m", "pgdiag", "metrics", str(run), "--aggregation", "constant",
                  "--divisor", "40960", "--json", "-q"]  # fmt: skip
    pandas_cmd = [sys.executable, "-c", PANDAS_SCRIPT, str(run)]
    trees = {name: Path(path) for name, path in (t.split("=", 1) for t in args.tree)}
    pgdiag_runs, tree_runs = [], {name: [] for name in trees}
    for _ in range(args.repeats):
        pgdiag_runs.append(timed(pgdiag_cmd, env))
        for name, tree in trees.items():
            tree_runs[name].append(timed(pgdiag_cmd, {**env, "PYTHONPATH": str(tree)}, cwd=tree))
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"this process's peak RSS {own_peak:.2f} GiB (no child's can read lower)", file=sys.stderr)
    for name, runs in {"pgdiag": pgdiag_runs, **tree_runs}.items():
        print(
            f"{name}: wall s {[round(r[0], 2) for r in runs]} (median {statistics.median(r[0] for r in runs):.2f}, "
            f"min {min(r[0] for r in runs):.2f}), CPU s {[round(r[3], 2) for r in runs]} (median "
            f"{statistics.median(r[3] for r in runs):.2f}), peak RSS GiB {[round(r[1], 3) for r in runs]} (max "
            f"{max(r[1] for r in runs):.2f})",
            file=sys.stderr,
        )
    if args.skip_pandas:
        return
    result = json.loads(pgdiag_runs[-1][2])
    pandas_runs = [timed(pandas_cmd, env) for _ in range(max(1, args.repeats - 1))]
    wall = statistics.median(r[0] for r in pgdiag_runs)
    pandas_wall = statistics.median(r[0] for r in pandas_runs)
    print(
        json.dumps(
            {
                "shape": shape,
                "pgdiag_wall_s": [round(r[0], 2) for r in pgdiag_runs],
                "pgdiag_peak_rss_gib": round(max(r[1] for r in pgdiag_runs), 2),
                "pgdiag_n_tokens": result["inputs"]["n_tokens"],
                "pandas_wall_s": [round(r[0], 2) for r in pandas_runs],
                "pandas_peak_rss_gib": round(max(r[1] for r in pandas_runs), 2),
                "speedup_of_medians": round(pandas_wall / wall, 1),
                "cpus": os.cpu_count(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
