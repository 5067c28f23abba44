"""Generate `sample_data/long_run`: 24 steps with a planted jump in the engine mismatch (seeded; reruns
reproduce it exactly), the run `docs/drift.md`'s examples use.

What: a canonical pgdiag run directory of 24 steps x 4 prompt groups x 4 samples (384 samples, responses of
16-48 tokens), streams ``rollout`` (the engine), ``old`` (the trainer before the update) and ``new`` (after
it). Why: `pgdiag drift` needs a run long enough to search (8 steps at least) with a change it must find at a
known step; the other sample runs have 4 steps. How (all numpy, seed 20261127):

* per token a "true" log-prob, mostly near 0 with a tail to -12;
* ``old_logprobs`` = true + fp32-like noise (sd 1e-4); ``rollout_logprobs`` = old + engine noise with sd
  0.01 nats up to step 14 and **ten times larger (0.1) from step 15 on**, as after a weight sync that left the
  engine on stale or differently quantised weights: `pgdiag drift` finds the jump at step 15 in the mismatch
  family (``mismatch/abs_mean`` about 0.008 -> 0.08 nats);
* ``new_logprobs`` = old + a small update step that follows the advantage sign (ratios around 1);
* ``reward`` in {0, 1}, group-normalised ``advantages`` (constant per sample, null off the loss mask).

Run: ``python sample_data/make_long_run.py`` from the repository root (overwrites `sample_data/long_run`).
Only numpy, polars and pyarrow are used (no torch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pgdiag.data.writing import source_meta, stream_meta, write_rollouts  # noqa: E402

SEED = 20261127
STEPS = 24
JUMP_AT = 15  # first step of the larger engine mismatch
GROUPS_PER_STEP = 4
SAMPLES_PER_GROUP = 4
VOCAB = 32000
EOS = 2
ENGINE_NOISE = (0.01, 0.1)  # sd of rollout - old before / from JUMP_AT


def _true_logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    """Mostly near 0 (confident tokens), 15 % from a wide tail, clipped at -12."""
    near = -rng.exponential(0.1, n)
    tail = -rng.exponential(2.0, n)
    return np.clip(np.where(rng.random(n) < 0.15, tail, near), -12.0, -1e-3)


def _with_nulls(values: np.ndarray, prompt_len: int) -> list[float | None]:
    return [None] * prompt_len + [float(v) for v in values.tolist()]


def build_frame(seed: int = SEED) -> pl.DataFrame:
    """The rows of `long_run` (one per sample) as a polars frame."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    for step in range(STEPS):
        engine_sd = ENGINE_NOISE[step >= JUMP_AT]
        for group in range(GROUPS_PER_STEP):
            prompt_len = int(rng.integers(12, 33))
            prompt = rng.integers(3, VOCAB, prompt_len).astype(np.int32)
            rewards = (rng.random(SAMPLES_PER_GROUP) < 0.5).astype(np.float32)
            spread = float(rewards.std())
            advantages = (rewards - rewards.mean()) / (spread if spread > 0 else 1.0)
            for k in range(SAMPLES_PER_GROUP):
                n = int(rng.integers(16, 49))
                response = rng.integers(3, VOCAB, n).astype(np.int32)
                response[-1] = EOS
                true = _true_logprobs(rng, n)
                old = np.minimum(true + rng.normal(0.0, 1e-4, n), -1e-4)
                rollout = np.minimum(old + rng.normal(0.0, engine_sd, n), -1e-4)
                new = np.minimum(old + 0.02 * float(np.sign(advantages[k])) + rng.normal(0.0, 0.01, n), -1e-4)
                rows.append(
                    {
                        "step": step,
                        "sample_id": f"{step}:{group}:{k}",
                        "group_id": f"{step}:{group}",
                        "input_ids": np.concatenate([prompt, response]).tolist(),
                        "prompt_len": prompt_len,
                        "loss_mask": [False] * prompt_len + [True] * n,
                        "rollout_logprobs": _with_nulls(rollout.astype(np.float32), prompt_len),
                        "old_logprobs": _with_nulls(old.astype(np.float32), prompt_len),
                        "new_logprobs": _with_nulls(new.astype(np.float32), prompt_len),
                        "advantages": _with_nulls(np.full(n, advantages[k], dtype=np.float32), prompt_len),
                        "reward": float(rewards[k]),
                        "env": "math",
                        "policy_version": step,
                    }
                )
    return pl.DataFrame(rows)


def main() -> None:
    frame = build_frame()
    out = HERE / "long_run"
    write_rollouts(
        frame,
        out,
        label="long_run",
        source=source_meta("synthetic", framework_version="long-run", src_files=["make_long_run.py"]),
        streams_meta={
            "rollout": stream_meta("rollout_logprobs", tempered=False, logprobs_mode="raw", engine="vllm"),
            "old": stream_meta("old_logprobs", tempered=False, logprobs_mode="raw"),
            "new": stream_meta("new_logprobs", tempered=False, logprobs_mode="raw"),
        },
        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs_mode": "raw"},
        tokenizer={"name": "synthetic", "vocab_size": VOCAB, "tokenizer_len": VOCAB, "sha256": None},
        overwrite=True,
    )
    print(
        f"wrote {out.relative_to(HERE.parent)}: {frame.height} samples, {STEPS} steps, jump at step {JUMP_AT}"
    )


if __name__ == "__main__":
    pa.set_cpu_count(1)
    main()
