"""Generate the synthetic runs `sample_data/synthetic_a` and `synthetic_b` (seeded; reruns reproduce them exactly).

What: two canonical pgdiag run directories of 4 steps x 8 prompt groups x 4
samples, for tests and examples that need controlled statistics without a model (``run_a``/``run_b`` come
from a real tiny model, see ``make_tiny_qwen.py``). Why synthetic: every distribution below is known, so a
test can assert what pgdiag must find. How (all numpy, seed 20261121):

* prompts of 24-160 tokens; responses log-normal in length (median ~120, tail to 700 tokens);
* half the groups are ``tool`` env samples whose responses hold 1-3 tool-observation spans (loss_mask false
  in the middle of the response), the other half ``math``;
* a "true" per-token log-prob that is mostly near 0 with a long tail down to -15;
* ``rollout_logprobs`` (the engine) = true + bf16-like noise (sd ~0.01 nats, heavy Student-t tail);
  ``old_logprobs`` (trainer before the update) = true + small fp32 noise, so |Δ| is ~1e-2 nats typically;
* ``new_logprobs`` = old + an update step correlated with the advantage sign (ratios around 1, a few percent
  outside the 0.8-1.2 band);
* ``reward`` in [0, 1] and group-normalised ``advantages`` (constant per sample, null off the loss mask);
* synthetic_b is a second trainer on the same rollouts: identical ids, masks, rollout log-probs and rewards, but its
  own old/new numerics (bf16-rounded trainer log-probs), so ``pgdiag compare synthetic_a synthetic_b`` has a real, small
  difference to find. Both runs pass ``pgdiag check`` cleanly.

Run: ``python sample_data/make_sample_data.py`` from the repository root (overwrites both runs).
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

SEED = 20261121
STEPS = 4
GROUPS_PER_STEP = 8
SAMPLES_PER_GROUP = 4
VOCAB = 32000
EOS = 2
TOOL_TOKEN_RANGE = (31000, 31900)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 precision (8 significant bits), round-to-nearest-even."""
    bits = x.astype(np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) & np.uint32(0xFFFF0000)).view(np.float32)


def _true_logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    """Mostly near 0 (confident tokens), 12 % from a wide tail, clipped at -15."""
    near = -rng.exponential(0.08, n)
    tail = -rng.exponential(2.5, n)
    lp = np.where(rng.random(n) < 0.12, tail, near)
    return np.clip(lp, -15.0, -1e-4)


