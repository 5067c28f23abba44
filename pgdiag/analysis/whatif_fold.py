"""`whatif` as a fold (`pgdiag.data.fold.Fold`): every rule replayed on each piece of whole steps, and only what the
report needs kept between pieces (docs/whatif.md, "Rows"; docs/reliability.md, "Folds").

What: `WhatifFold.add(batch, lag)` replays every rule of the grid on one piece and keeps, per rule, token counts
and sums (fractions, weight means, signal shares), Kish sums (`Kish`), the where-tables' counts per bucket and a
per-sample table of pg-loss sums; `finish()` gives the rows one read of the whole run gives.
Why: a rule acts within one step at most (batch-normalised IS per step, M2PO within a step or its micro-batches,
PSIS k̂ per step), so the pieces' token arrays can go once a piece is added: memory follows a piece, not the run.
How: counts and maxima are exact; sums pooled over pieces agree with one read to rounding; Kish's ESS keeps
Σw and Σw² scaled by the largest weight seen (rescaled when a larger one comes); the medians of the sequence
weights are exact from per-sequence values, and the loss of every aggregation mode is computed at the end from
per-sample sums (two floats a sample and rule) with the run's group codes, as one read computes it. State:
O(samples × rules + steps × rules), no token array.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from pgdiag.analysis.losses import loss_parity_rows, worst_step_rows
from pgdiag.analysis.replay import (
    LOSS_MODES,
    SAFETY_BOUND,
    metric_unit,
    not_applicable,
    replay_of,
    rule_effect,
    seq_log_weights,
)
from pgdiag.analysis.rules import PROXIMAL_THETA, RuleEffect, segment_sums
from pgdiag.analysis.settings import CorrectionRule, WhatifSettings, parse_losses
from pgdiag.analysis.signal import (
    BatchWeights,
    add_signal_sums,
    psis_step_rows,
    psis_summary_rows,
    signal_metrics,
    signal_sums,
)
from pgdiag.analysis.staleness import staleness_rows, staleness_sums
from pgdiag.analysis.where import Localiser
from pgdiag.data.batch import TokenBatch
from pgdiag.data.versions import LAG_LABELS, TokenLag
from pgdiag.metrics.loss import sample_weights
from pgdiag.report.report import ReportRow


class _ScaledSums:
    """Σw and Σw² of weights given piece by piece, each piece in units of its own reference (`_fold`), kept in
    the units of the largest reference seen (the earlier sums rescaled when a larger one comes)."""

    def __init__(self, reference: float) -> None:
        self.n = 0
        self.reference = reference
        self.s1 = self.s2 = 0.0
        self.bad = False

    def _fold(self, w: np.ndarray, reference: float, ratio: Callable[[float, float], float]) -> None:
        """Add the weights `w` (k,), in units of `reference`; ratio(a, b) is the size of unit a in units of b."""
        s1, s2 = float(np.sum(w)), float(np.sum(w * w))
        if reference > self.reference:
            f = ratio(self.reference, reference)
            self.s1, self.s2, self.reference = self.s1 * f + s1, self.s2 * f * f + s2, reference
        else:
            f = ratio(reference, self.reference)
            self.s1, self.s2 = self.s1 + s1 * f, self.s2 + s2 * f * f

    def _kish(self) -> float:
        return self.s1**2 / (self.n * self.s2)


class Kish(_ScaledSums):
    """Kish's normalised ESS (Σw)² / (n Σw²) of non-negative weights given piece by piece, as `kish_ess` gives it
    on all of them: Σw and Σw² are kept scaled by the largest |w| seen (the reference). None when empty, when a
    weight is NaN or infinite, or when no weight is positive."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.top = -math.inf  # the largest weight seen

    def add(self, weights: np.ndarray) -> None:
        """The weights (k,) of one piece."""
        self.n += weights.shape[0]
        if not weights.shape[0]:
            return
        top = float(np.max(weights))
        if not math.isfinite(top):
            self.bad = True
            return
        self.top = max(self.top, top)
        scale = float(np.max(np.abs(weights)))
        if scale == 0:
            return
        self._fold(weights / scale, scale, lambda a, b: a / b)

    def value(self) -> float | None:
        if self.n == 0 or self.bad or not self.top > 0:
            return None
        return self._kish()


