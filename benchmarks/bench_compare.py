"""Benchmark: `pgdiag compare` of two runs of ~10M response tokens each vs a hand-written pandas version.

What: writes two canonical rollout files (20,000 samples, prompts 50-150 tokens, responses 300-700 tokens, so
~10M loss tokens per run; run b's log-probs = −|run a's + N(0, 0.02)|), then times, each in a
fresh subprocess (so peak RSS is the child's own `ru_maxrss`):
  * pgdiag: `compare_runs(read_run(a), read_run(b))` with its defaults: read, validate, align and check,
    parity at token and sequence scope, every breakdown the data supports (position, prob bucket, length, step),
    the Δ histogram, diagnosis, worst-K;
  * pandas: what users write by hand today: read both files, explode the list columns, keep loss tokens, merge on
    (step, sample_id, pos), then the headline parity numbers and mean |Δ| by position / prob bucket / step;
  * pandas-full: the same start, then what pgdiag reports: the token and sequence tables and four breakdowns
    with the same statistics (like for like).
Why: the target is <= 10 s wall and <= 4 GB peak RSS on the 2-core CPU machine, >= 5x pandas.
Each child also reports its CPU seconds (user + system; pgdiag's children also each apart, as the system time,
spent first touching memory, swings by ±0.6 s from run to run on this VM): on a shared machine wall time swings
with the load, CPU time much less; the load average is printed beside the table.
How: ``python benchmarks/bench_compare.py [--samples 20000] [--repeat 2] [--dir /tmp/pgdiag-bench-compare]
[--tree NAME=PATH ...]``; files are reused when present; `--tree` times older source trees beside the current one. Prints a markdown table (median of the repeats) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PGDIAG_CHILD = """
import sys, time, json
t0 = time.perf_counter()
from pgdiag.compare.api import compare_runs
try:
    from pgdiag.data.runs import read_run
except ImportError:  # a tree of before the data/ folder (--tree NAME=PATH)
    from pgdiag.runs import read_run
report = compare_runs(read_run(sys.argv[1]), read_run(sys.argv[2]))  # default breakdowns
report = getattr(report, "report", report)
wall = time.perf_counter() - t0
value = report.value("mismatch/abs_mean", scope="token")
import resource
usage = resource.getrusage(resource.RUSAGE_SELF)
peak, cpu = usage.ru_maxrss / 1024.0, usage.ru_utime + usage.ru_stime
import pgdiag
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "user_s": usage.ru_utime, "sys_s": usage.ru_stime, "abs_mean": value,
                  "rows": report.summary.height, "peak_rss_mib": peak, "source": pgdiag.__file__}))
"""

PANDAS_CHILD = """
import sys, time, json
t0 = time.perf_counter()
import numpy as np, pandas as pd

def tokens(path):
    df = pd.read_parquet(path, columns=["step", "sample_id", "prompt_len", "loss_mask", "rollout_logprobs"])
    df["pos"] = df["loss_mask"].map(lambda m: np.arange(len(m)))
    ex = df.explode(["loss_mask", "rollout_logprobs", "pos"])
    ex = ex[ex["loss_mask"].astype(bool)]
    ex["lp"] = ex["rollout_logprobs"].astype("float64")
    ex["pos"] = ex["pos"].astype("int64")
    ex["resp_pos"] = ex["pos"] - ex["prompt_len"]
    return ex[["step", "sample_id", "pos", "resp_pos", "lp"]]

a, b = tokens(sys.argv[1]), tokens(sys.argv[2])
m = a.merge(b[["step", "sample_id", "pos", "lp"]], on=["step", "sample_id", "pos"], suffixes=("_a", "_b"))
d = m["lp_b"] - m["lp_a"]
ad = d.abs()
rho = np.exp(d)
out = {
    "bias": d.mean(), "sd": d.std(ddof=0), "rms": float(np.sqrt((d * d).mean())), "abs_mean": ad.mean(),
    "p50": ad.quantile(0.5), "p95": ad.quantile(0.95), "p99": ad.quantile(0.99), "max": ad.max(),
    "k3": (rho - 1 - d).mean(), "tmpe": np.exp(ad).mean(), "pearson": m["lp_a"].corr(m["lp_b"]),
    "frac_out_clip": ((rho < 0.8) | (rho > 1.2)).mean(),
}
m["ad"] = ad
m["pos_bucket"] = np.floor(np.log2(m["resp_pos"] + 1))
m["prob_bucket"] = pd.cut(np.exp(m["lp_a"]), [0, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0], include_lowest=True)
by_pos = m.groupby("pos_bucket")["ad"].agg(["mean", "count"])
by_prob = m.groupby("prob_bucket", observed=True)["ad"].agg(["mean", "count"])
by_step = m.groupby("step")["ad"].agg(["mean", "count"])
seq = m.groupby(["step", "sample_id"]).agg(sa=("lp_a", "mean"), sb=("lp_b", "mean"))
seq_abs = (seq["sb"] - seq["sa"]).abs().mean()
wall = time.perf_counter() - t0
import resource
usage = resource.getrusage(resource.RUSAGE_SELF)
peak, cpu = usage.ru_maxrss / 1024.0, usage.ru_utime + usage.ru_stime
rows = len(by_pos) + len(by_prob) + len(by_step)
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "abs_mean": float(out["abs_mean"]), "rows": rows, "peak_rss_mib": peak}))
"""


# The same outputs as pgdiag (token and sequence tables, four breakdowns with the same statistics), by hand.
PANDAS_FULL_CHILD = (
    PANDAS_CHILD.split("out = {")[0]
    + """
