"""Time `pgdiag import` on a 10M-response-token dump and report peak RSS (targets in docs/benchmarks.md).

Cases (``--case``):

* ``nemo-rl``: NeMo-RL ``train_data_step<N>.jsonl`` files written as NeMo-RL's logger writes them (one JSON
  line per sample, every value a length-1 list, rows right-padded to a multiple of 8), with generation, prev
  log-probs and broadcast advantages. Target: >= 300k response tokens/s, peak RSS <= 3 GB.
* ``slime``: slime ``--dump-details`` ``rollout_data/<id>.pt`` files (``torch.save`` of ``Sample.to_dict()``
  records: ``tokens``, ``response_length``, ``loss_mask``, ``rollout_log_probs``, ``reward``, ...). Target:
  >= 1M response tokens/s, peak RSS <= 3 GB. Needs the ``slime`` preset (`pgdiag.importers.slime`).

The dump is built once (in ``--dir``, reused when present, else a temp dir), then each repeat imports it in a
fresh subprocess so that peak RSS (``ru_maxrss``) is the import's own. Prints one JSON line per repeat and a
summary line with the median. Wall time depends on what else runs on the machine: the load average before and
after is printed, and the child's CPU time (user + system) with it, which the load changes far less.

    python benchmarks/bench_import.py --case nemo-rl [--response-tokens 10000000] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SAMPLES_PER_STEP = 1024
PROMPT_TOKENS = (120, 280)
RESPONSE_MEDIAN = 900


def _lengths(rng: np.random.Generator, response_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, response) lengths of as many samples as needed for `response_tokens` response tokens."""
    n = int(response_tokens / RESPONSE_MEDIAN * 1.1) + 1
    response = np.clip(rng.lognormal(np.log(RESPONSE_MEDIAN), 0.4, n).astype(np.int64), 8, 4096)
    keep = int(np.searchsorted(np.cumsum(response), response_tokens)) + 1
    response = response[:keep]
    response[-1] -= int(response.sum()) - response_tokens  # exactly `response_tokens`
    prompt = rng.integers(*PROMPT_TOKENS, keep)
    return prompt, response


