"""The cause accumulators of `pgdiag explain`: folds over `ExplainPiece`s (`add(piece)`, `finish()`).

Three folds run over the same pieces, each needing the previous one's result:

1. `SamplingFit`: for each side, the mean k3 against every point of the sampling grid (temperature ×
   truncation); `finish()` gives the best point per side, i.e. the temperature and kept set each side's
   log-probs look computed at.
2. `Evidence`: given the fits, each side mapped to a common frame (side a's temperature, full vocabulary), and
   the statistics the signature rules read: pairwise k3 between the recompute configurations (the precision
   spread and its floor), each side's k3 against each configuration, mismatch per policy lag and per response
   position bucket, the exact-zero fraction.
3. `Chain`: given the decisions (`explain.attribution.decide`), the per-token residual Δ after each cause is
   removed in the fixed order, summed per group (all tokens, position bucket, step), plus the expected noise
   k3 of the batch and precision configurations per group.

Δ = lp_b − lp_a throughout (side a samples), k3 = e^Δ − 1 − Δ with Δ clamped to ±20 (verl's clamp), so a token
outside a candidate kept set (log-prob −inf) costs k3(−20) ≈ 19, not inf.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pgdiag.explain.settings import POSITION_EDGES, REMOVAL_ORDER
from pgdiag.explain.table import ExplainPiece

CLAMP = 20.0


def k3(delta: np.ndarray) -> np.ndarray:
    """(M,) e^Δ − 1 − Δ of Δ clamped to ±20 (NaN and −inf clamp to −20)."""
    d = np.clip(np.nan_to_num(delta, nan=-CLAMP, neginf=-CLAMP, posinf=CLAMP), -CLAMP, CLAMP)
    return np.expm1(d) - d


def position_bucket(resp_pos: np.ndarray) -> np.ndarray:
    """(M,) index of the response-position bucket: [0], [1], [2-3], [4-7], [8-15], ..."""
    return np.searchsorted(np.asarray(POSITION_EDGES), np.maximum(resp_pos, 0), side="right") - 1


def position_label(index: int) -> str:
    lo, hi = POSITION_EDGES[index], POSITION_EDGES[index + 1] - 1
    return str(lo) if lo == hi else (f"{lo}+" if hi > 1 << 40 else f"{lo}-{hi}")


@dataclass(frozen=True)
class SideFit:
    """The sampling-grid point a side's log-probs fit best."""

    temperature_index: int
    variant_index: int
    k3: float  # mean k3 at that point
    k3_full_at_t1: (
        float  # mean k3 at T = 1, full vocabulary (what an untempered, untruncated recompute gives)
    )


@dataclass
class SamplingFit:
    """Fold 1: mean k3 of each side against every grid point, per response-position bucket; `finish()` -> the
    best point per side, fitted outside a chat-template region (the raw pair's first positions, when the
    tokenization rule fires on them: a template's few huge Δ would otherwise pull the temperature fit)."""

    t1_index: int  # the grid's T = 1 column
    sums: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)  # (side, bucket) -> (n_T, n_K)
    raw: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [tokens, k3 sum, |Δ| sum] of b − a

    def add(self, piece: ExplainPiece) -> None:
        bucket = position_bucket(piece.resp_pos)
        delta = piece.b - piece.a
        for index in np.unique(bucket).tolist():
            sel = bucket == index
            row = self.raw.setdefault(int(index), [0.0, 0.0, 0.0])
            row[0] += float(sel.sum())
            row[1] += float(k3(delta[sel]).sum())
            row[2] += float(np.abs(delta[sel]).sum())
            grid = piece.grid[sel].astype(np.float64)  # (m, n_T, n_K)
            for side, values in (("a", piece.a[sel]), ("b", piece.b[sel])):
                total = k3(grid - values[:, None, None]).sum(axis=0)
                key = (side, int(index))
                self.sums[key] = total if key not in self.sums else self.sums[key] + total

    def finish(self) -> tuple[dict[str, SideFit], int]:
        """({side: best grid point}, template region: response positions < N left out of the fit)."""
        from pgdiag.explain.signatures import first_position_rule

        rows = {b: (n, k / max(n, 1), a / max(n, 1)) for b, (n, k, a) in self.raw.items()}
        _, _, region = first_position_rule(rows)
        fits = {}
        for side in ("a", "b"):
            kept = [(b, t) for (s, b), t in self.sums.items() if s == side and POSITION_EDGES[b] >= region]
            n = sum(self.raw[b][0] for b, _ in kept)
            mean = sum(t for _, t in kept) / max(n, 1)
            i, j = np.unravel_index(int(np.argmin(mean)), mean.shape)
            fits[side] = SideFit(int(i), int(j), float(mean[i, j]), float(mean[self.t1_index, 0]))
        return fits, region