class LogKish(_ScaledSums):
    """`Kish` of weights given as log weights (−inf: weight 0), scaled by the largest log weight seen (the
    reference), as `kish_ess` of exp(log w − max log w) over all of them gives it; None when empty, NaN, +inf or
    all −inf."""

    def __init__(self) -> None:
        super().__init__(-math.inf)

    def add(self, log_weights: np.ndarray) -> None:
        """The log weights (k,) of one piece."""
        self.n += log_weights.shape[0]
        if not log_weights.shape[0]:
            return
        top = float(np.max(log_weights))
        if math.isnan(top) or top == math.inf:
            self.bad = True
            return
        if top == -math.inf:
            return
        self._fold(np.exp(log_weights - top), top, lambda a, b: math.exp(a - b))

    def value(self) -> float | None:
        if self.n == 0 or self.bad or self.reference == -math.inf:
            return None
        return self._kish()


class RuleState:
    """What one rule keeps between pieces."""

    def __init__(self) -> None:
        self.flags = np.zeros(3)  # tokens affected, tokens kept, sequences affected
        self.ess_token, self.ess_seq = Kish(), LogKish()
        self.signal: np.ndarray | None = None
        self.loss: list[np.ndarray] = []  # per piece (S,) Σ_t −A_t w_t over kept tokens
        self.kept: list[np.ndarray] = []  # per piece (S,) kept tokens
        self.where: dict[tuple[str, str], float] = {}  # (breakdown, bucket) -> tokens affected


