"""What a framework key style reads and returns for one step: `StyleInputs` (the flat token arrays of a
`TokenBatch` under the stream roles of the settings, resolved once by `read_inputs`) and `StyleOutput`.

All arrays are float64 or int64 numpy over the (M,) loss tokens or (S,) samples of the step; only loss positions
are in a batch, so ``m = 1`` on every token and ``Σ m = M``; per-sample sums use `np.bincount` on
`TokenBatch.token_sample()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.errors import Code, not_among
from pgdiag.metrics.styles.common import div_array
from pgdiag.metrics.values import MetricValue

if TYPE_CHECKING:
    from pgdiag.metrics.settings import MetricSettings


@dataclass(frozen=True)
class StyleOutput:
    """What one style computes for one step: its keys in table order plus notices for the report."""

    values: tuple[MetricValue, ...]
    notices: tuple[str, ...] = ()


@dataclass(frozen=True)
class StyleInputs:
    """The arrays of one step that the styles read; a None array means that input is absent."""

    token_sample: np.ndarray  # (M,) int64 sample of each token
    n_loss: np.ndarray  # (S,) int64 loss positions per sample (N_i)
    document: np.ndarray  # (S,) int64 document of each sample
    group: np.ndarray  # (S,) int64 prompt group of each sample
    seq_len: np.ndarray  # (S,) int64 len(input_ids)
    prompt_len: np.ndarray  # (S,) int64
    lp_new: np.ndarray | None  # (M,)
    lp_old: np.ndarray | None  # (M,)
    lp_a: np.ndarray | None  # (M,) mismatch pair, sampling side (rollout)
    lp_b: np.ndarray | None  # (M,) mismatch pair, evaluated side (train)
    lp_ref: np.ndarray | None  # (M,)
    entropy: np.ndarray | None  # (M,)
    adv: np.ndarray | None  # (M,) per-token advantage
    reward: np.ndarray | None  # (S,)

    @property
    def n_samples(self) -> int:
        return int(self.n_loss.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.token_sample.shape[0])

    @property
    def has_policy(self) -> bool:
        return self.lp_new is not None and self.lp_old is not None

    @property
    def has_pair(self) -> bool:
        return self.lp_a is not None and self.lp_b is not None

    def sample_sum(self, x: np.ndarray) -> np.ndarray:
        """(S,) Σ_t x over each sample's tokens (NaN and inf propagate)."""
        return np.bincount(self.token_sample, weights=x, minlength=self.n_samples).astype(np.float64)

    def per_token(self, x_sample: np.ndarray) -> np.ndarray:
        """(M,) a per-sample array broadcast to the sample's tokens."""
        return x_sample[self.token_sample]

    def sample_mean_adv(self) -> np.ndarray:
        """(S,) Ā_i = Σ_t A / N_i, 0 for an empty sample (TRL/Liger take one advantage per sample)."""
        assert self.adv is not None
        return div_array(self.sample_sum(self.adv), self.n_loss, empty=0.0)

    def seq_mean_logratio(self) -> np.ndarray:
        """(S,) δ̄_i = Σ_t d / max(N_i, 1) (the GSPO log-ratio; 0 for an empty sample)."""
        assert self.lp_new is not None and self.lp_old is not None
        return self.sample_sum(self.lp_new - self.lp_old) / np.maximum(self.n_loss, 1)


def read_inputs(batch: TokenBatch, settings: MetricSettings) -> StyleInputs:
    """The style inputs of `batch` under the stream roles of `settings` (docs/key-styles.md)."""

    def stream(name: str | None, what: str) -> np.ndarray | None:
        if name is None:
            return None
        if name not in batch.streams:
            message = f"{batch.label}: no stream {name!r} for {what}"
            raise not_among(Code.STREAM_NOT_FOUND, message, "streams", batch.streams)
        return np.asarray(batch.streams[name], dtype=np.float64)

    entropy = None
    if settings.entropy is not None:
        if settings.entropy not in batch.entropy:
            message = f"{batch.label}: no entropy for {settings.entropy!r}"
            raise not_among(Code.STREAM_NOT_FOUND, message, "entropy of", batch.entropy)
        entropy = np.asarray(batch.entropy[settings.entropy], dtype=np.float64)
    lp_a = stream(settings.stream_a, "--stream-a")
    lp_b = stream(settings.stream_b, "--stream-b")
    if lp_a is None or lp_b is None:
        lp_a = lp_b = None
    return StyleInputs(
        token_sample=batch.token_sample(),
        n_loss=batch.n_loss.astype(np.int64),
        document=batch.documents(),
        group=np.asarray(batch.group, dtype=np.int64),
        seq_len=np.asarray(batch.seq_len, dtype=np.int64),
        prompt_len=np.asarray(batch.prompt_len, dtype=np.int64),
        lp_new=stream(settings.new, "--new"),
        lp_old=stream(settings.old, "--old"),
        lp_a=lp_a,
        lp_b=lp_b,
        lp_ref=stream(settings.ref, "--ref"),
        entropy=entropy,
        adv=None if batch.advantages is None else np.asarray(batch.advantages, dtype=np.float64),
        reward=None if batch.reward is None else np.asarray(batch.reward, dtype=np.float64),
    )