def frame_corrections(
    piece: ExplainPiece, fits: dict[str, SideFit], kept_pair: tuple[str, str] | None = None
) -> dict[str, np.ndarray]:
    """Per token, the grid differences the sampling causes remove (module docstring, docs/explain.md):
    ``temperature`` = L[T_b, full] − L[T_a, full]; ``truncation`` = (L[T_b, K_b] − L[T_b, full]) −
    (L[T_a, K_a] − L[T_a, full]); and ``a_frame`` = side a without its truncation (L at side a's temperature).
    `kept_pair` (kept, reference): when the run records kept sets and side a fits a truncated grid point, side
    a's truncation is the recorded one, R_kept − R_ref (both fp32 at side a's temperature), not the grid's."""
    fa, fb = fits["a"], fits["b"]
    grid = piece.grid.astype(np.float64)
    la_full, lb_full = grid[:, fa.temperature_index, 0], grid[:, fb.temperature_index, 0]
    la_kept = grid[:, fa.temperature_index, fa.variant_index]
    lb_kept = grid[:, fb.temperature_index, fb.variant_index]
    trunc_a = np.nan_to_num(la_kept - la_full, neginf=0.0)
    if kept_pair is not None and fa.variant_index != 0:
        kept, reference = kept_pair
        trunc_a = np.nan_to_num(
            piece.configs[kept] - piece.configs[reference], nan=0.0, neginf=0.0, posinf=0.0
        )
    trunc_b = np.nan_to_num(lb_kept - lb_full, neginf=0.0)
    return {
        "temperature": lb_full - la_full,
        "truncation": trunc_b - trunc_a,
        "a_frame": piece.a - trunc_a,  # side a in the frame (T_a, full vocabulary)
        "b_frame": piece.b - trunc_b - (lb_full - la_full),  # side b in the same frame
    }


@dataclass
class Evidence:
    """Fold 2: what the signature rules read (module docstring). `configs`: the recompute configurations run
    (computed at side a's fitted temperature, full vocabulary), `precision`: those that differ in numerics."""

    fits: dict[str, SideFit]
    configs: tuple[str, ...]
    kept_pair: tuple[str, str] | None = None  # (kept, reference) configurations of a run with kept sets
    n: int = 0
    n_lagged: int = 0
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_lag: dict[int, list[float]] = field(default_factory=dict)  # lag -> [tokens, k3 sum, |Δ| sum]
    by_position: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [tokens, k3 sum, |Δ| sum]

    def add(self, piece: ExplainPiece) -> None:
        corr = frame_corrections(piece, self.fits, self.kept_pair)
        a_frame, b_frame = corr["a_frame"], corr["b_frame"]
        delta = b_frame - a_frame  # (M,) Δ after the sampling causes
        kd = k3(delta)
        s = self.sums
        s["k3_0"] += float(k3(piece.b - piece.a).sum())
        s["k3_after_temperature"] += float(k3(piece.b - piece.a - corr["temperature"]).sum())
        s["k3_after_sampling"] += float(kd.sum())
        s["abs_0"] += float(np.abs(piece.b - piece.a).sum())
        s["zeros_a"] += float((piece.a == 0.0).sum())
        s["zeros_b"] += float((piece.b == 0.0).sum())
        s["certain"] += float(piece.certain.sum())
        s["entropy_ref"] += float(piece.entropy.sum())
        unlagged = piece.lag <= 0
        s["n_unlagged"] += float(unlagged.sum())
        bucket = position_bucket(piece.resp_pos)
        for name, values in piece.configs.items():
            ka, kb = k3(values - a_frame), k3(values - b_frame)
            s[f"a0|{name}"] += float(ka[unlagged].sum())
            for index in np.unique(
                bucket
            ).tolist():  # per position bucket, so a template region can be left out
                sel = bucket == index
                s[f"a|{name}|{index}"] += float(ka[sel].sum())
                s[f"b|{name}|{index}"] += float(kb[sel].sum())
            for other, second in piece.configs.items():
                if other != name:
                    s[f"{name}|{other}"] += float(k3(second - values).sum())
        for lag in np.unique(piece.lag).tolist():
            sel = piece.lag == lag
            row = self.by_lag.setdefault(int(lag), [0.0, 0.0, 0.0])
            row[0] += float(sel.sum())
            row[1] += float(kd[sel].sum())
            row[2] += float(np.abs(delta[sel]).sum())
        for index in np.unique(bucket).tolist():
            sel = bucket == index
            row = self.by_position.setdefault(int(index), [0.0, 0.0, 0.0])
            row[0] += float(sel.sum())
            row[1] += float(kd[sel].sum())
            row[2] += float(np.abs(delta[sel]).sum())
        self.n += piece.n_tokens

    def mean(self, key: str, n: float | None = None) -> float:
        return self.sums.get(key, 0.0) / max(n if n is not None else self.n, 1)

    def finish(self) -> dict[str, Any]:
        """The means (`mean`), per lag and per position bucket rows."""
        return {
            "n_tokens": self.n,
            "k3_0": self.mean("k3_0"),
            "by_lag": {
                lag: (n, k / max(n, 1), a / max(n, 1)) for lag, (n, k, a) in sorted(self.by_lag.items())
            },
            "by_position": {
                b: (n, k / max(n, 1), a / max(n, 1)) for b, (n, k, a) in sorted(self.by_position.items())
            },
        }