class WhatifFold:
    """The whatif replay of a run over its pieces of whole steps: `add(batch, lag)` per piece in step order, then
    `finish()` the report rows (module docstring)."""

    def __init__(
        self, settings: WhatifSettings, *, behavior: str, target: str, new: str | None, pair: str, later: str
    ) -> None:
        self.settings, self.behavior, self.target, self.new = settings, behavior, target, new
        self.pair, self.later = pair, later
        self.rules = settings.grid()
        self.state = [RuleState() for _ in self.rules]
        self.n_tok = self.n_seq = self.n_samples = 0
        self.has_loss: bool | None = None
        self.applicable: list[bool] | None = None
        self.ess_token, self.ess_seq = Kish(), LogKish()
        self.weights = BatchWeights()
        self.base = RuleState()  # the uncorrected batch's per-sample loss table
        self.group: list[np.ndarray] = []  # per piece (S,) group name of each sample
        self.abs_adv: list[np.ndarray] = []  # per piece (S,) Σ|A| of each sample
        self.n_loss: list[np.ndarray] = []  # per piece (S,) loss tokens of each sample
        self.psis_rows: list[ReportRow] = []
        self.psis_khat: list[float] = []
        self.loss_rows: list[ReportRow] = []
        self.loss_failed = False
        self.lag: dict[str, np.ndarray] | None = None
        self.buckets: dict[str, dict[str, tuple[float | None, float | None, int]]] = {}

    def add(self, batch: TokenBatch, lag: TokenLag | None = None) -> None:
        """Replay every rule on one piece (`batch`: whole steps holding the streams; `lag`: its token lag)."""
        log_ratio = batch.streams[self.target] - batch.streams[self.behavior]  # (M,)
        offsets = batch.offsets
        nonempty = np.diff(offsets) > 0
        self.n_tok += batch.n_tokens
        self.n_seq += int(nonempty.sum())
        self.n_samples += batch.n_samples
        self.has_loss = batch.advantages is not None
        plain = RuleEffect(
            np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)),
            np.ones(batch.n_tokens, bool),
            np.zeros(batch.n_tokens, bool),
        )
        self.ess_token.add(plain.weight)
        self.ess_seq.add(seq_log_weights(plain, offsets, sequence_level=False)[nonempty])
        self.weights.add(log_ratio, offsets)
        self.group.append(batch.group_names[batch.group])
        self.n_loss.append(batch.n_loss.astype(np.float64))
        if batch.advantages is not None:
            self.abs_adv.append(segment_sums(np.abs(batch.advantages), offsets))
            _add_loss(self.base, batch, np.ones(batch.n_tokens), plain.keep)
        rows, khats = psis_step_rows(batch, log_ratio, self.pair)
        self.psis_rows += rows
        self.psis_khat += khats
        replays = {False: replay_of(batch, self.behavior, self.target)}
        if self.new is not None:
            replays[True] = replay_of(batch, self.target, self.new)
        if self.settings.losses is not None and batch.advantages is not None:
            self._add_losses(batch, replays)
        if lag is not None:
            sums = staleness_sums(batch, lag, behavior=self.behavior, target=self.target, new=self.new)
            self.lag = self.lag or {}
            for label, part in sums.items():
                self.lag[label] = self.lag[label] + part if label in self.lag else part
        localiser = Localiser.of(batch, lag)
        for name, _code, found in localiser.tables:
            table = self.buckets.setdefault(name, {})
            for label, lo, hi, n in found:
                held = table.get(label)
                table[label] = (lo, hi, n + (held[2] if held else 0))
        streams = list(batch.streams)
        self.applicable = [not_applicable(rule, streams, self.new) is None for rule in self.rules]
        for rule, state, ok in zip(self.rules, self.state, self.applicable, strict=True):
            if ok:
                effect = rule_effect(rule, replays[rule.pair == PROXIMAL_THETA])
                self._add_rule(rule, state, effect, batch, localiser)

    def _add_rule(
        self, rule: CorrectionRule, state: RuleState, effect: RuleEffect, batch: TokenBatch, where: Localiser
    ) -> None:
        offsets = batch.offsets
        nonempty = np.diff(offsets) > 0
        dropped = ~effect.keep | (effect.weight == 0)
        seq_affected = (segment_sums(effect.affected.astype(np.float64), offsets) > 0)[nonempty]
        state.flags += (float(np.sum(effect.affected)), float(np.sum(~dropped)), float(np.sum(seq_affected)))
        state.ess_token.add(np.where(effect.keep, effect.weight, 0.0))
        log_w = seq_log_weights(effect, offsets, sequence_level=rule.sequence_level)[nonempty]
        state.ess_seq.add(log_w)
        state.signal = add_signal_sums(state.signal, signal_sums(effect, batch.advantages))
        if batch.advantages is not None:
            _add_loss(state, batch, effect.weight, effect.keep)
        for breakdown, label, _, _, hit, _ in where.hits(effect.affected):
            key = (breakdown, label)
            state.where[key] = state.where.get(key, 0.0) + hit

    def _add_losses(self, batch: TokenBatch, replays: dict) -> None:
        """`whatif --losses`: the piece's per-step rows (`finish` adds the maximum over steps of each metric)."""
        assert self.settings.losses is not None
        forms = parse_losses(self.settings.losses)
        rows = loss_parity_rows(batch, forms, replays, rule_effect, self.settings.divisor, self.pair)
        if not rows and batch.n_samples:
            self.loss_failed = True  # a step's aggregation weights are not computable: no rows, as one read
        self.loss_rows += [row for row in rows if row.breakdown == "losses/step"]

    def finish(self) -> list[ReportRow]:
        """The report rows of every piece added, as `whatif_batch` gives them on the run read whole."""
        rows: list[ReportRow] = []

        def add(
            bucket: str, metric: str, value: float | None, n: int, rule: CorrectionRule | None = None
        ) -> None:
            unit, reduction = metric_unit(metric)
            on = self.later if rule is not None and rule.pair == PROXIMAL_THETA else self.pair
            lo = rule.lo if rule is not None else None
            hi = rule.hi if rule is not None else None
            rows.append(
                ReportRow(on, "token", "threshold", bucket, metric, value, unit, reduction, n, lo, hi)
            )

        ess_token, ess_seq = self.ess_token.value(), self.ess_seq.value()
        add("none", "whatif/ess_token", ess_token, self.n_tok)
        add("none", "whatif/ess_seq", ess_seq, self.n_seq)
        group, n_groups = self._groups()
        base_loss = self._losses(self.base, group, n_groups)
        for mode in LOSS_MODES:
            add("none", f"whatif/loss/{mode}", base_loss[mode], self.n_tok)
        for metric, value in self.weights.metrics().items():
            add("none", metric, value, self.n_tok)
        if self.has_loss:
            add(
                "none",
                "whatif/zero_advantage_groups",
                float(self._zero_advantage_groups(group, n_groups)),
                self.n_seq,
            )
        rows += self.psis_rows + psis_summary_rows(self.psis_khat, self.pair)
        if self.settings.losses is not None and self.has_loss and not self.loss_failed:
            rows += self.loss_rows + worst_step_rows(self.loss_rows)
        if self.lag is not None:
            rows += staleness_rows(self.lag, self.n_tok, new=self.new, pair=self.pair, later=self.later)
        for rule, state, ok in zip(self.rules, self.state, self.applicable or [], strict=True):
            metrics = self._rule_metrics(state if ok else None, base_loss, group, n_groups)
            metrics = {"whatif/ess_token_before": ess_token, "whatif/ess_seq_before": ess_seq, **metrics}
            for metric, value in metrics.items():
                n = self.n_seq if metric_unit(metric)[1].startswith("seq") else self.n_tok
                add(rule.label, metric, value, n, rule)
            if ok:
                rows += self._where_rows(rule, state)
        return rows

    def _rule_metrics(
        self, state: RuleState | None, base_loss: dict[str, float | None], group: np.ndarray, n_groups: int
    ) -> dict[str, float | None]:
        """Every per-rule metric of docs/whatif.md but the ESS before; all None when the rule is n/a."""
        if state is None:
            names = ("tokens_affected", "tokens_kept", "seqs_affected", "ess_token_after", "ess_seq_after")
            return {f"whatif/{n}": None for n in names}
        affected, kept, seqs = (float(x) for x in state.flags)
        metrics: dict[str, float | None] = {
            "whatif/tokens_affected": affected / self.n_tok if self.n_tok else None,
            "whatif/tokens_kept": kept / self.n_tok if self.n_tok else None,
            "whatif/seqs_affected": seqs / self.n_seq if self.n_seq else None,
            "whatif/ess_token_after": state.ess_token.value(),
            "whatif/ess_seq_after": state.ess_seq.value(),
        }
        assert state.signal is not None
        metrics |= signal_metrics(state.signal, bool(self.has_loss))
        after_loss = self._losses(state, group, n_groups)
        for mode in LOSS_MODES:
            after, before = after_loss[mode], base_loss[mode]
            metrics[f"whatif/loss_delta/{mode}"] = None if after is None or before is None else after - before
        return metrics

    def _where_rows(self, rule: CorrectionRule, state: RuleState) -> list[ReportRow]:
        """The `threshold/<breakdown>` rows of one rule: the affected share per bucket, buckets in order."""
        on = self.pair if rule.pair != PROXIMAL_THETA else self.later
        rows = []
        for breakdown, table in self.buckets.items():
            for label in sorted(table, key=_bucket_order(breakdown, table)):
                lo, hi, n = table[label]
                if not n:
                    continue
                hit = state.where.get((breakdown, label), 0.0)
                rows.append(
                    ReportRow(
                        on,
                        "token",
                        f"threshold/{breakdown}",
                        f"{rule.label}|{label}",
                        "whatif/tokens_affected",
                        hit / n,
                        "fraction",
                        "token-mean",
                        n,
                        lo,
                        hi,
                    )
                )
        return rows

    def _groups(self) -> tuple[np.ndarray, int]:
        """(S,) the run-wide group code of every sample (as one read codes them) and the number of groups."""
        names = np.concatenate(self.group) if self.group else np.zeros(0, dtype=object)
        unique, codes = np.unique(names, return_inverse=True)
        return codes.reshape(-1).astype(np.int64), int(unique.shape[0])

    def _losses(self, state: RuleState, group: np.ndarray, n_groups: int) -> dict[str, float | None]:
        """Aggregated pg loss −Σ_i c_i Σ_t A_t w_t under every mode at the first mini-batch (new = old), kept tokens
        only; None for a mode whose weights are not computable (or without advantages)."""
        if not self.has_loss:
            return dict.fromkeys(LOSS_MODES)
        per_sample, kept = np.concatenate(state.loss), np.concatenate(state.kept)
        out: dict[str, float | None] = {}
        for mode in LOSS_MODES:
            c = sample_weights(mode, kept, group, n_groups, self.n_samples, self.settings.divisor)
            out[mode] = None if c is None else float(np.sum(c * per_sample))
        return out

    def _zero_advantage_groups(self, group: np.ndarray, n_groups: int) -> int:
        """Groups whose loss tokens all have A = 0 (all-equal rewards): they carry no signal under any rule."""
        total = np.bincount(group, weights=np.concatenate(self.abs_adv), minlength=n_groups)
        present = np.bincount(group, weights=np.concatenate(self.n_loss), minlength=n_groups) > 0
        return int(np.sum(present & (total == 0)))


def _add_loss(state: RuleState, batch: TokenBatch, weight: np.ndarray, keep: np.ndarray) -> None:
    """One piece's per-sample loss sums Σ_t −A_t w_t and kept tokens (kept tokens only)."""
    assert batch.advantages is not None
    state.kept.append(segment_sums(keep.astype(np.float64), batch.offsets))
    state.loss.append(segment_sums(np.where(keep, -batch.advantages * weight, 0.0), batch.offsets))


def _bucket_order(breakdown: str, table: dict) -> object:
    """The order of a where-table's buckets: steps by value, env by name, position by edge, lag as `lag_buckets`."""
    if breakdown == "step":
        return lambda label: int(label)
    if breakdown == "position":
        return lambda label: table[label][0]
    if breakdown == "lag":
        return LAG_LABELS.index
    return str
