"""`TokenBatch`: the loss positions of a selection of rollout samples, flattened for vectorised math.

The metric engine, the key styles and `compare` all work on this one in-memory layout, built by
`pgdiag.data.load.read_token_batch` from a run. Only **loss positions** (``loss_mask`` true) are kept: every
metric of docs/metrics.md is defined on them. Token arrays are float64 (docs/metrics.md);
a null stream value on a loss position (only possible when E204 is ignored) is NaN here and is then
excluded and counted by the metrics as an invalid token.

Layout (S samples = Parquet rows in read order, M = total loss positions):
    sample i owns tokens ``offsets[i]:offsets[i + 1]``; ``n_loss[i] = offsets[i + 1] - offsets[i]``.
Documents are consecutive rows with the same (step, sample_id) (segments of one trajectory).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(frozen=True)
class TokenBatch:
    """Loss positions of S samples (rows) with their sample-level fields.

    Sample-level arrays have shape (S,), token-level arrays shape (M,).
    """

    label: str
    step: np.ndarray  # (S,) int64
    sample_id: np.ndarray  # (S,) object (str)
    segment_idx: np.ndarray  # (S,) int32, null -> 0
    group: np.ndarray  # (S,) int64 codes into group_names
    group_names: np.ndarray  # (G,) object (str)
    prompt_len: np.ndarray  # (S,) int32
    seq_len: np.ndarray  # (S,) int32, len(input_ids)
    offsets: np.ndarray  # (S + 1,) int64
    pos: np.ndarray  # (M,) int32, position of the token in input_ids
    token_id: np.ndarray  # (M,) int32
    streams: Mapping[str, np.ndarray] = field(default_factory=dict)  # name -> (M,) float64 log-probs
    entropy: Mapping[str, np.ndarray] = field(default_factory=dict)  # recompute tag -> (M,) float64 nats
    advantages: np.ndarray | None = None  # (M,) float64, per token (a scalar `advantage` is broadcast)
    reward: np.ndarray | None = None  # (S,) float64, NaN where null
    env: np.ndarray | None = None  # (S,) object (str) or None
    sample_row: np.ndarray | None = None  # (S,) int64 row index in the source (for messages)
    seq_hash: np.ndarray | None = None  # (S,) uint64 `seq_hash` as read (None for a batch built in memory)
    # (M,) int32 size of the recorded kept set (0 = none); None: no K read
    kept_size: np.ndarray | None = None
    # kept-set recompute tag -> (M,) kept mass, and -> (M,) its full-vocabulary log-probs
    kept_mass: Mapping[str, np.ndarray] = field(default_factory=dict)
    full_vocab: Mapping[str, np.ndarray] = field(default_factory=dict)
    kept_kl: Mapping[str, np.ndarray] = field(
        default_factory=dict
    )  # that tag -> (M,) engine-vs-model KL over K

    @property
    def n_samples(self) -> int:
        return int(self.step.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.pos.shape[0])

    @property
    def n_loss(self) -> np.ndarray:
        """(S,) int64 loss positions per sample (valid or not)."""
        return np.diff(self.offsets)

    def one_token_sets(self, stream: str) -> np.ndarray | None:
        """(M,) bool: where `stream` is the sampling stream and its recorded kept set holds one token (a
        renormalised 0.0 there is right, not a fill); None when no kept set was read or for another stream."""
        if stream != "rollout" or self.kept_size is None:
            return None
        return self.kept_size == 1

    def token_sample(self) -> np.ndarray:
        """(M,) int64 index of the sample that owns each token."""
        return np.repeat(np.arange(self.n_samples, dtype=np.int64), self.n_loss)

    def documents(self) -> np.ndarray:
        """(S,) int64 document index: consecutive rows with equal (step, sample_id) share one."""
        if self.n_samples == 0:
            return np.zeros(0, dtype=np.int64)
        same = (self.step[1:] == self.step[:-1]) & (self.sample_id[1:] == self.sample_id[:-1])
        return np.concatenate([[0], np.cumsum(~same)]).astype(np.int64)

    def select(self, rows: np.ndarray) -> TokenBatch:
        """The samples at `rows` (an int index array, any order) with their tokens, as a new batch."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, counts = self.offsets[rows], self.n_loss[rows]
        offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        # token index of every kept token: starts repeated plus a ramp within each sample
        take = np.repeat(starts - offsets[:-1], counts) + np.arange(offsets[-1], dtype=np.int64)

        def tok(a: np.ndarray) -> np.ndarray:
            return a[take]

        def opt(a: np.ndarray | None, f) -> np.ndarray | None:
            return None if a is None else f(a)

        return replace(
            self,
            step=self.step[rows],
            sample_id=self.sample_id[rows],
            segment_idx=self.segment_idx[rows],
            group=self.group[rows],
            prompt_len=self.prompt_len[rows],
            seq_len=self.seq_len[rows],
            offsets=offsets,
            pos=tok(self.pos),
            token_id=tok(self.token_id),
            streams={k: tok(v) for k, v in self.streams.items()},
            entropy={k: tok(v) for k, v in self.entropy.items()},
            advantages=opt(self.advantages, tok),
            reward=opt(self.reward, lambda a: a[rows]),
            env=opt(self.env, lambda a: a[rows]),
            sample_row=opt(self.sample_row, lambda a: a[rows]),
            seq_hash=opt(self.seq_hash, lambda a: a[rows]),
            kept_size=opt(self.kept_size, tok),
            kept_mass={k: tok(v) for k, v in self.kept_mass.items()},
            full_vocab={k: tok(v) for k, v in self.full_vocab.items()},
            kept_kl={k: tok(v) for k, v in self.kept_kl.items()},
        )

    def slice(self, lo: int, hi: int) -> TokenBatch:
        """The samples lo..hi (a contiguous run) with their tokens, as views instead of copies."""
        t_lo, t_hi = int(self.offsets[lo]), int(self.offsets[hi])

        def opt(values: np.ndarray | None, a: int, b: int) -> np.ndarray | None:
            return None if values is None else values[a:b]

        return replace(
            self,
            step=self.step[lo:hi],
            sample_id=self.sample_id[lo:hi],
            segment_idx=self.segment_idx[lo:hi],
            group=self.group[lo:hi],
            prompt_len=self.prompt_len[lo:hi],
            seq_len=self.seq_len[lo:hi],
            offsets=self.offsets[lo : hi + 1] - t_lo,
            pos=self.pos[t_lo:t_hi],
            token_id=self.token_id[t_lo:t_hi],
            streams={k: v[t_lo:t_hi] for k, v in self.streams.items()},
            entropy={k: v[t_lo:t_hi] for k, v in self.entropy.items()},
            advantages=opt(self.advantages, t_lo, t_hi),
            reward=opt(self.reward, lo, hi),
            env=opt(self.env, lo, hi),
            sample_row=opt(self.sample_row, lo, hi),
            seq_hash=opt(self.seq_hash, lo, hi),
            kept_size=opt(self.kept_size, t_lo, t_hi),
            kept_mass={k: v[t_lo:t_hi] for k, v in self.kept_mass.items()},
            full_vocab={k: v[t_lo:t_hi] for k, v in self.full_vocab.items()},
            kept_kl={k: v[t_lo:t_hi] for k, v in self.kept_kl.items()},
        )

    def with_steps(self, step: np.ndarray) -> TokenBatch:
        """The same batch with the step of every sample replaced (used by ``--docs-per-step``)."""
        return replace(self, step=np.asarray(step, dtype=np.int64))


