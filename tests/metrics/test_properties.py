"""Property tests: the vectorised engine against slow per-token loops with `math.fsum` on random batches.

The reference re-derives each key from docs/metrics.md with plain Python floats (exactly rounded sums)
or `decimal` at 50 digits (sequence ESS), independently of pgdiag's reducers.
"""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from metrics_batch_factory import make_batch

from pgdiag.metrics.engine import compute_step_native
from pgdiag.metrics.mismatch import fit_temperature, tempered_logprobs
from pgdiag.metrics.settings import MetricSettings

EPS_LOW, EPS_HIGH = 0.2, 0.28
ADVANTAGES = st.sampled_from([-1.5, -0.5, 0.0, 0.5, 2.0])

sample_strategy = st.integers(min_value=0, max_value=5).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-12.0, -0.01), min_size=n, max_size=n),  # lp_old
        st.lists(st.floats(-1.5, 1.5), min_size=n, max_size=n),  # d
        st.lists(ADVANTAGES, min_size=n, max_size=n),  # per-token A
        st.sampled_from(["a", "b", "c"]),
    )
)
batch_strategy = st.lists(sample_strategy, min_size=1, max_size=7)


def build(samples, constant_advantages=False):
    """The batch; with `constant_advantages` each sample keeps its first advantage on every token (the
    per-sequence case, which the engine reduces per sample)."""
    old = [list(s[0]) for s in samples]
    new = [[o + d for o, d in zip(s[0], s[1], strict=True)] for s in samples]
    adv = [[s[2][0]] * len(s[2]) if constant_advantages and s[2] else list(s[2]) for s in samples]
    return make_batch(new=new, old=old, advantages=adv, groups=[s[3] for s in samples])


def reference_tokens(batch):
    """Per sample: list of (d, r, A) from the batch's own float64 inputs, by plain loops."""
    out = []
    new, old, adv = batch.streams["new"], batch.streams["old"], batch.advantages
    for i in range(batch.n_samples):
        lo, hi = int(batch.offsets[i]), int(batch.offsets[i + 1])
        out.append(
            [(float(new[t] - old[t]), math.exp(float(new[t] - old[t])), float(adv[t])) for t in range(lo, hi)]
        )
    return out


def clip(x):
    return min(max(x, 1 - EPS_LOW), 1 + EPS_HIGH)


def is_dual(r, a, dual_clip):
    return dual_clip is not None and a < 0 and max(r, clip(r)) > dual_clip


def token_loss(r, a, dual_clip):
    loss = max(-a * r, -a * clip(r))
    return min(loss, -dual_clip * a) if dual_clip is not None and a < 0 else loss


def r_mean(per_sample, f, mode):
    """R(f) by loops (one document per sample here)."""
    tokens = [f(*tok) for s in per_sample for tok in s]
    if not tokens:
        return None
    if mode == "token":
        return math.fsum(tokens) / len(tokens)
    means = [math.fsum(f(*tok) for tok in s) / len(s) for s in per_sample if s]
    denominator = len(means) if mode == "sample" else len(per_sample)
    return math.fsum(means) / denominator


def reference_losses(per_sample, groups, divisor, dual_clip):
    n_i = [len(s) for s in per_sample]
    n, n_samples = sum(n_i), len(per_sample)
    tok = [math.fsum(token_loss(r, a, dual_clip) for _, r, a in s) for s in per_sample]
    seq = []
    for s in per_sample:
        ratio = math.exp(math.fsum(d for d, _, _ in s) / len(s)) if s else 1.0
        seq.append(math.fsum(max(-a * ratio, -a * clip(ratio)) for _, _, a in s))
    names = sorted(set(groups))
    n_g = {g: sum(k for k, h in zip(n_i, groups, strict=True) if h == g) for g in names}
    sum_g = {g: math.fsum(x for x, h in zip(tok, groups, strict=True) if h == g) for g in names}
    if n == 0:
        return {}
    return {
        "token_mean": math.fsum(tok) / n,
        "sample_mean": math.fsum(x / k for x, k in zip(tok, n_i, strict=True) if k) / n_samples,
        "prompt_mean": math.fsum(sum_g[g] / n_g[g] for g in names if n_g[g]) / len(names),
        "constant": math.fsum(tok) / (divisor * n_samples),
        "seq_mean_token_sum": math.fsum(tok) / n_samples,
        "token_sum": math.fsum(tok),
        "gspo_seq_mean": math.fsum(x / k for x, k in zip(seq, n_i, strict=True) if k) / n_samples,
        "gspo_length_prop": math.fsum(seq) / n_samples,
        "gspo_token_mean": math.fsum(seq) / n,
    }