def _sample_layout(rng: np.random.Generator, env: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Token ids, loss mask and prompt length of one sample."""
    prompt_len = int(rng.integers(24, 161))
    response_len = int(np.clip(rng.lognormal(np.log(120), 0.6), 8, 700))
    ids = rng.integers(3, TOOL_TOKEN_RANGE[0], prompt_len + response_len).astype(np.int32)
    mask = np.zeros(prompt_len + response_len, dtype=bool)
    mask[prompt_len:] = True
    if env == "tool" and response_len > 40:
        for _ in range(int(rng.integers(1, 4))):
            span = int(rng.integers(5, 30))
            start = int(rng.integers(prompt_len + 4, prompt_len + response_len - span - 2))
            mask[start : start + span] = False
            ids[start : start + span] = rng.integers(*TOOL_TOKEN_RANGE, span)
    if rng.random() < 0.85:
        ids[-1] = EOS
    return ids, mask, prompt_len


def _with_nulls(values: np.ndarray, mask: np.ndarray) -> list[float | None]:
    return [float(v) if m else None for v, m in zip(values.tolist(), mask.tolist(), strict=True)]


def build_frames(seed: int = SEED) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rows of synthetic_a and synthetic_b as polars frames (same tokens, different trainer numerics)."""
    rng = np.random.default_rng(seed)
    rows_a: list[dict] = []
    rows_b: list[dict] = []
    for step in range(STEPS):
        for group in range(GROUPS_PER_STEP):
            env = "tool" if group % 2 else "math"
            layouts = [_sample_layout(rng, env) for _ in range(SAMPLES_PER_GROUP)]
            rewards = np.round(rng.beta(0.8, 0.8, SAMPLES_PER_GROUP), 3).astype(np.float32)
            std = rewards.std()
            adv = (rewards - rewards.mean()) / std if std > 0 else np.zeros_like(rewards)
            for k, (ids, mask, prompt_len) in enumerate(layouts):
                n = ids.shape[0]
                true = _true_logprobs(rng, n)
                engine_noise = rng.normal(0.0, 0.008, n) + 0.004 * rng.standard_t(2.5, n)
                rollout = np.minimum(true + engine_noise, -1e-5).astype(np.float32)
                rollout = _bf16_round(rollout)
                old_a = np.minimum(true + rng.normal(0.0, 1e-3, n), -1e-5).astype(np.float32)
                update = 0.03 * np.sign(adv[k]) + rng.normal(0.0, 0.06, n) + 0.02 * rng.standard_t(3, n)
                new_a = np.minimum(old_a + update, -1e-5).astype(np.float32)
                old_b = np.minimum(_bf16_round(old_a + rng.normal(0.0, 2e-3, n).astype(np.float32)), -1e-5)
                new_b = np.minimum(_bf16_round(new_a + rng.normal(0.0, 2e-3, n).astype(np.float32)), -1e-5)
                sample_id = f"{step}:{group * SAMPLES_PER_GROUP + k}"
                common = {
                    "step": step,
                    "sample_id": sample_id,
                    "group_id": f"{step}:g{group}",
                    "input_ids": ids.tolist(),
                    "prompt_len": prompt_len,
                    "loss_mask": mask.tolist(),
                    "rollout_logprobs": _with_nulls(rollout, mask),
                    "advantages": _with_nulls(np.full(n, adv[k], dtype=np.float32), mask),
                    "reward": float(rewards[k]),
                    "finish_reason": "stop" if ids[-1] == EOS else "length",
                    "policy_version": step,
                    "env": env,
                }
                rows_a.append(
                    {
                        **common,
                        "old_logprobs": _with_nulls(old_a, mask),
                        "new_logprobs": _with_nulls(new_a, mask),
                    }
                )
                rows_b.append(
                    {
                        **common,
                        "old_logprobs": _with_nulls(old_b, mask),
                        "new_logprobs": _with_nulls(new_b, mask),
                    }
                )
    schema = {
        "step": pl.Int64,
        "sample_id": pl.String,
        "group_id": pl.String,
        "input_ids": pl.List(pl.Int32),
        "prompt_len": pl.Int32,
        "loss_mask": pl.List(pl.Boolean),
        "rollout_logprobs": pl.List(pl.Float32),
        "advantages": pl.List(pl.Float32),
        "reward": pl.Float32,
        "finish_reason": pl.String,
        "policy_version": pl.Int64,
        "env": pl.String,
        "old_logprobs": pl.List(pl.Float32),
        "new_logprobs": pl.List(pl.Float32),
    }
    return pl.DataFrame(rows_a, schema=schema), pl.DataFrame(rows_b, schema=schema)


def main() -> None:
    frame_a, frame_b = build_frames()
    sampling = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "logprobs_mode": "raw",
        "engine": "vllm",
    }
    streams = {
        "rollout": stream_meta("rollout_logprobs", tempered=False, logprobs_mode="raw", engine="vllm"),
        "old": stream_meta("old_logprobs", tempered=False, logprobs_mode="raw"),
        "new": stream_meta("new_logprobs", tempered=False, logprobs_mode="raw"),
    }
    tokenizer = {"name": "synthetic", "vocab_size": VOCAB, "tokenizer_len": VOCAB, "sha256": None}
    runs = (("synthetic_a", frame_a, "trainer-a fp32"), ("synthetic_b", frame_b, "trainer-b bf16"))
    for label, frame, engine in runs:
        out = HERE / label
        write_rollouts(
            frame,
            out,
            label=label,
            source=source_meta("synthetic", framework_version=engine, src_files=["make_sample_data.py"]),
            streams_meta=streams,
            sampling=sampling,
            tokenizer=tokenizer,
            overwrite=True,
        )
        print(f"wrote {out.relative_to(HERE.parent)}: {frame.height} samples")


if __name__ == "__main__":
    pa.set_cpu_count(1)
    main()
