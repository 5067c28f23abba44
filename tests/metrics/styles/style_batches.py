"""Small explicit `TokenBatch`es for the key-style tests, and the worked example of docs/metrics.md.

Token-level inputs are given per sample as Python lists (loss positions only, so a masked token is simply
left out); `make_batch` flattens them the way `pgdiag.data.load.read_token_batch` lays out a real batch.
"""

from __future__ import annotations

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.metrics.settings import MetricSettings

Rows = list[list[float]]


def make_batch(
    *,
    new: Rows,
    old: Rows | None = None,
    adv: Rows | None = None,
    rollout: Rows | None = None,
    ref: Rows | None = None,
    entropy: Rows | None = None,
    reward: list[float] | None = None,
    group: list[int] | None = None,
    sample_id: list[str] | None = None,
    response_len: list[int] | None = None,
) -> TokenBatch:
    """A one-step batch with one row per list in `new`; streams are named new, old, rollout, ref."""
    n_samples = len(new)
    lengths = np.array([len(row) for row in new], dtype=np.int64)
    offsets = np.zeros(n_samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def flat(rows: Rows) -> np.ndarray:
        assert [len(r) for r in rows] == lengths.tolist()
        return np.array([x for row in rows for x in row], dtype=np.float64)

    streams = {"new": flat(new)}
    for name, rows in (("old", old), ("rollout", rollout), ("ref", ref)):
        if rows is not None:
            streams[name] = flat(rows)
    groups = np.array(group if group is not None else list(range(n_samples)), dtype=np.int64)
    response = np.array(response_len if response_len is not None else lengths, dtype=np.int32)
    prompt = np.full(n_samples, 5, dtype=np.int32)
    return TokenBatch(
        label="test",
        step=np.zeros(n_samples, dtype=np.int64),
        sample_id=np.array(sample_id or [f"s{i}" for i in range(n_samples)], dtype=object),
        segment_idx=np.zeros(n_samples, dtype=np.int32),
        group=groups,
        group_names=np.array(
            [f"g{g}" for g in range(int(groups.max()) + 1 if n_samples else 0)], dtype=object
        ),
        prompt_len=prompt,
        seq_len=prompt + response,
        offsets=offsets,
        pos=np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
        if n_samples
        else np.zeros(0, np.int32),
        token_id=np.zeros(int(offsets[-1]), dtype=np.int32),
        streams=streams,
        entropy={} if entropy is None else {"new": flat(entropy)},
        advantages=None if adv is None else flat(adv),
        reward=None if reward is None else np.array(reward, dtype=np.float64),
    )


def settings_for(style: str, batch: TokenBatch, **overrides: object) -> MetricSettings:
    """Settings of `style` with the roles of docs/key-styles.md: policy pair (old → new), mismatch pair
    (rollout → old) when a rollout stream exists, ref and entropy when present."""
    has_rollout = "rollout" in batch.streams
    base: dict[str, object] = {
        "new": "new",
        "old": "old" if "old" in batch.streams else None,
        "stream_a": "rollout" if has_rollout else None,
        "stream_b": "old" if has_rollout else None,
        "ref": "ref" if "ref" in batch.streams else None,
        "entropy": "new" if batch.entropy else None,
        "key_style": style,
    }
    base.update(overrides)
    return MetricSettings.from_options(**base)


def worked_example() -> TokenBatch:
    """The worked example: two groups × two samples, ε = 0.2, the masked third token of s3 left out."""
    return make_batch(
        old=[[-1.0, -2.0, -0.5], [-0.3, -1.5, -3.0, -0.9], [-0.7, -1.2, -0.4], [-1.1, -0.3, -2.0]],
        new=[[-1.0, -1.7, -0.8], [-0.05, -1.8, -2.95, -0.9], [-0.5, -1.25, -0.3], [-1.35, -0.3, -1.85]],
        adv=[[1.0] * 3, [-1.0] * 4, [0.5] * 3, [-0.5] * 3],
        group=[0, 0, 1, 1],
    )


def values_of(metrics: object) -> dict[str, float | None]:
    """key -> value of a `StepMetrics` (or anything with `.values` of `MetricValue`)."""
    return {v.key: v.value for v in metrics.values}  # type: ignore[attr-defined]