@dataclass(frozen=True)
class Decisions:
    """What `explain.attribution.decide` concluded from the evidence; read by the `Chain` fold."""

    apply: dict[str, bool]  # deterministic cause -> its removal applies
    tokenization_positions: int  # response positions < this are the template region (0: none)
    stale_lag_min: int  # samples with lag >= this are stale (0: none)
    weights_side: str | None  # "a", "b", "ab" or None
    best_config: dict[str, str | None]  # side -> the configuration closest to it
    batch_pair: tuple[str, str] | None  # (packed, one-per-forward) configurations
    precision_pairs: tuple[tuple[str, str], ...]  # (low precision, reference) pairs
    routing_pair: tuple[str, str] | None  # (routes replayed, routes recomputed)
    kept_pair: tuple[str, str] | None = None  # (kept, reference) when the run records kept sets


GROUPS = ("all", "position", "step")


@dataclass
class Chain:
    """Fold 3: per group, sums of the residual after each removal (module docstring)."""

    decisions: Decisions
    fits: dict[str, SideFit]
    # (group kind, bucket) -> stage -> [n explained, n not, k3 sum over not, |Δ| sum over not]
    stages: dict[tuple[str, str], dict[str, list[float]]] = field(default_factory=dict)
    noise: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)

    def add(self, piece: ExplainPiece) -> None:
        d = self.decisions
        corr = frame_corrections(piece, self.fits, d.kept_pair)
        a_cur, b_cur = piece.a.copy(), piece.b.copy()  # each side as the removals leave it
        trunc_a = piece.a - corr["a_frame"]
        trunc_b = corr["truncation"] + trunc_a
        explained = np.zeros(piece.n_tokens, dtype=bool)
        residuals: list[tuple[str, np.ndarray, np.ndarray]] = [("start", b_cur - a_cur, explained.copy())]
        for cause in REMOVAL_ORDER:
            if cause == "logprobs_mode" and d.apply.get(cause):
                b_cur, a_cur = b_cur - corr["temperature"] - trunc_b, a_cur - trunc_a
            elif cause == "temperature" and d.apply.get(cause):
                b_cur = b_cur - corr["temperature"]
            elif cause == "sampling_truncation" and d.apply.get(cause):
                b_cur, a_cur = b_cur - trunc_b, a_cur - trunc_a
            elif cause == "tokenization" and d.tokenization_positions > 0:
                explained = explained | (piece.resp_pos < d.tokenization_positions)
            elif cause == "staleness" and d.stale_lag_min > 0 and d.best_config.get("a"):
                a_cur = np.where(piece.lag >= d.stale_lag_min, piece.configs[d.best_config["a"]], a_cur)
            elif cause == "weights" and d.weights_side:
                if "a" in d.weights_side:
                    a_cur = piece.configs[d.best_config["a"]].copy()
                if "b" in d.weights_side:
                    b_cur = piece.configs[d.best_config["b"]].copy()
            elif cause == "routing" and d.routing_pair is not None:
                replay, recompute = d.routing_pair  # side b as if it had run side a's recorded routes
                b_cur = b_cur + (piece.configs[replay] - piece.configs[recompute])
            residuals.append((cause, b_cur - a_cur, explained.copy()))
        bucket = position_bucket(piece.resp_pos)
        groups = [("all", np.ones(piece.n_tokens, dtype=bool), "all")]
        groups += [("position", bucket == b, position_label(int(b))) for b in np.unique(bucket).tolist()]
        groups += [("step", piece.step == s, str(int(s))) for s in np.unique(piece.step).tolist()]
        noise_terms = self._noise_terms(piece)
        for kind, sel, label in groups:
            table = self.stages.setdefault((kind, label), {})
            for stage, values, done in residuals:
                row = table.setdefault(stage, [0.0, 0.0, 0.0, 0.0])
                keep = sel & ~done
                row[0] += float((sel & done).sum())
                row[1] += float(keep.sum())
                row[2] += float(k3(values[keep]).sum())
                row[3] += float(np.abs(values[keep]).sum())
            sums = self.noise.setdefault((kind, label), defaultdict(float))
            sums["n"] += float(sel.sum())
            for name, values in noise_terms.items():
                sums[name] += float(values[sel].sum())

    def finish(self) -> Chain:
        """The per-group stage sums (read by `explain.attribution.shares`)."""
        return self

    def _noise_terms(self, piece: ExplainPiece) -> dict[str, np.ndarray]:
        d = self.decisions
        terms = {}
        if d.batch_pair is not None:
            packed, single = d.batch_pair
            terms["batch_variance"] = k3(piece.configs[single] - piece.configs[packed])
        for low, ref in d.precision_pairs:
            terms[f"precision:{low}"] = k3(piece.configs[low] - piece.configs[ref])
        return terms
