"""Benchmark: wall time and peak RSS of `pgdiag check`, `metrics` and `compare` as a run grows (issue 16).

Target on the 2-core, 24 GiB CPU machine: <= 4 GB peak RSS at every size for a run whose steps hold <= 10M
response tokens, and time linear in tokens. Runs of 1M, 10M, 100M and 300M response tokens (`--sizes`) are
generated on disk: max(4, ceil(tokens / 10M)) steps of equal size (so 1M and 10M have 4 steps, 100M has 10 steps
of 10M, 300M has 30), samples of ~200 prompt and ~500 response tokens (lognormal, 8..4000) in GRPO groups of 8,
streams rollout, old and new, per-token advantages. Each step is generated, written with pgdiag's own Parquet
writer (zstd, `rollouts/step=S/`) and dropped, so generating needs one step in memory. Every command runs as a
child process: wall = its wall time, CPU = its user + system time, peak RSS = its own `ru_maxrss` (os.wait4).
The run is deleted after its commands unless `--keep DIR`. The run is written by a child process of its own: on
Linux a child's ru_maxrss starts from its parent's peak RSS (the kernel keeps the parent's high-water mark when
the spawned child calls exec), so writing a step here (0.32 GiB at 10M) set a floor under every measured peak.
The load average before and after each command is recorded: the machine is
shared, and time is only comparable at similar load.

`compare-metrics` is `compare RUN --metrics` (rollout vs old, each run's own metric set beside it) and
`compare-tokens` is `compare RUN --tokens-out RUN.tokens.parquet` (the table is deleted after it is measured).

Run:  python benchmarks/bench_scale.py [--sizes 1M,10M,100M] [--commands check,metrics,compare]
                                       [--keep DIR] [--out bench_scale.json]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

MAX_STEP_TOKENS = 10_000_000
MIN_STEPS = 4
GROUP_SIZE = 8
MEAN_RESPONSE = 500
COMMANDS = {
    "check": ["check", "{run}", "--json", "-q"],
    "metrics": ["metrics", "{run}", "--aggregation", "constant", "--divisor", "40960", "--json", "-q"],
    "compare": ["compare", "{run}", "--json", "-q"],
    "compare-metrics": ["compare", "{run}", "--metrics", "--json", "-q"],
    "compare-tokens": [
        "compare",
        "{run}",
        "--tokens-out",
        "{run}.tokens.parquet",
        "--overwrite",
        "--json",
        "-q",
    ],
    # two runs joined across steps: the run against itself, rollout vs old, paired by seq_hash in any step
    "compare-any-step": [
        "compare",
        "{run}",
        "{run}",
        "--join",
        "hash-any-step",
        "--stream-a",
        "rollout",
        "--stream-b",
        "old",
        "--json",
        "-q",
    ],
    # N-way: three runs (the run three times), rollout on the baseline vs old on the others, and the matrix
    "compare-nway": [
        "compare",
        "{run}",
        "{run}",
        "{run}",
        "--stream-a",
        "rollout",
        "--stream-b",
        "old",
        "--json",
        "-q",
    ],
    # the default grid of whatif (29 rules since issue 25), rollout vs old, with the run's new stream
    "whatif": ["whatif", "{run}", "--json", "-q"],
    # steps of 3,000 documents cut across the run's steps of ~5,000 (10M) or ~15,000 (30M) samples
    "metrics-docs": [
        "metrics",
        "{run}",
        "--docs-per-step",
        "3000",
        "--aggregation",
        "constant",
        "--divisor",
        "40960",
        "--json",
        "-q",
    ],
}


def parse_size(text: str) -> int:
    """'10M' -> 10_000_000, '300k' -> 300_000, '1500000' -> 1_500_000."""
    text = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("kmg")) * scale)


def write_step(
    root: Path, step: int, n_tokens: int, footer: dict, rng: np.random.Generator
) -> tuple[int, int]:
    """Write one step of about `n_tokens` response tokens; returns (samples, response tokens)."""
    from pgdiag.data.seqhash import seq_hashes
    from pgdiag.data.writing import sequence_row_group_rows, write_parquet

    n_samples = max(GROUP_SIZE, n_tokens // MEAN_RESPONSE // GROUP_SIZE * GROUP_SIZE)
    prompt = rng.integers(100, 300, n_samples)
    response = np.clip(rng.lognormal(np.log(MEAN_RESPONSE) - 0.18, 0.6, n_samples), 8, 4000).astype(np.int64)
    lengths = prompt + response  # (S,)
    offsets = np.zeros(n_samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    row = np.repeat(np.arange(n_samples), lengths)  # (T,)
    loss = (np.arange(total) - offsets[:-1][row]) >= prompt[row]  # (T,)
    del row
    old = (-rng.exponential(0.6, total) - 1e-3).astype(np.float32)  # (T,)
    rollout = np.minimum(old + rng.normal(0, 0.01, total).astype(np.float32), np.float32(-1e-4))
    new = np.minimum(old + rng.normal(0, 0.08, total).astype(np.float32), np.float32(-1e-4))
    reward = rng.random(n_samples).astype(np.float32)
    group = np.arange(n_samples) // GROUP_SIZE
    advantage = reward - (np.bincount(group, reward) / GROUP_SIZE)[group].astype(np.float32)
    ids = rng.integers(0, 151_936, total, dtype=np.int32)
    list_offsets = pa.array(offsets.astype(np.int32), pa.int32())

    def lists(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
        return pa.ListArray.from_arrays(
            list_offsets, pa.array(values, mask=None if valid is None else ~valid)
        )

    sample_ids = [f"{step}:{i}" for i in range(n_samples)]
    table = pa.table(
        {
            "run": pa.array(["scale"] * n_samples).dictionary_encode(),
            "step": pa.array(np.full(n_samples, step), pa.int64()),
            "sample_id": pa.array(sample_ids),
            "group_id": pa.array([f"{step}:g{g}" for g in group]),
            "seq_hash": pa.array(seq_hashes(ids, offsets), pa.uint64()),
            "input_ids": lists(ids),
            "prompt_len": pa.array(prompt.astype(np.int32), pa.int32()),
            "loss_mask": lists(loss),
            "rollout_logprobs": lists(rollout, loss),
            "old_logprobs": lists(old, loss),
            "new_logprobs": lists(new, loss),
            "advantages": lists(np.repeat(advantage, lengths), loss),
            "reward": pa.array(reward),
        }
    )
    path = root / "rollouts" / f"step={step}" / "part-00000.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet(
        table, path, metadata=footer, row_group_rows=sequence_row_group_rows(n_samples, table.nbytes)
    )
    return n_samples, int(loss.sum())


def make_scale_run(root: Path, n_tokens: int, seed: int = 0) -> dict[str, int]:
    """Write a run of about `n_tokens` response tokens in steps of <= 10M; returns its shape."""
    from pgdiag.data.schema import ROLLOUTS_SCHEMA
    from pgdiag.data.writing import source_meta, stream_meta

    n_steps = max(MIN_STEPS, math.ceil(n_tokens / MAX_STEP_TOKENS))
    footer = {
        "schema": ROLLOUTS_SCHEMA,
        "alignment": "token",
        "created_by": "benchmarks/bench_scale.py",
        "source": source_meta("synthetic"),
        "streams": {s: stream_meta(f"{s}_logprobs", tempered=False) for s in ("rollout", "old", "new")},
    }
    rng = np.random.default_rng(seed)
    samples = tokens = 0
    for step in range(n_steps):
        n, t = write_step(root, step, n_tokens // n_steps, footer, rng)
        samples, tokens = samples + n, tokens + t
    return {"steps": n_steps, "samples": samples, "response_tokens": tokens}


def timed(cmd: list[str]) -> tuple[float, float, float, int, str]:
    """Wall seconds, CPU seconds (user + system), peak RSS (GiB; the child's own rusage via wait4), exit code
    and stderr tail of a child. CPU time is the figure to compare on a shared machine: it hardly moves with load."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=dict(os.environ))
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        err.seek(0)
        cpu = usage.ru_utime + usage.ru_stime
        return (
            wall,
            cpu,
            usage.ru_maxrss / 2**20,
            os.waitstatus_to_exitcode(status),
            err.read().decode()[-500:],
        )


def git_commit() -> str:
    """The commit of the pgdiag the commands run (the checkout `import pgdiag` finds, PYTHONPATH included)."""
    try:
        import pgdiag

        here = Path(pgdiag.__file__).resolve().parent
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="1M,10M,100M,300M", help="response tokens per run, comma-separated"
    )
    parser.add_argument("--commands", default="check,metrics,compare", help=f"any of {', '.join(COMMANDS)}")
    parser.add_argument(
        "--keep", type=Path, default=None, help="write the runs under this folder and keep them"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_scale.json"), help="JSON results file")
    args = parser.parse_args()
    commands = [c.strip() for c in args.commands.split(",") if c.strip()]
    unknown = [c for c in commands if c not in COMMANDS]
    if unknown:
        raise SystemExit(f"unknown command(s): {', '.join(unknown)}; choose from {', '.join(COMMANDS)}")
    base = args.keep or Path(tempfile.mkdtemp(prefix="pgdiag-bench-scale-"))
    results = []
    try:
        for size in (parse_size(s) for s in args.sizes.split(",")):
            run = base / f"run-{size}"
            start = time.perf_counter()
            if args.keep is not None and (run / "rollouts").exists():
                shape = json.loads((run / "shape.json").read_text())
            else:
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as writer:
                    shape = writer.submit(make_scale_run, run, size).result()  # a child: docstring
                (run / "shape.json").write_text(json.dumps(shape))
            written = time.perf_counter() - start
            print(f"run {size:,}: {shape} written in {written:.0f} s", file=sys.stderr)
            for command in commands:
                argv = [a.format(run=run) for a in COMMANDS[command]]
                load_before = os.getloadavg()
                wall, cpu, rss, code, err = timed([sys.executable, "-m", "pgdiag", *argv])
                row = {
                    "command": command,
                    "response_tokens": shape["response_tokens"],
                    "steps": shape["steps"],
                    "wall_s": round(wall, 2),
                    "s_per_m_tokens": round(wall / shape["response_tokens"] * 1e6, 3),
                    "cpu_s": round(cpu, 2),
                    "cpu_s_per_m_tokens": round(cpu / shape["response_tokens"] * 1e6, 3),
                    "peak_rss_gib": round(rss, 3),
                    "exit_code": code,
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                }
                if code not in (0, 1):
                    row["stderr"] = err
                tokens_out = Path(f"{run}.tokens.parquet")  # compare-tokens' table: its size, then deleted
                if tokens_out.exists():
                    row["tokens_out_mib"] = round(tokens_out.stat().st_size / 2**20, 1)
                    tokens_out.unlink()
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
            if args.keep is None:
                shutil.rmtree(run, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    header = (
        f"{'command':<15} {'tokens':>12} {'steps':>5} {'wall s':>8} {'s/M tok':>8} {'cpu s':>8} {'cpu s/M':>8} "
        f"{'peak GiB':>9} {'exit':>4}"
    )
    print(header)
    for r in results:
        print(
            f"{r['command']:<15} {r['response_tokens']:>12,} {r['steps']:>5} {r['wall_s']:>8.1f} "
            f"{r['s_per_m_tokens']:>8.3f} {r['cpu_s']:>8.1f} {r['cpu_s_per_m_tokens']:>8.3f} "
            f"{r['peak_rss_gib']:>9.2f} {r['exit_code']:>4}"
        )
    meta = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": git_commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "results": results,
    }
    args.out.write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
