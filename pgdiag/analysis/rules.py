"""The landed off-policy corrections as `whatif` rules, each as its framework ships it (docs/whatif.md).

A rule acts on one pair of policies (`pair`):
    behaviour→proximal  the engine that sampled (μ, ``rollout``) against the trainer's recompute (``old``);
    proximal→θ          the recompute (π_old) against a later policy θ (a ``new`` stream recorded after an update).
`whatif` replays at the first mini-batch, where θ = π_old: a proximal→θ rule is only replayed when the run has a
``new`` stream, else it is reported n/a with the reason (never a silent ratio of 1).

`apply_named_rule(name, args, replay)` returns the rule's `RuleEffect` on the flattened batch: the applied weight,
the raw weight (before any truncation or mask), the keep flag, the affected flag and the per-token gradient
coefficient g_t = ∂ℓ_t/∂log π_θ(t) with the framework's stop-gradient semantics (−A·w for a detached weight w).
Comparison operators (`<=` vs `<`) follow each framework's code; the commit read is in the docstring of each
function and in docs/whatif.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pgdiag.errors import Code, UsageError

SAFETY_BOUND = 20.0  # verl / AReaL / SkyRL |log ratio| clamp before exp
BEHAVIOUR_PROXIMAL = "behaviour→proximal"
PROXIMAL_THETA = "proximal→θ"
VERL_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip
# name -> (pair, number of numeric arguments accepted (min, max), sequence level)
NAMED_RULES: dict[str, tuple[str, tuple[int, int], bool]] = {
    **{
        opt: (BEHAVIOUR_PROXIMAL, (2, 2) if opt.endswith("k1") else (1, 1), opt[:3] == "seq")
        for opt in VERL_RS_OPTIONS
    },
    "token_tis_bn": (BEHAVIOUR_PROXIMAL, (1, 1), False),
    "seq_tis_bn": (BEHAVIOUR_PROXIMAL, (1, 1), True),
    "seq_mask_tis": (BEHAVIOUR_PROXIMAL, (2, 2), True),
    "seq_mean_is": (BEHAVIOUR_PROXIMAL, (1, 1), True),
    "seq_logprob_error": (BEHAVIOUR_PROXIMAL, (1, 1), True),
    "opsm": (BEHAVIOUR_PROXIMAL, (1, 1), True),
    "dppo_tv": (BEHAVIOUR_PROXIMAL, (2, 3), False),
    "dppo_kl": (BEHAVIOUR_PROXIMAL, (2, 2), False),
    "ipo": (BEHAVIOUR_PROXIMAL, (1, 2), False),
    "kpop": (BEHAVIOUR_PROXIMAL, (1, 1), False),
    "m2po": (BEHAVIOUR_PROXIMAL, (1, 1), False),
    "token_veto": (BEHAVIOUR_PROXIMAL, (1, 1), True),
    "rollout_is": (BEHAVIOUR_PROXIMAL, (2, 2), False),
    "ref_kl": (BEHAVIOUR_PROXIMAL, (0, 0), False),
    "roll": (BEHAVIOUR_PROXIMAL, (2, 2), False),
    "areal_rs": (BEHAVIOUR_PROXIMAL, (1, 2), False),
    "cispo": (PROXIMAL_THETA, (2, 2), False),
    "sapo": (PROXIMAL_THETA, (2, 2), False),
    "gmpo": (PROXIMAL_THETA, (2, 2), True),
    "topr": (PROXIMAL_THETA, (0, 2), False),
    "dro": (PROXIMAL_THETA, (1, 1), False),
    "verl_dppo_tv": (PROXIMAL_THETA, (2, 2), False),
    "verl_dppo_kl": (PROXIMAL_THETA, (2, 2), False),
}
ROLL_AGGS = ("token", "geometric", "sequence", "segment")
AREAL_LEVELS, AREAL_ACTIONS = ("token", "sequence"), ("mask", "clamp")
AREAL_METRICS, AREAL_AGGS = ("ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl"), ("sum", "mean", "max")
_WORD_OPTIONS = {  # rules whose leading arguments are words: name -> allowed values of each word
    "roll": (ROLL_AGGS, ("ratio", "diff")),
    "areal_rs": (AREAL_LEVELS, AREAL_ACTIONS, AREAL_METRICS, AREAL_AGGS),
}


def segment_sums(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(S,) sums of the contiguous segments offsets[i]:offsets[i + 1] of x (M,); 0 for an empty segment."""
    out = np.zeros(max(offsets.shape[0] - 1, 0))
    starts = offsets[:-1]
    inside = starts < x.shape[0]  # empty segments at the end start at M
    if inside.any():
        out[inside] = np.add.reduceat(np.asarray(x, dtype=np.float64), starts[inside])
    out[offsets[1:] == starts] = 0.0  # reduceat gives x[start] for an empty segment
    return out