def build_nemo_rl(directory: Path, response_tokens: int, seed: int = 0) -> int:
    """Write NeMo-RL step files under `directory`; returns the number of response (loss) tokens."""
    rng = np.random.default_rng(seed)
    prompt, response = _lengths(rng, response_tokens)
    directory.mkdir(parents=True, exist_ok=True)
    for step, start in enumerate(range(0, prompt.shape[0], SAMPLES_PER_STEP), start=1):
        p, r = prompt[start : start + SAMPLES_PER_STEP], response[start : start + SAMPLES_PER_STEP]
        width = int(-(-(p + r).max() // 8) * 8)  # make_sequence_length_divisible_by = 8
        rewards = rng.random(p.shape[0]).round(0)
        with open(directory / f"train_data_step{step}.jsonl", "w") as handle:
            for i in range(p.shape[0]):
                n_tok = int(p[i] + r[i])
                ids = np.zeros(width, dtype=np.int64)
                ids[:n_tok] = rng.integers(0, 150000, n_tok)
                mask = np.zeros(width, dtype=np.int64)
                mask[p[i] : n_tok] = 1
                gen = np.zeros(width, dtype=np.float32)
                gen[p[i] : n_tok] = -rng.exponential(0.3, int(r[i])).astype(np.float32) - 1e-4
                prev = np.minimum(gen + rng.normal(-0.02, 0.01, width), -1e-5).astype(np.float32)
                adv = np.full(width, rewards[i] - rewards.mean(), dtype=np.float32)
                line = {
                    "content": [["prompt", "answer"]],
                    "rewards": [float(rewards[i])],
                    "input_lengths": [n_tok],
                    "token_ids": [ids.tolist()],
                    "token_loss_mask": [mask.tolist()],
                    "sample_loss_mask": [1.0],
                    "advantages": [adv.tolist()],
                    "generation_logprobs": [gen.tolist()],
                    "prev_logprobs": [prev.tolist()],
                    "idx": i,
                }
                handle.write(json.dumps(line) + "\n")
    return int(response.sum())


def build_slime(directory: Path, response_tokens: int, seed: int = 0) -> int:
    """Write slime ``rollout_data/<id>.pt`` files under `directory`; returns the response token count."""
    import torch

    rng = np.random.default_rng(seed)
    prompt, response = _lengths(rng, response_tokens)
    (directory / "rollout_data").mkdir(parents=True, exist_ok=True)
    for rollout_id, start in enumerate(range(0, prompt.shape[0], SAMPLES_PER_STEP)):
        samples = []
        for i in range(start, min(start + SAMPLES_PER_STEP, prompt.shape[0])):
            n_resp = int(response[i])
            samples.append(
                {
                    "group_index": i // 8,
                    "index": i,
                    "tokens": rng.integers(0, 150000, int(prompt[i]) + n_resp).tolist(),
                    "response_length": n_resp,
                    "loss_mask": [1] * n_resp,
                    "rollout_log_probs": (-rng.exponential(0.3, n_resp) - 1e-4).tolist(),
                    "reward": float(rng.random() > 0.5),
                    "status": "completed",
                    "weight_versions": [str(rollout_id)],
                }
            )
        torch.save(
            {"rollout_id": rollout_id, "samples": samples}, directory / "rollout_data" / f"{rollout_id}.pt"
        )
    return int(response.sum())


CASES = {"nemo-rl": ("nemo-rl", build_nemo_rl), "slime": ("slime", build_slime)}

_CHILD = """
import json, resource, sys, time
sys.path.insert(0, {repo!r})
import pgdiag
start = time.perf_counter()
result = pgdiag.import_run({preset!r}, {src!r}, {out!r}, overwrite=True)
seconds = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime, "n_samples": result.n_samples,
                  "n_tokens": result.n_tokens, "n_loss_tokens": result.n_loss_tokens,
                  "peak_rss_mib": usage.ru_maxrss / 1024}}))
"""


def run_import(preset: str, src: Path, out: Path) -> dict:
    """One import in a fresh interpreter; its wall time, counts and peak RSS."""
    code = _CHILD.format(repo=str(REPO), preset=preset, src=str(src), out=str(out))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"import failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=sorted(CASES), default="nemo-rl")
    parser.add_argument("--response-tokens", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="keep the dump here (reused when present)")
    args = parser.parse_args()
    preset, build = CASES[args.case]
    module = "pgdiag.importers." + preset.replace("-", "_")
    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"the {preset} preset ({module}) is not in this checkout")
    work = Path(tempfile.mkdtemp(prefix="bench_import_"))
    src = (args.dir or work / "dump") / f"{args.case}-{args.response_tokens}"
    try:
        if not src.exists():
            start = time.perf_counter()
            build(src, args.response_tokens)
            print(f"built {src} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        size_mib = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) / 2**20
        runs = []
        print(json.dumps({"load_avg_1m_before": os.getloadavg()[0]}))
        for repeat in range(args.repeats):
            result = run_import(preset, src, work / "out")
            result.update(
                repeat=repeat,
                case=args.case,
                dump_mib=round(size_mib, 1),
                loss_tokens_per_s=result["n_loss_tokens"] / result["seconds"],
            )
            runs.append(result)
            print(json.dumps(result))
        median = statistics.median(r["seconds"] for r in runs)
        summary = {
            "case": args.case,
            "median_s": round(median, 2),
            "response_tokens_per_s": round(runs[0]["n_loss_tokens"] / median),
            "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 2),
            "peak_rss_mib": round(max(r["peak_rss_mib"] for r in runs)),
            "load_avg_1m_after": os.getloadavg()[0],
        }
        print(json.dumps(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
