"""Small in-memory `TokenBatch`es and rollout files with known log-probs, for the compare tests.

`make_batch(samples, label=...)` builds a batch from explicit per-sample dicts; `random_samples(seed, n)` makes
samples whose every response position is a loss position, with `rollout` log-probs drawn from a tempered
softmax over random logits (so temperature faults are realistic) and an `old` stream equal to it (identical
runs) unless a test perturbs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pgdiag.data.batch import TokenBatch


def make_batch(samples: list[dict[str, Any]], *, label: str = "a") -> TokenBatch:
    """Samples: dict(step, sample_id, input_ids, prompt_len, loss (list of positions), streams {name: values
    per loss position}, optional entropy {name: values}, reward, env)."""
    n = len(samples)
    counts = np.array([len(s["loss"]) for s in samples], dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    pos = (
        np.concatenate([np.asarray(s["loss"], dtype=np.int32) for s in samples])
        if n
        else np.zeros(0, np.int32)
    )
    token_id = np.concatenate(
        [np.asarray(s["input_ids"], dtype=np.int32)[np.asarray(s["loss"], dtype=np.int64)] for s in samples]
    )
    names = list(samples[0]["streams"]) if n else []
    streams = {
        k: np.concatenate([np.asarray(s["streams"][k], dtype=np.float64) for s in samples]) for k in names
    }
    ent_names = list(samples[0].get("entropy", {})) if n else []
    entropy = {
        k: np.concatenate([np.asarray(s["entropy"][k], dtype=np.float64) for s in samples]) for k in ent_names
    }
    has_env = n and "env" in samples[0]
    return TokenBatch(
        label=label,
        step=np.array([s["step"] for s in samples], dtype=np.int64),
        sample_id=np.array([s["sample_id"] for s in samples], dtype=object),
        segment_idx=np.zeros(n, dtype=np.int32),
        group=np.zeros(n, dtype=np.int64),
        group_names=np.array(["g0"], dtype=object),
        prompt_len=np.array([s["prompt_len"] for s in samples], dtype=np.int32),
        seq_len=np.array([len(s["input_ids"]) for s in samples], dtype=np.int32),
        offsets=offsets,
        pos=pos,
        token_id=token_id,
        streams=streams,
        entropy=entropy,
        reward=np.array([s.get("reward", np.nan) for s in samples], dtype=np.float64),
        env=np.array([s["env"] for s in samples], dtype=object) if has_env else None,
    )


def _log_softmax(z: np.ndarray) -> np.ndarray:
    top = z.max(axis=-1, keepdims=True)
    return z - top - np.log(np.exp(z - top).sum(axis=-1, keepdims=True))


def random_samples(
    seed: int,
    n: int,
    *,
    vocab: int = 40,
    steps: int = 2,
    temperature_a: float = 1.0,
    max_response: int = 24,
) -> list[dict[str, Any]]:
    """n samples over `steps` steps; `rollout` = log-prob under softmax(z / temperature_a) of a token drawn from
    it, `old` = log-prob under softmax(z) of the same token, `logits` kept per sample for exact tests."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        prompt_len = int(rng.integers(2, 6))
        resp = int(rng.integers(3, max_response))
        z = rng.normal(0.0, 3.0, size=(resp, vocab))  # (T_resp, V) logits of the response positions
        lp_sample = _log_softmax(z / temperature_a)
        lp_plain = _log_softmax(z)
        tokens = np.array([rng.choice(vocab, p=np.exp(row)) for row in lp_sample])
        ids = np.concatenate([rng.integers(0, vocab, size=prompt_len), tokens])
        loss = list(range(prompt_len, prompt_len + resp))
        idx = np.arange(resp)
        samples.append(
            {
                "step": i % steps,
                "sample_id": f"s{i}",
                "input_ids": ids.tolist(),
                "prompt_len": prompt_len,
                "loss": loss,
                "streams": {"rollout": lp_sample[idx, tokens], "old": lp_plain[idx, tokens]},
                "entropy": {"old": -(np.exp(lp_plain) * lp_plain).sum(axis=-1)},
                "reward": float(rng.normal()),
                "env": "math" if i % 3 else "code",
                "logits": z,
            }
        )
    return samples


def identical_pair(seed: int, n: int) -> tuple[TokenBatch, TokenBatch]:
    """Two runs with the same tokens and the same `rollout` stream (the `old` stream of run b = run a's)."""
    samples = random_samples(seed, n)
    return make_batch(samples, label="a"), make_batch(samples, label="b")


def rollout_rows(samples: list[dict[str, Any]], *, run: str, streams: dict[str, str]) -> list[dict[str, Any]]:
    """Canonical rollout rows (full-length lists, null off the loss mask) for `tests/rollout_factory.py`;
    `streams` maps a file column (``rollout_logprobs``) to a sample stream name."""
    rows = []
    for s in samples:
        length = len(s["input_ids"])
        mask = [False] * length
        for p in s["loss"]:
            mask[p] = True
        row: dict[str, Any] = {
            "run": run,
            "step": s["step"],
            "sample_id": s["sample_id"],
            "group_id": "g0",
            "input_ids": s["input_ids"],
            "prompt_len": s["prompt_len"],
            "loss_mask": mask,
            "reward": s["reward"],
            "env": s["env"],
        }
        for column, name in streams.items():
            values: list[float | None] = [None] * length
            for p, v in zip(s["loss"], s["streams"][name], strict=True):
                values[p] = float(v)
            row[column] = values
        rows.append(row)
    return rows


def write_run(path: Path, samples: list[dict[str, Any]], *, run: str, streams: dict[str, str]) -> Path:
    """A single-file run at `path` (a .parquet file) holding `samples`."""
    from rollout_factory import write_rollouts_file

    path.parent.mkdir(parents=True, exist_ok=True)
    write_rollouts_file(path, rollout_rows(samples, run=run, streams=streams))
    return path
