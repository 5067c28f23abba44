"""Build small `TokenBatch`es for the metric tests from per-sample Python lists.

Every list holds one entry per sample (row); token streams are lists of per-token values of the loss
positions only (a TokenBatch keeps loss positions only). An advantage may be a scalar per sample, which is
broadcast over its tokens as the reader does. Named `metrics_batch_factory` (not `batch_factory`) because
pytest's rootdir-less imports would otherwise collide with tests/compare/batch_factory.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pgdiag.data.batch import TokenBatch

Tokens = Sequence[Sequence[float]]


def make_batch(
    *,
    new: Tokens | None = None,
    old: Tokens | None = None,
    rollout: Tokens | None = None,
    ref: Tokens | None = None,
    advantages: Sequence[float | Sequence[float]] | None = None,
    entropy: Tokens | None = None,
    groups: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    sample_ids: Sequence[str] | None = None,
    reward: Sequence[float] | None = None,
    lengths: Sequence[int] | None = None,
) -> TokenBatch:
    """A batch with streams ``new``/``old``/``rollout``/``ref`` and entropy tag ``rc`` where given."""
    streams_in = {"new": new, "old": old, "rollout": rollout, "ref": ref}
    given = [v for v in (*streams_in.values(), entropy) if v is not None]
    if lengths is None:
        lengths = [len(s) for s in given[0]] if given else []
    n = len(lengths)
    counts = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])

    def flat(per_sample: Tokens) -> np.ndarray:
        assert [len(s) for s in per_sample] == list(lengths), "every stream needs the same lengths"
        return np.asarray([x for s in per_sample for x in s], dtype=np.float64).reshape(-1)

    adv = None
    if advantages is not None:
        adv_rows = [
            [float(a)] * int(length) if np.isscalar(a) else list(a)
            for a, length in zip(advantages, lengths, strict=True)
        ]
        adv = flat(adv_rows)
    group_labels = list(groups) if groups is not None else [f"g{i}" for i in range(n)]
    group_names, group_codes = np.unique(np.asarray(group_labels, dtype=object), return_inverse=True)
    m = int(offsets[-1])
    return TokenBatch(
        label="test",
        step=np.asarray(steps if steps is not None else [0] * n, dtype=np.int64),
        sample_id=np.asarray(
            sample_ids if sample_ids is not None else [f"s{i}" for i in range(n)], dtype=object
        ),
        segment_idx=np.zeros(n, dtype=np.int32),
        group=np.asarray(group_codes, dtype=np.int64).reshape(-1),
        group_names=np.asarray(group_names, dtype=object),
        prompt_len=np.full(n, 4, dtype=np.int32),
        seq_len=(counts + 4).astype(np.int32),
        offsets=offsets,
        pos=np.arange(m, dtype=np.int32),
        token_id=np.zeros(m, dtype=np.int32),
        streams={k: flat(v) for k, v in streams_in.items() if v is not None},
        entropy={} if entropy is None else {"rc": flat(entropy)},
        advantages=adv,
        reward=None if reward is None else np.asarray(reward, dtype=np.float64),
    )


def worked_example(*, include_masked: bool = False) -> TokenBatch:
    """The batch of docs/metrics.md (s3's third token is masked unless `include_masked`)."""
    old = [[-1.0, -2.0, -0.5], [-0.3, -1.5, -3.0, -0.9], [-0.7, -1.2, -2.5, -0.4], [-1.1, -0.3, -2.0]]
    new = [[-1.0, -1.7, -0.8], [-0.05, -1.8, -2.95, -0.9], [-0.5, -1.25, -9.0, -0.3], [-1.35, -0.3, -1.85]]
    if not include_masked:
        old[2].pop(2)
        new[2].pop(2)
    return make_batch(new=new, old=old, advantages=[1.0, -1.0, 0.5, -0.5], groups=["g1", "g1", "g2", "g2"])