def close(got, want, tol=1e-11):
    if want is None:
        return got is None
    return got is not None and math.isclose(got, want, rel_tol=tol, abs_tol=tol)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch_strategy,
    st.sampled_from(["token", "sample", "document"]),
    st.booleans(),
    st.sampled_from([None, 1.1, 3.0]),
)
# every token stopped (dual clip, then the low clip) in a sample of one advantage: Σr − ρ left 1e-15 of
# "passing gradient", so band_nonbinding_grad_share read 0.0 where no gradient passes at all (0 / 0)
@example([([-1.0] * 5, [1.0, 1.0, 0.5, -1.0, -1.0], [-1.5] * 5, "a")], "token", False, 1.1)
def test_engine_matches_slow_reference(samples, mode, constant_advantages, dual_clip):
    batch = build(samples, constant_advantages)
    config = MetricSettings.from_options(
        new="new",
        old="old",
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        divisor=3.0,
        metric_reduction=mode,
        dual_clip=dual_clip,
    )
    got = {v.key: v.value for v in compute_step_native(batch, config).values}
    per_sample = reference_tokens(batch)
    low, high = 1 - EPS_LOW, 1 + EPS_HIGH
    expected = {
        "policy/ratio_mean": r_mean(per_sample, lambda d, r, a: r, mode),
        "policy/kl_k3": r_mean(per_sample, lambda d, r, a: r - 1 - d, mode),
        "policy/kl_k1": r_mean(per_sample, lambda d, r, a: -d, mode),
        "policy/clip_frac_band": r_mean(per_sample, lambda d, r, a: float(r < low or r > high), mode),
        "policy/clip_frac_binding": r_mean(
            per_sample, lambda d, r, a: float((a > 0 and r > high) or (a < 0 and r < low)), mode
        ),
        "policy/clip_frac_low": r_mean(per_sample, lambda d, r, a: float(a < 0 and r < low), mode),
        "policy/clip_frac_high": r_mean(per_sample, lambda d, r, a: float(a > 0 and r > high), mode),
        "policy/zero_grad_frac": r_mean(
            per_sample,
            lambda d, r, a: float(
                a == 0 or (a > 0 and r > high) or (a < 0 and r < low) or is_dual(r, a, dual_clip)
            ),
            mode,
        ),
    }
    if dual_clip is not None:
        expected["policy/dual_clip_frac"] = r_mean(
            per_sample, lambda d, r, a: float(is_dual(r, a, dual_clip)), mode
        )
    # token-level vs sequence-level clip decisions, and the gradient magnitudes (uniform weights)
    agree, grad_tok, grad_band, grad_seq = [], [], [], []
    for s in per_sample:
        seq_r = math.exp(math.fsum(d for d, _, _ in s) / len(s)) if s else 1.0
        for _, r, a in s:
            bind = (a > 0 and r > high) or (a < 0 and r < low)
            bind_seq = (a > 0 and seq_r > high) or (a < 0 and seq_r < low)
            agree.append(float(bind == bind_seq))
            passing = 0.0 if bind or is_dual(r, a, dual_clip) else abs(a) * r
            grad_tok.append(passing)
            grad_band.append(passing if (r < low or r > high) else 0.0)
            grad_seq.append(0.0 if bind_seq else abs(a) * seq_r)
    if agree and mode == "token":
        expected["policy/seq_token_clip_agreement"] = math.fsum(agree) / len(agree)
    if agree:
        expected["grad/token_sum_scale"] = math.fsum(grad_tok)
        expected["grad/gspo_length_prop_scale"] = math.fsum(grad_seq) / len(per_sample)
        total = math.fsum(grad_tok)
        expected["policy/band_nonbinding_grad_share"] = math.fsum(grad_band) / total if total > 0 else None
    for key, want in expected.items():
        assert close(got[key], want), (key, got[key], want)
    groups = [s[3] for s in samples]
    for name, want in reference_losses(per_sample, groups, 3.0, dual_clip).items():
        assert close(got[f"loss/{name}"], want), (name, got[f"loss/{name}"], want)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-30.0, 30.0), min_size=1, max_size=6), min_size=1, max_size=6))
def test_ess_seq_in_log_space_matches_50_digit_reference(log_ratios):
    getcontext().prec = 50
    old = [[-1.0] * len(s) for s in log_ratios]
    new = [[-1.0 + d for d in s] for s in log_ratios]
    batch = make_batch(new=new, old=old)
    got = {
        v.key: v.value
        for v in compute_step_native(batch, MetricSettings.from_options(new="new", old="old")).values
    }
    d = batch.streams["new"] - batch.streams["old"]
    sums = [math.fsum(d[int(batch.offsets[i]) : int(batch.offsets[i + 1])]) for i in range(batch.n_samples)]
    weights = [Decimal(x).exp() for x in sums]
    want = sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))
    assert got["policy/ess_seq"] == pytest.approx(float(want), rel=1e-12)


def test_fit_temperature_recovers_a_one_sided_temperature():
    rng = np.random.default_rng(7)
    logits = rng.normal(0.0, 3.0, size=(64, 50))  # (M, V) side b's logits
    targets = rng.integers(0, 50, size=64)
    target_logits = logits[np.arange(64), targets]
    lp_a = tempered_logprobs(target_logits, logits, 0.7)  # the sampler applied T = 0.7
    fit = fit_temperature(target_logits, logits, lp_a)
    assert fit.tau == pytest.approx(0.7, rel=1e-5)
    assert fit.rms == pytest.approx(0.0, abs=1e-5)
    plain = fit_temperature(target_logits, logits, tempered_logprobs(target_logits, logits, 1.0))
    assert plain.tau == pytest.approx(1.0, rel=1e-5)
    # the fitted τ beats its grid neighbours
    noisy = lp_a + rng.normal(0.0, 0.05, size=64)
    best = fit_temperature(target_logits, logits, noisy)
    for tau in (best.tau * 0.99, best.tau * 1.01):
        resid = tempered_logprobs(target_logits, logits, tau) - noisy
        assert math.sqrt(float(np.mean(resid**2))) >= best.rms
    assert fit_temperature(np.zeros(0), np.zeros((0, 5)), np.zeros(0)).tau is None