@dataclass(frozen=True)
class RuleEffect:
    """What one rule does to a batch (M loss tokens)."""

    weight: np.ndarray  # (M,) float64, the applied factor on each token's pg loss (0 where dropped)
    keep: np.ndarray  # (M,) bool, token stays in the loss mask
    affected: np.ndarray  # (M,) bool, truncated or dropped
    raw: np.ndarray | None = None  # (M,) float64, the weight before truncation/masking (None: 1)
    grad: np.ndarray | None = None  # (M,) float64, g_t = ∂ℓ_t/∂log π_θ (None: −A·weight on kept tokens)


@dataclass(frozen=True)
class Replay:
    """The batch a rule sees: log-probs of the earlier (`base`) and later (`cur`) policy of its pair."""

    base: np.ndarray  # (M,) log π of the earlier policy (μ, or π_old)
    cur: np.ndarray  # (M,) log π of the later policy (π_old, or θ)
    offsets: np.ndarray  # (S + 1,) int64
    step: np.ndarray  # (S,) int64
    pos: np.ndarray  # (M,) int32 position in the sequence (segments: runs of consecutive positions)
    advantages: np.ndarray | None  # (M,) float64
    reward: np.ndarray | None = None  # (S,) float64
    sample_of_token: np.ndarray | None = None  # (M,) int64, computed from offsets when None
    ref: np.ndarray | None = (
        None  # (M,) log π_ref (prime-rl's ref_kl takes log π_ref − log π_θ as its advantage)
    )

    @property
    def log_ratio(self) -> np.ndarray:
        """(M,) Δ = log π_cur − log π_base."""
        return self.cur - self.base

    def token_sample(self) -> np.ndarray:
        if self.sample_of_token is not None:
            return self.sample_of_token
        return np.repeat(np.arange(self.offsets.shape[0] - 1, dtype=np.int64), np.diff(self.offsets))

    def seq_sum(self, x: np.ndarray) -> np.ndarray:
        """(S,) per-sample sums of x (M,)."""
        return segment_sums(x, self.offsets)

    def seq_mean(self, x: np.ndarray) -> np.ndarray:
        """(S,) per-sample means of x (M,); 0 for an empty sample."""
        counts = np.diff(self.offsets).astype(np.float64)
        return np.divide(self.seq_sum(x), counts, out=np.zeros_like(counts), where=counts > 0)

    def seq_max(self, x: np.ndarray) -> np.ndarray:
        """(S,) per-sample maxima of x (M,); 0 for an empty sample (verl's `_sequence_max`)."""
        out = np.full(self.offsets.shape[0] - 1, -np.inf)
        np.maximum.at(out, self.token_sample(), x)
        return np.where(np.isfinite(out) | (np.diff(self.offsets) > 0), out, 0.0)

    def seq_min(self, x: np.ndarray) -> np.ndarray:
        out = np.full(self.offsets.shape[0] - 1, np.inf)
        np.minimum.at(out, self.token_sample(), x)
        return out

    def per_token(self, per_sample: np.ndarray) -> np.ndarray:
        """(M,) the per-sample values (S,) on each sample's tokens."""
        return np.repeat(per_sample, np.diff(self.offsets))

    def adv(self) -> np.ndarray:
        return self.advantages if self.advantages is not None else np.zeros(self.base.shape[0])


