"""`compute_step_style`: dispatch, native counts and status, notices, and the cross-framework traps of
docs/key-styles.md checked on one batch under several styles (each number written out by hand)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from style_batches import make_batch, settings_for, values_of, worked_example

from pgdiag.errors import UsageError
from pgdiag.metrics.styles import STYLE_NAMES, check_style_settings
from pgdiag.metrics.styles.steps import compute_step_style

E = math.exp


def styled(style: str, batch, **overrides) -> dict[str, float | None]:
    return values_of(compute_step_style(batch, settings_for(style, batch, **overrides)))


@pytest.mark.parametrize("style", STYLE_NAMES)
def test_every_style_emits_native_counts(style: str) -> None:
    batch = make_batch(new=[[-1.0, -2.0], []], old=[[-1.5, -2.0], []], adv=[[1.0, 1.0], []], group=[0, 0])
    result = compute_step_style(batch, settings_for(style, batch))
    got = values_of(result)
    assert got["count/tokens"] == 2 and got["count/samples"] == 2 and got["count/samples_empty"] == 1
    assert got["count/groups"] == 1
    assert "count/groups_split" not in got  # unknown to a one-step call: left out, not guessed
    assert result.status == "ok"
    with_split = values_of(compute_step_style(batch, settings_for(style, batch), groups_split=1))
    assert with_split["count/groups_split"] == 1


def test_nonfinite_status_and_metric_reduction_notice() -> None:
    batch = make_batch(new=[[-1.0, -1.0]], old=[[-math.inf, -1.0]], adv=[[1.0, 1.0]])
    result = compute_step_style(batch, settings_for("verl", batch, metric_reduction="document"))
    assert result.status == "nonfinite"
    assert any("--metric-reduction document ignored" in n for n in result.notices)


def test_native_style_name_is_not_a_framework_style() -> None:
    batch = worked_example()
    with pytest.raises(UsageError):
        compute_step_style(batch, settings_for("pgdiag", batch))
    with pytest.raises(UsageError):
        check_style_settings(settings_for("openrlhf", batch))


def test_missing_stream_is_a_usage_error() -> None:
    batch = worked_example()
    with pytest.raises(UsageError, match="rollout"):
        compute_step_style(batch, settings_for("verl", batch, stream_a="rollout", stream_b="old"))


def test_trap_1_band_versus_binding_on_the_worked_example() -> None:
    batch = worked_example()
    # band (any A), per document: Fast-LLM and PipelineRL
    assert styled("fast-llm", batch)["grpo_clipped_ratio_fraction"] == pytest.approx(0.458333, abs=5e-7)
    assert styled("pipelinerl", batch)["rl/clamp_log_ratio_new_old_indicator"] == pytest.approx(
        0.458333, abs=5e-7
    )
    # binding: verl token mean with +1e-8, TRL and Liger with max(N, 1), miles per-sample mean
    assert styled("verl", batch)["actor/pg_clipfrac"] == pytest.approx(4 / (13 + 1e-8), rel=1e-12)
    assert styled("trl", batch)["clip_ratio/region_mean"] == pytest.approx(4 / 13, rel=1e-12)
    assert styled("liger", batch)["clip_ratio"] == pytest.approx(4 / 13, rel=1e-12)
    assert styled("miles", batch)["train/pg_clipfrac"] == pytest.approx(0.3125, rel=1e-12)


def test_trap_3_kl_directions_signs_and_clamps() -> None:
    # policy pair: d = lp_new − lp_old = (0.4, −0.2); reference: lp_ref − lp_new = (12, 0.5)
    batch = make_batch(new=[[-13.0, -1.2]], old=[[-13.4, -1.0]], ref=[[-1.0, -0.7]], adv=[[1.0, 1.0]])
    d = [0.4, -0.2]
    # k1 of KL(old‖new) is −d: verl token mean (+1e-8) and miles sample mean agree in sign here
    assert styled("verl", batch)["actor/ppo_kl"] == pytest.approx(-(0.4 - 0.2) / (2 + 1e-8), rel=1e-9)
    assert styled("miles", batch)["train/ppo_kl"] == pytest.approx(-(0.4 - 0.2) / 2, rel=1e-9)
    # Fast-LLM / PipelineRL kl_new_old is k3 = r − 1 − d ≥ 0 (KL(old‖new) despite the name)
    k3 = math.fsum(E(x) - 1 - x for x in d) / 2
    assert styled("fast-llm", batch)["grpo_kl_new_old"] == pytest.approx(k3, rel=1e-12)
    assert styled("pipelinerl", batch)["rl/kl_new_old"] == pytest.approx(k3, rel=1e-12)
    # reference KL: TRL/Liger k3 unclamped; verl low_var_kl clamps the result to 10; PipelineRL clamps the
    # log-ratio to 10; miles k1 is lp_new − lp_ref (negative here)
    x = [12.0, 0.5]
    ref_k3 = [E(v) - v - 1 for v in x]
    # TRL 1.16 multiplies its KL by the ratio r = e^d by default (use_bias_correction_kl)
    weighted = math.fsum(k * E(v) for k, v in zip(ref_k3, d, strict=True)) / 2
    assert styled("trl", batch, beta=0.1)["kl"] == pytest.approx(weighted, rel=1e-12)
    unweighted = styled("trl", batch, beta=0.1, kl_bias_correction=False)["kl"]
    assert unweighted == pytest.approx(math.fsum(ref_k3) / 2, rel=1e-12)
    assert styled("liger", batch)["kl"] == pytest.approx(math.fsum(ref_k3) / 2, rel=1e-12)
    assert styled("verl", batch)["actor/kl_loss"] == pytest.approx((10.0 + ref_k3[1]) / 2, rel=1e-12)
    assert styled("pipelinerl", batch)["rl/kl"] == pytest.approx((E(10.0) - 11 + ref_k3[1]) / 2, rel=1e-12)
    assert styled("miles", batch)["train/kl_loss"] == pytest.approx(-(12.0 + 0.5) / 2, rel=1e-12)


def test_trap_5_and_6_one_empty_sample_under_each_guard() -> None:
    # s0: one token, d = 0.5, A = 1 (band and binding high); s1: fully masked
    batch = make_batch(new=[[-0.5], []], old=[[-1.0], []], adv=[[1.0], []])
    assert styled("verl", batch)["actor/pg_clipfrac"] == pytest.approx(1 / (1 + 1e-8), rel=1e-14)
    assert styled("trl", batch, aggregation="grpo")["loss"] == pytest.approx(-1.2 / 2)  # B = 2 counts s1
    assert styled("miles", batch)["train/pg_clipfrac"] == pytest.approx(1 / 2)  # S = 2 counts s1
    assert styled("fast-llm", batch)["grpo_clipped_ratio_fraction"] == pytest.approx(1 / 2)  # D = 2
    assert styled("verl", batch, aggregation="seq-mean-token-mean", empty_seqs="skip")[
        "actor/pg_loss"
    ] == pytest.approx(-1.2 / (1 + 1e-8) / 1, rel=1e-12)  # S+ = 1 without global batch info


def test_many_samples_of_random_length_including_empty_ones() -> None:
    # 2,000 samples of 0-8 tokens, d = 0.1 everywhere: miles averages per sample (empty ones add 0)
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, size=2000)
    old = [list(rng.normal(-1.0, 0.3, n)) for n in lengths]
    new = [[x + 0.1 for x in row] for row in old]
    adv = [[1.0] * n for n in lengths]
    batch = make_batch(new=new, old=old, adv=adv)
    got = styled("miles", batch)
    n_nonempty = int(np.count_nonzero(lengths))
    assert got["train/ppo_kl"] == pytest.approx(-0.1 * n_nonempty / 2000, rel=1e-9)
    assert styled("verl", batch)["actor/ppo_kl"] == pytest.approx(
        -0.1 * lengths.sum() / (lengths.sum() + 1e-8)
    )


@pytest.mark.parametrize("seed", range(4))
def test_styles_agree_with_the_native_engine_where_definitions_coincide(seed: int) -> None:
    """Identities between two independent implementations: on random batches with |d| < 1 (no clamp, no
    r > 3) and A constant per sample, the framework losses equal the native modes they alias."""
    from pgdiag.metrics.engine import compute_step_native

    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 7, size=12)
    old = [list(rng.uniform(-3.0, -0.1, n)) for n in lengths]
    new = [[x + rng.uniform(-0.9, 0.9) for x in row] for row in old]
    adv = [[a] * n for a, n in zip(rng.normal(0.0, 1.0, 12), lengths, strict=True)]
    batch = make_batch(new=new, old=old, adv=adv, group=list(np.arange(12) // 3))

    def native(**overrides):
        return values_of(compute_step_native(batch, settings_for("pgdiag", batch, **overrides)))

    tokens, documents = native(), native(metric_reduction="document")
    n = tokens["count/tokens"]
    assert styled("verl", batch)["actor/pg_loss"] == pytest.approx(tokens["loss/token_mean"], rel=1e-9)
    assert styled("fast-llm", batch)["grpo"] == pytest.approx(tokens["loss/token_mean"], rel=1e-9)
    assert styled("trl", batch, aggregation="grpo")["loss"] == pytest.approx(
        tokens["loss/sample_mean"], rel=1e-9
    )
    assert styled("miles", batch)["train/pg_loss"] == pytest.approx(tokens["loss/sample_mean"], rel=1e-9)
    assert styled("miles", batch, aggregation="prompt_mean")["train/pg_loss"] == pytest.approx(
        tokens["loss/prompt_mean"], rel=1e-9
    )
    assert styled("verl", batch)["actor/pg_clipfrac"] == pytest.approx(
        tokens["policy/clip_frac_binding"] * n / (n + 1e-8), rel=1e-9
    )
    assert styled("fast-llm", batch)["grpo_clipped_ratio_fraction"] == pytest.approx(
        documents["policy/clip_frac_band"], rel=1e-9
    )
    assert styled("pipelinerl", batch)["rl/ess"] == pytest.approx(tokens["policy/ess_token"], rel=1e-9)