def table(lp_a, lp_b):
    d = lp_b - lp_a
    ad = d.abs()
    rho = np.exp(d)
    pa, pb = np.exp(lp_a), np.exp(lp_b)
    slope = np.cov(lp_a, lp_b, ddof=0)[0, 1] / lp_a.var(ddof=0)
    out = {"bias": d.mean(), "sd": d.std(ddof=0), "rms": float(np.sqrt((d * d).mean())), "abs_mean": ad.mean(),
           "abs_p50": ad.quantile(0.5), "abs_p95": ad.quantile(0.95), "abs_p99": ad.quantile(0.99),
           "abs_max": ad.max(), "pearson_r": lp_a.corr(lp_b), "fit_slope": slope,
           "fit_intercept": lp_b.mean() - slope * lp_a.mean(), "kl_k1": -d.mean(), "kl_k3": (rho - 1 - d).mean(),
           "kl_rev_k1": (rho * d).mean(), "kl_rev_k3": (1 - rho + rho * d).mean(), "tmpe": np.exp(ad).mean(),
           "chi2": (rho * rho).mean() - 1, "ess": rho.sum() ** 2 / (len(d) * (rho * rho).sum()),
           "abs_dprob_mean": (pb - pa).abs().mean(), "abs_dprob_p99": (pb - pa).abs().quantile(0.99),
           "prob_pearson_r": pa.corr(pb)}
    for name, lo, hi in (("strict", 0.999, 1.002), ("1pct", 0.99, 1.01), ("10pct", 0.9, 1.1),
                         ("clip", 0.8, 1.2), ("2x", 0.5, 2.0)):
        out["frac_out_" + name] = ((rho < lo) | (rho > hi)).mean()
    return out

tok = table(m["lp_a"], m["lp_b"])
seq = m.groupby(["step", "sample_id"]).agg(a=("lp_a", "mean"), b=("lp_b", "mean"), n=("lp_a", "size"))
seq_table = table(seq["a"], seq["b"])
m["d"] = m["lp_b"] - m["lp_a"]
m["ad"] = m["d"].abs()
m["k3"] = np.exp(m["d"]) - 1 - m["d"]
m["tmpe"] = np.exp(m["ad"])
m["adp"] = (np.exp(m["lp_b"]) - np.exp(m["lp_a"])).abs()
for name, lo, hi in (("10pct", 0.9, 1.1), ("clip", 0.8, 1.2), ("2x", 0.5, 2.0)):
    m["out_" + name] = (m["d"] < np.log(lo)) | (m["d"] > np.log(hi))
m["pos_bucket"] = np.floor(np.log2(m["resp_pos"] + 1))
m["prob_bucket"] = pd.cut(np.exp(m["lp_a"]), [0, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0], include_lowest=True)
m["len_bucket"] = np.floor(np.log2(m.groupby(["step", "sample_id"])["d"].transform("size")))
rows = 0
for key in ("pos_bucket", "prob_bucket", "len_bucket", "step"):
    g = m.groupby(key, observed=True)
    agg = g.agg(n=("d", "size"), bias=("d", "mean"), sd=("d", "std"), rms=("d", lambda x: np.sqrt((x * x).mean())),
                abs_mean=("ad", "mean"), abs_max=("ad", "max"), kl_k3=("k3", "mean"), tmpe=("tmpe", "mean"),
                adp=("adp", "mean"), o10=("out_10pct", "mean"), oclip=("out_clip", "mean"), o2x=("out_2x", "mean"))
    q = g["ad"].quantile([0.5, 0.95, 0.99]).unstack()
    rows += agg.size + q.size