def parse_rule_args(name: str, args: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """(words, numbers) of a `NAME:ARGS` rule, checked against the rule's signature (E503 otherwise)."""
    if name not in NAMED_RULES:
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"unknown whatif rule {name!r}", "docs/whatif.md lists the rules"
        )
    words_allowed = _WORD_OPTIONS.get(name, ())
    words = args[: len(words_allowed)]
    for word, allowed in zip(words, words_allowed, strict=False):
        if word not in allowed:
            raise UsageError(
                Code.BAD_OPTION_VALUE, f"--rule {name}: {word!r} is not one of {', '.join(allowed)}"
            )
    if len(words) < len(words_allowed):
        raise UsageError(Code.BAD_OPTION_VALUE, f"--rule {name}: needs {len(words_allowed)} leading words")
    rest = args[len(words_allowed) :]
    if name == "m2po" and len(rest) == 2:  # scope=step | scope=mb:N
        rest = rest[:1]
    lo_n, hi_n = NAMED_RULES[name][1]
    if not lo_n <= len(rest) <= hi_n:
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"--rule {name}: takes {lo_n}..{hi_n} numbers, got {len(rest)}"
        )
    try:
        numbers = tuple(float(a) for a in rest)
    except ValueError:
        raise UsageError(Code.BAD_OPTION_VALUE, f"--rule {name}:{','.join(args)}: not a number") from None
    if not all(math.isfinite(x) for x in numbers):
        raise UsageError(Code.BAD_OPTION_VALUE, f"--rule {name}: bounds must be finite")
    return words, numbers


def m2po_scope(args: tuple[str, ...]) -> tuple[str, int]:
    """("step", 1) or ("mb", N) from the optional `scope=` argument of m2po."""
    scope = next((a.split("=", 1)[1] for a in args if a.startswith("scope=")), "step")
    if scope == "step":
        return "step", 1
    if scope.startswith("mb:") and scope[3:].isdigit() and int(scope[3:]) > 0:
        return "mb", int(scope[3:])
    raise UsageError(Code.BAD_OPTION_VALUE, f"--rule m2po: scope must be step or mb:N, got {scope!r}")


def _mask_effect(
    keep: np.ndarray, weight: np.ndarray | None = None, raw: np.ndarray | None = None
) -> RuleEffect:
    w = np.ones(keep.shape[0]) if weight is None else weight
    return RuleEffect(np.where(keep, w, 0.0), keep, ~keep, raw)


def _verl_rs(name: str, nums: tuple[float, ...], r: Replay) -> RuleEffect:
    """verl 1dda039 `compute_rollout_rejection_mask`: Δ clamped to ±20; k1 = −Δ in [log lo, log hi]; k2, k3 <= C.

    verl holds Δ in float32 and compares it with the threshold rounded to float32 (a Python float against a
    float32 tensor), so a token on the threshold is decided in float32 here too (tests/analysis/
    test_whatif_verl_own.py plants one); sequence statistics are summed in float64 and rounded once."""
    d = np.clip(r.log_ratio.astype(np.float32), -SAFETY_BOUND, SAFETY_BOUND)  # (M,) float32
    stat = {"k1": -d, "k2": np.float32(0.5) * d * d, "k3": np.exp(d) - np.float32(1.0) - d}[name[-2:]]
    if name.startswith("seq_sum"):
        stat = r.per_token(r.seq_sum(stat)).astype(np.float32)
    elif name.startswith("seq_mean"):
        counts = np.diff(r.offsets)
        stat = r.per_token(r.seq_sum(stat) / (counts + 1e-8)).astype(np.float32)  # verl masked_mean
    elif name.startswith("seq_max"):
        stat = r.per_token(r.seq_max(stat)).astype(np.float32)
    if name.endswith("k1"):
        keep = (stat >= np.float32(math.log(nums[0]))) & (stat <= np.float32(math.log(nums[1])))
    else:
        keep = stat <= np.float32(nums[0])
    return _mask_effect(keep)


def verl_chain(options: list[tuple[str, tuple[float, ...]]], r: Replay) -> RuleEffect:
    """verl's comma-chained `rollout_rs` options: a token is kept iff every option keeps it (logical AND)."""
    keep = np.ones(r.base.shape[0], dtype=bool)
    for name, nums in options:
        keep &= _verl_rs(name, nums, r).keep
    return _mask_effect(keep)