def concat_batches(parts: Sequence[TokenBatch]) -> TokenBatch:
    """The samples of `parts` one after the other, as a new batch.

    The parts come from one run read with the same streams: they share the label, the stream and entropy names,
    which optional fields are present, and `group_names` (their `group` codes mean the same groups).
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    n_loss = np.concatenate([p.n_loss for p in parts])
    offsets = np.zeros(n_loss.shape[0] + 1, dtype=np.int64)  # (S + 1,)
    np.cumsum(n_loss, out=offsets[1:])

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    def opt(name: str) -> np.ndarray | None:
        return None if getattr(first, name) is None else cat(name)

    def cat_named(name: str) -> dict[str, np.ndarray]:
        """A field holding one array a name (streams, entropy, ...): each name's arrays concatenated."""
        return {k: np.concatenate([getattr(p, name)[k] for p in parts]) for k in getattr(first, name)}

    arrays = ("step", "sample_id", "segment_idx", "group", "prompt_len", "seq_len", "pos", "token_id")
    optional = ("advantages", "reward", "env", "sample_row", "seq_hash", "kept_size")
    named = ("streams", "entropy", "kept_mass", "full_vocab", "kept_kl")
    return replace(
        first,
        offsets=offsets,
        **{n: cat(n) for n in arrays},
        **{n: opt(n) for n in optional},
        **{n: cat_named(n) for n in named},
    )