wall = time.perf_counter() - t0
import resource
usage = resource.getrusage(resource.RUSAGE_SELF)
peak, cpu = usage.ru_maxrss / 1024.0, usage.ru_utime + usage.ru_stime
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "abs_mean": float(tok["abs_mean"]), "rows": rows, "peak_rss_mib": peak}))
"""
)


def write_runs(directory: Path, n_samples: int, seed: int = 0) -> tuple[Path, Path]:
    """Two canonical single-file runs with identical tokens and slightly different rollout log-probs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pgdiag.data.schema import ROLLOUTS_SCHEMA, encode_footer
    from pgdiag.data.seqhash import seq_hashes

    paths = (directory / "run_a.parquet", directory / "run_b.parquet")
    if all(p.exists() for p in paths):
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(50, 151, size=n_samples)
    response = rng.integers(300, 701, size=n_samples)
    length = prompt + response
    offsets = np.zeros(n_samples + 1, dtype=np.int64)
    np.cumsum(length, out=offsets[1:])
    total = int(offsets[-1])
    ids = rng.integers(0, 151_000, size=total).astype(np.int32)
    pos = np.arange(total) - np.repeat(offsets[:-1], length)
    loss = pos >= np.repeat(prompt, length)  # (total,) response positions
    lp_a = (-rng.exponential(0.6, size=total) - 1e-4).astype(np.float32)  # never exactly 0 (E206)
    lp_b = (-np.abs(lp_a + rng.normal(0.0, 0.02, size=total)) - 1e-4).astype(np.float32)
    hashes = seq_hashes(ids, offsets)
    footer = {
        "schema": ROLLOUTS_SCHEMA,
        "alignment": "token",
        "created_by": "pgdiag benchmarks",
        "source": {"framework": "bench", "preset": "canonical", "retokenized": False, "unsafe_load": False},
        "streams": {"rollout": {"source_field": "synthetic", "tempered": False, "logprobs_mode": "raw"}},
    }

    def lists(values: pa.Array) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)

    for path, lp, run in ((paths[0], lp_a, "engine"), (paths[1], lp_b, "trainer")):
        table = pa.table(
            {
                "run": pa.array([run] * n_samples).dictionary_encode(),
                "step": pa.array(np.arange(n_samples) // (n_samples // 10), type=pa.int64()),
                "sample_id": pa.array([f"s{i}" for i in range(n_samples)]),
                "group_id": pa.array([f"g{i // 8}" for i in range(n_samples)]),
                "seq_hash": pa.array(hashes, type=pa.uint64()),
                "input_ids": lists(pa.array(ids)),
                "prompt_len": pa.array(prompt.astype(np.int32)),
                "loss_mask": lists(pa.array(loss)),
                "rollout_logprobs": lists(pa.array(lp, mask=~loss)),
            }
        )
        pq.write_table(table.replace_schema_metadata(encode_footer(footer)), path, compression="zstd")
    return paths


def run_child(code: str, a: Path, b: Path, tree: Path | None = None) -> dict:
    """Run `code` in a fresh interpreter (importing pgdiag from `tree` when given); its wall time and peak RSS
    (MiB, the child's own ru_maxrss)."""
    env = dict(os.environ) if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    done = subprocess.run(  # cwd: `python -c` puts it first on sys.path, so it picks the tree imported
        [sys.executable, "-c", code, str(a), str(b)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=None if tree is None else tree,
    )
    outer = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = outer
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pgdiag-bench-compare"))
    parser.add_argument("--skip-pandas", action="store_true")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also time pgdiag from this source tree (e.g. a `git worktree` of an older commit), interleaved "
        "with the current one in each repeat: old and new side by side under the same load",
    )
    args = parser.parse_args()
    a, b = write_runs(args.dir, args.samples)
    load_before = os.getloadavg()
    trees = {name: Path(path) for name, path in (t.split("=", 1) for t in args.tree)}
    results: dict[str, list[dict]] = {"pgdiag": [], **{f"pgdiag {n}": [] for n in trees}}
    results.update({"pandas": [], "pandas-full": []})
    for _ in range(args.repeat):
        results["pgdiag"].append(run_child(PGDIAG_CHILD, a, b))
        for name, tree in trees.items():
            results[f"pgdiag {name}"].append(run_child(PGDIAG_CHILD, a, b, tree))
    if not args.skip_pandas:
        for _ in range(args.repeat):
            results["pandas"].append(run_child(PANDAS_CHILD, a, b))
            results["pandas-full"].append(run_child(PANDAS_FULL_CHILD, a, b))
    print(
        "| implementation | wall s (median; min) | CPU s (median) | user / system s (median) | process s (median) "
        "| peak RSS MiB | mean abs Δ |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        if not runs:
            continue
        wall = statistics.median(r["wall_s"] for r in runs)
        fastest = min(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        proc = statistics.median(r["process_s"] for r in runs)
        rss = max(r["peak_rss_mib"] for r in runs)
        split = "-"  # pgdiag children only: the system time (first-touched memory) swings most on a VM
        if "user_s" in runs[0]:
            user, system = (statistics.median(r[key] for r in runs) for key in ("user_s", "sys_s"))
            split = f"{user:.2f} / {system:.2f}"
        print(
            f"| {name} | {wall:.2f}; {fastest:.2f} | {cpu:.2f} | {split} | {proc:.2f} | {rss:.0f} "
            f"| {runs[0]['abs_mean']:.6g} |"
        )
    print(f"load average before/after: {load_before} / {os.getloadavg()}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