def _batch_normalised(name: str, cap: float, r: Replay) -> RuleEffect:
    """verl `rollout_is_batch_normalize`: truncated weights over their mean in the batch (a step): over tokens for
    token IS, over non-empty sequences for sequence IS; no division when the mean is <= 1e-8."""
    if name == "token_tis_bn":
        raw = np.exp(np.clip(r.log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
        truncated = np.minimum(raw, cap)
        unit = truncated
        owner = r.step[r.token_sample()]
    else:
        seq = np.exp(np.clip(r.seq_sum(r.log_ratio), -SAFETY_BOUND, SAFETY_BOUND))
        raw = r.per_token(seq)
        truncated = r.per_token(np.minimum(seq, cap))
        nonempty = np.diff(r.offsets) > 0
        unit = np.minimum(seq, cap)[nonempty]
        owner = r.step[nonempty]
    out = truncated.copy()
    tok_step = r.step[r.token_sample()]
    for s in np.unique(owner):
        mean = float(np.mean(unit[owner == s]))
        if mean > 1e-8:
            out[tok_step == s] /= mean
    keep = np.ones(out.shape[0], dtype=bool)
    return RuleEffect(out, keep, raw > cap, raw)


def _nemo_rules(name: str, nums: tuple[float, ...], r: Replay) -> RuleEffect:
    """NeMo-RL 7ea279a: seq-mask-tis (loss_functions.py), seq_logprob_error (grpo.py); seq_mean_is as proposed in
    NVIDIA-NeMo/RL#2269 (exp(mean Δ) truncated at C; not in the code at 7ea279a)."""
    d = np.nan_to_num(r.log_ratio, nan=0.0, posinf=0.0, neginf=0.0)
    if name == "seq_mask_tis":
        geo = r.per_token(np.exp(r.seq_mean(d)))
        keep = (geo >= nums[0]) & (geo <= nums[1])
        raw = np.nan_to_num(np.exp(r.log_ratio), nan=0.0, posinf=0.0, neginf=0.0)  # untruncated token IS
        return RuleEffect(np.where(keep, raw, 0.0), keep, ~keep, raw)
    if name == "seq_mean_is":
        raw = r.per_token(np.exp(r.seq_mean(d)))
        return RuleEffect(np.minimum(raw, nums[0]), np.ones(raw.shape[0], bool), raw > nums[0], raw)
    err = r.per_token(r.seq_mean(np.exp(np.abs(d))))  # mean_t exp|Δ_t|, kept iff <= τ
    return _mask_effect(err <= nums[0])


def _opsm(delta: float, r: Replay) -> RuleEffect:
    """TRL 1.16 `get_off_policy_mask`: keep iff Ā >= 0 or mean_t(log μ − log π) <= δ (NaN -> 0). One decision per
    sequence on its mean advantage (slime 624b824 tests A_t < 0 per token, equal within a GRPO sequence)."""
    kl = r.per_token(r.seq_mean(np.nan_to_num(r.base - r.cur, nan=0.0)))
    a_bar = r.per_token(r.seq_mean(r.adv()))
    return _mask_effect((a_bar >= 0) | (kl <= delta))


def _binary_kl(log_p: np.ndarray, log_q: np.ndarray, eps: float) -> np.ndarray:
    """D_bin(p‖q) with p, q clamped to [eps, 1 − eps] (AReaL `compute_binary_kl_divergence`)."""
    p = np.clip(np.exp(log_p), eps, 1 - eps)
    q = np.clip(np.exp(log_q), eps, 1 - eps)
    return p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))


def _trust_region(name: str, nums: tuple[float, ...], r: Replay) -> RuleEffect:
    """prime-rl 559b447 `default_loss_fn`/`ipo_loss_fn` (ρ not detached: g = −A·ρ·keep + 2τ_KL·log ρ), SkyRL a956457
    `dppo_policy_loss` (g = −A·ρ·keep), verl 1dda039 `dppo_tv`/`dppo_kl` (g = −A·sg(min(ρ, 20))·keep)."""
    a = r.adv()
    d = r.log_ratio
    p, mu = np.exp(r.cur), np.exp(r.base)
    diff = p - mu
    if name == "dppo_tv":  # prime-rl: where(A > 0, diff > hi, diff < −lo)
        drop = np.where(a > 0, diff > nums[1], diff < -nums[0])
    elif name == "ipo":
        drop = np.abs(diff) > nums[0]
    elif name == "dppo_kl":  # SkyRL binary_kl, eps 1e-8 inside the log only
        bkl = mu * (r.base - r.cur) + (1 - mu) * np.log((1 - mu + 1e-8) / (1 - p + 1e-8))
        drop = ((a > 0) & (diff > 0) & (bkl > nums[1])) | ((a < 0) & (diff < 0) & (bkl > nums[0]))
    elif name == "verl_dppo_tv":  # valid: A > 0 -> diff <= hi, else diff >= −lo
        drop = ~np.where(a > 0, diff <= nums[1], diff >= -nums[0])
    else:  # verl_dppo_kl
        bkl = mu * (r.base - r.cur) + (1 - mu) * np.log((1.0 - mu + 1e-8) / (1.0 - p + 1e-8))
        drop = ~np.where(a > 0, (bkl <= nums[1]) | (p <= mu), (bkl <= nums[0]) | (p >= mu))
    keep = ~drop
    if name.startswith("verl_"):
        raw = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))
        w = np.minimum(raw, 20.0)  # clip_ratio_c default
        return RuleEffect(np.where(keep, w, 0.0), keep, drop, raw, -a * w * keep)
    if name == "dppo_kl":
        raw = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))  # SkyRL safe_exp_delta clip 20
        return RuleEffect(np.where(keep, raw, 0.0), keep, drop, raw, -a * raw * keep)
    raw = np.exp(d)  # prime-rl: no clamp
    kl_tau = (
        nums[2]
        if name == "dppo_tv" and len(nums) == 3
        else nums[1]
        if name == "ipo" and len(nums) == 2
        else 1e-3
    )
    return RuleEffect(np.where(keep, raw, 0.0), keep, drop, raw, -a * raw * keep + 2.0 * kl_tau * d)


def _areal(words: tuple[str, ...], nums: tuple[float, ...], r: Replay) -> RuleEffect:
    """AReaL cbff54d `apply_rejection_sampling` (`RejectionSamplingConfig`): metric per token, aggregated per
    sequence (ratio: geometric mean in log space; KL metrics arithmetic), bounds `lower <= x <= upper`
    (`metric <= upper` without lower); mask drops, clamp truncates the weight. Non-finite Δ -> 0."""
    level, action, metric, agg = words
    upper, lower = nums[0], (nums[1] if len(nums) == 2 else None)
    d = np.where(np.isfinite(r.log_ratio), r.log_ratio, 0.0)
    if metric == "ratio":
        stat = np.exp(d)
    elif metric == "binary_kl":
        stat = np.maximum(_binary_kl(r.cur, r.base, 1e-8), _binary_kl(r.base, r.cur, 1e-8))
    else:  # AReaL KLEstimator on (proximal, behaviour), apply_clamp=False
        stat = {"kl_k1": d, "kl_k2": d * d / 2.0, "kl_k3": np.exp(-d) - 1 + d}[metric]
    weight = np.exp(d)

    def inside(x: np.ndarray) -> np.ndarray:
        return (x >= lower) & (x <= upper) if lower is not None else x <= upper

    if level == "sequence":
        if metric == "ratio":
            weight = r.per_token(np.exp(r.seq_mean(d)))
            values = d
        else:
            values = stat
        seq = {"sum": r.seq_sum, "mean": r.seq_mean, "max": r.seq_max}[agg](values)
        ok = r.per_token(inside(np.exp(seq) if metric == "ratio" else seq))
    else:
        ok = inside(stat)
    if action == "mask":
        return _mask_effect(ok, weight, weight)
    bounded = np.clip(weight, lower if lower is not None else 0.0, upper)
    # token level clamps every weight to the bounds (whatever the metric); sequence level only out-of-bounds ones
    clamped = bounded if level == "token" else np.where(ok, weight, bounded)
    return RuleEffect(clamped, np.ones(d.shape[0], bool), clamped != weight, weight)


def _m2po_mask(m2: np.ndarray, tau: float) -> np.ndarray:
    """AReaL `_get_m2po_loss_mask` on one tensor: sort m2 descending, mask the first k where k is the first index
    whose suffix mean is strictly below τ, else n − 1 (always keeps one)."""
    n = m2.shape[0]
    if n == 0:
        return np.ones(0, dtype=bool)
    order = np.argsort(-m2, kind="stable")
    sorted_m2 = m2[order]
    suffix_mean = np.cumsum(sorted_m2[::-1])[::-1] / np.arange(n, 0, -1)
    below = np.flatnonzero(suffix_mean < tau)
    k = int(below[0]) if below.shape[0] else n - 1
    keep_sorted = np.ones(n, dtype=bool)
    keep_sorted[:k] = False
    keep = np.empty(n, dtype=bool)
    keep[order] = keep_sorted
    return keep


def _m2po(tau: float, scope: tuple[str, int], r: Replay) -> RuleEffect:
    """AReaL cbff54d `_apply_m2po_masking`: m2 = (log μ − log π_prox)², sorted over each micro-batch tensor; masked
    tokens stay in the loss denominator (`loss_weight_fn` counts the loss mask before M2PO): weight 0, kept."""
    m2 = (r.base - r.cur) ** 2
    keep = np.ones(m2.shape[0], dtype=bool)
    tok_sample = r.token_sample()
    for s in np.unique(r.step):
        samples = np.flatnonzero(r.step == s)
        groups = np.array_split(samples, scope[1]) if scope[0] == "mb" else [samples]
        for group in groups:
            tok = np.isin(tok_sample, group)
            keep[tok] = _m2po_mask(m2[tok], tau)
    return RuleEffect(keep.astype(np.float64), np.ones(m2.shape[0], bool), ~keep, None)


def _roll(words: tuple[str, ...], nums: tuple[float, ...], r: Replay) -> RuleEffect:
    """ROLL 8eb27cc `compute_train_infer_correction` filter: ratio (e^Δ) or probability difference (p_old − p_infer)
    per token / geometric (mean) / sequence (sum, product) / segment (mean over a run of consecutive positions);
    kept iff lo <= x <= hi. No clamp of Δ."""
    agg, kind = words
    d = r.log_ratio
    x = d if kind == "ratio" else np.exp(r.cur) - np.exp(r.base)
    if agg == "geometric":
        x = r.per_token(r.seq_mean(x))
    elif agg == "sequence":
        x = r.per_token(r.seq_sum(x))
    elif agg == "segment":
        tok_sample = r.token_sample()
        new_seg = np.ones(x.shape[0], dtype=bool)
        new_seg[1:] = (tok_sample[1:] != tok_sample[:-1]) | (r.pos[1:] != r.pos[:-1] + 1)
        seg = np.cumsum(new_seg) - 1
        x = (np.bincount(seg, weights=x) / np.bincount(seg))[seg]
    if kind == "ratio":
        with np.errstate(over="ignore"):
            x = np.exp(x)
    return _mask_effect((x >= nums[0]) & (x <= nums[1]))


def _proximal_theta(name: str, nums: tuple[float, ...], r: Replay) -> RuleEffect:
    """Loss forms on π_θ/π_old (verl 1dda039 core_algos, ROLL 8eb27cc TOPR, SkyRL a956457 rollout_is)."""
    a = r.adv()
    d = r.log_ratio
    rho = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))
    ones = np.ones(d.shape[0], dtype=bool)
    if name == "cispo":  # −sg(clip(ρ, 1 − lo, 1 + hi))·A·log π
        w = np.clip(rho, 1 - nums[0], 1 + nums[1])
        return RuleEffect(w, ones, w != rho, rho, -a * w)
    if name == "rollout_is":  # SkyRL: ρ = π/μ, hard zero outside the open band (strict < and >)
        inside = (rho > 1 - nums[0]) & (rho < 1 + nums[1])
        w = np.where(inside, rho, 0.0)
        return RuleEffect(w, ones, ~inside, rho, -a * w)
    if name == "sapo":  # ℓ = −A·(4/τ)·σ(τ(ρ−1)); τ = τ_pos if A > 0 else τ_neg; ∂ℓ/∂log π = −A·4σ(1−σ)·ρ
        tau = np.where(a > 0, nums[0], nums[1])
        sig = 1.0 / (1.0 + np.exp(-tau * (rho - 1.0)))
        w = 4.0 * sig * (1 - sig) * rho
        return RuleEffect(w, ones, np.zeros(d.shape[0], bool), rho, -a * w)
    if name == "gmpo":  # ρ_seq = exp(mean_t sgn(A)·min(sgn(A)Δ, sgn(A)clip(Δ, −lo, hi))); loss −Ā·ρ_seq
        sgn = np.sign(a)
        clipped = np.clip(d, -nums[0], nums[1])
        used = sgn * np.minimum(sgn * d, sgn * clipped)
        counts = np.diff(r.offsets)
        rho_seq = r.per_token(np.exp(r.seq_sum(used) / (counts + 1e-8)))
        a_bar = r.per_token(r.seq_sum(a) / (counts + 1e-8))
        live = used == d  # a clipped token's Δ is a constant: no gradient through it
        return RuleEffect(rho_seq, ones, ~live, r.per_token(np.exp(r.seq_mean(d))), -a_bar * rho_seq * live)
    if name == "topr":  # ROLL: scores > 0 -> −w₊·A·log π; else −w₋·sg(clip(ρ, 0, 1))·A·log π
        w_pos, w_neg = (*nums, 1.0, 1.0)[:2]
        positive = r.per_token(r.reward > 0) if r.reward is not None else r.per_token(r.seq_mean(a) > 0)
        w = np.where(positive, w_pos, w_neg * np.clip(rho, 0.0, 1.0))
        return RuleEffect(w, ones, ~positive & (rho > 1.0), rho, -a * w)
    if name == "dro":  # verl: −(A log π − β/2 (log ρ)²): g = −A + β·log ρ
        return RuleEffect(np.ones(d.shape[0]), ones, np.zeros(d.shape[0], bool), rho, -a + nums[0] * d)
    return _trust_region(name, nums, r)


def _ref_kl(r: Replay) -> RuleEffect:
    """prime-rl 559b447 `ref_kl_loss_fn`: drop where p − μ < −0.2; ℓ = −sg(log π_ref − log π)·ρ·keep + 1e-3·(log ρ)²,
    ρ = π/μ not detached: g = −(log π_ref − log π)·ρ·keep + 2e-3·Δ (the scalar advantage is not read)."""
    if r.ref is None:
        raise UsageError(Code.STREAM_NOT_FOUND, "ref_kl needs a `ref` stream")
    d = r.log_ratio
    keep = ~(np.exp(r.cur) - np.exp(r.base) < -0.2)
    raw = np.exp(d)
    ref_adv = r.ref - r.cur
    return RuleEffect(np.where(keep, raw, 0.0), keep, ~keep, raw, -ref_adv * raw * keep + 2e-3 * d)


def apply_named_rule(name: str, args: tuple[str, ...], r: Replay) -> RuleEffect:
    """The effect of rule `name` with its `args` (strings as given after `NAME:`) on the replayed batch `r`."""
    if "+" in name:  # a verl chain: token_k1:0.5,2+seq_max_k2:1 arrives split by the caller
        raise UsageError(Code.BAD_OPTION_VALUE, f"--rule {name}: chain verl options as OPT:ARGS+OPT:ARGS")
    words, nums = parse_rule_args(name, args)
    if name in VERL_RS_OPTIONS:
        return _verl_rs(name, nums, r)
    if name in ("token_tis_bn", "seq_tis_bn"):
        return _batch_normalised(name, nums[0], r)
    if name in ("seq_mask_tis", "seq_mean_is", "seq_logprob_error"):
        return _nemo_rules(name, nums, r)
    if name == "opsm":
        return _opsm(nums[0], r)
    if name == "kpop":  # AReaL binary_kl, token level, mask
        return _areal(("token", "mask", "binary_kl", "mean"), nums, r)
    if name == "areal_rs":
        return _areal(words, nums, r)
    if name == "m2po":
        return _m2po(nums[0], m2po_scope(args), r)
    if name == "token_veto":  # drop the sequence if min_t ρ_t < τ (Δ clamped to ±20)
        rho = np.exp(np.clip(r.log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
        return _mask_effect(r.per_token(r.seq_min(rho)) >= nums[0])
    if name == "roll":
        return _roll(words, nums, r)
    if name == "ref_kl":
        return _ref_kl(r)
    return _proximal_theta(name, nums, r)
