"""`pool_style_steps`: a key style's `all` row from its per-step results equals the style run on the pooled
batch (the pre-streaming `all` row), for every style and flag, on `sample_data/` and on synthetic runs with
uneven and empty steps, non-finite values and groups straddling `--docs-per-step` cuts; plus hand-computed
two-step examples of every pooling rule.

Tolerance: a value whose pooled arithmetic is the same (counts, sums of integers, extrema, fractions of an
integer count, the loss keys' mean over steps) must be bit-identical. A token, sample or document mean is a
sum regrouped by step (numerator_s = value_s · weight_s, then Σ_s), so it may differ in the last bits:
``|a − b| <= 1e-12·max(|a|, |b|) + 1e-15`` (the absolute part covers means that cancel to ~1e-17 from terms
of order one, such as group-normalised advantages). verl's IS-weight std is E[w²] − E[w]² in one pass on
both sides, so it is compared as std² within 1e-13·E[w²].
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from metrics_batch_factory import make_batch

import pgdiag
from pgdiag.data.batch import TokenBatch
from pgdiag.data.runs import read_token_batch
from pgdiag.metrics.api import metric_streams, resolve_streams
from pgdiag.metrics.engine import StepMetrics, compute_by_step
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.styles import STYLE_NAMES, compute_step_style
from pgdiag.metrics.styles.pooled import POOL_RULES, PoolRule, pool_rules

SAMPLE_DATA = Path(__file__).resolve().parents[2] / "sample_data"
WHOLE_GROUP_KEYS = {"count/groups", "count/groups_singleton", "count/groups_split", "frac_reward_zero_std"}

# every style with each of its flags (docs/key-styles.md)
STYLE_FLAGS: list[tuple[str, dict[str, object]]] = [
    ("fast-llm", {}),
    ("fast-llm", {"level": "sequence"}),
    ("fast-llm", {"loss_name": "pg"}),
    ("verl", {}),
    ("verl", {"aggregation": "seq-mean-token-mean"}),
    ("verl", {"aggregation": "token-sum"}),
    ("verl", {"aggregation": "seq-mean-token-sum", "empty_seqs": "skip"}),
    ("verl", {"aggregation": "constant", "divisor": 64.0}),
    ("verl", {"rollout_is": "token", "rollout_is_threshold": 1.05}),
    ("verl", {"level": "sequence"}),
    ("verl", {"dual_clip": 2.0}),
    ("trl", {}),
    ("trl", {"aggregation": "grpo"}),
    ("trl", {"aggregation": "bnpo"}),
    ("trl", {"aggregation": "dr_grpo", "divisor": 16.0}),
    ("trl", {"aggregation": "luspo"}),
    ("trl", {"level": "sequence"}),
    ("trl", {"beta": 0.04}),
    ("trl", {"beta": 0.04, "kl_bias_correction": False, "vllm_is": False}),
    ("liger", {}),
    ("liger", {"aggregation": "luspo", "pad_width": 12}),
    ("liger", {"aggregation": "dr_grpo", "divisor": 16.0}),
    ("liger", {"level": "sequence"}),
    ("liger", {"beta": 0.0}),
    ("miles", {}),
    ("miles", {"aggregation": "miles:token_mean"}),
    ("miles", {"aggregation": "prompt_mean"}),
    ("miles", {"aggregation": "constant", "divisor": 32.0}),
    ("miles", {"tis": True}),
    ("miles", {"mismatch_metrics": True, "dual_clip": 3.0}),
    ("pipelinerl", {}),
    ("pipelinerl", {"batch_size": 4}),
    ("pipelinerl", {"group_normalize": True}),
    ("pipelinerl", {"kl_coef": 0.0}),
]


# ---- the reference: the style on the pooled batch (the all row before streaming) -------------------------


def _documents_ignoring_steps(batch: TokenBatch) -> np.ndarray:
    """(S,) document index by consecutive equal sample_id (what --docs-per-step counts)."""
    same = batch.sample_id[1:] == batch.sample_id[:-1]
    return np.concatenate([[0], np.cumsum(~same)]).astype(np.int64)


def reference_all_row(batch: TokenBatch, settings: MetricSettings, steps: list[StepMetrics]) -> StepMetrics:
    """`compute_step_style` on the whole batch with groups keyed by (step, group) (whole again under
    --docs-per-step), the loss (``mode``) keys replaced by their mean over the steps with a value."""
    if settings.docs_per_step is None:
        _, step_code = np.unique(batch.step, return_inverse=True)
        key = step_code.reshape(-1).astype(np.int64) * (int(batch.group.max()) + 1) + batch.group
        _, pooled_group = np.unique(key, return_inverse=True)
        pooled = replace(batch, group=pooled_group.reshape(-1).astype(np.int64))
        n_split = 0
    else:
        step = _documents_ignoring_steps(batch) // settings.docs_per_step
        pooled = batch.with_steps(step)
        steps_of_group = {g: set(step[batch.group == g].tolist()) for g in np.unique(batch.group)}
        n_split = sum(1 for s in steps_of_group.values() if len(s) > 1)
    whole = compute_step_style(pooled, settings, groups_split=n_split)
    values = []
    for v in whole.values:
        if v.reduction == "mode":
            numbers = [s.by_key()[v.key].value for s in steps if v.key in s.by_key()]
            numbers = [x for x in numbers if x is not None]
            mean = None
            if numbers:
                finite = all(math.isfinite(x) for x in numbers)
                mean = (math.fsum(numbers) if finite else sum(numbers)) / len(numbers)
            v = replace(v, value=mean, n=len(numbers))
            if mean is not None and math.isnan(mean):
                v = replace(v, value=None)
        values.append(v)
    return replace(whole, values=tuple(values))


def _exact(rule: PoolRule, unit: str) -> bool:
    """Rules whose pooled arithmetic is the reference's own: the result must be bit-identical."""
    return rule.kind in ("mode", "max", "min") or rule.integer or (rule.kind == "sum" and unit == "count")


def assert_pooled_equals_reference(batch: TokenBatch, settings: MetricSettings) -> StepMetrics:
    """Run the style per step, pool, and compare every key with the reference all row."""
    rows = compute_by_step(
        batch, settings, lambda b, s, n: compute_step_style(b, s, groups_split=n, partials=True)
    )
    steps = [m for label, m in rows if label != "all"]
    got = rows[-1][1]
    assert rows[-1][0] == "all"
    want = reference_all_row(batch, settings, steps)
    assert [v.key for v in got.values] == [v.key for v in want.values]
    assert got.status == want.status
    assert set(want.notices) <= set(got.notices)
    rules = pool_rules(settings)
    straddle = any(s.by_key()["count/groups_split"].value for s in steps)
    for a, b in zip(got.values, want.values, strict=True):
        assert (a.unit, a.reduction) == (b.unit, b.reduction), a.key
        if straddle and a.key in WHOLE_GROUP_KEYS:
            assert a.value is None
            assert any(a.key in n and "straddle" in n for n in got.notices)
            continue
        assert a.n == b.n, (a.key, a.n, b.n)
        if a.value is None or b.value is None:
            assert a.value is b.value, (a.key, a.value, b.value)
            continue
        rule = rules[a.key]
        if _exact(rule, a.unit) or not math.isfinite(b.value):
            assert a.value == b.value, (a.key, a.value, b.value)
        elif a.key == "rollout_corr/rollout_is_std":
            second = next(v.value for v in want.values if v.key == "rollout_corr/rollout_is_mean") ** 2
            assert abs(a.value**2 - b.value**2) <= 1e-13 * (second + b.value**2), (a.key, a.value, b.value)
        else:
            assert abs(a.value - b.value) <= 1e-12 * max(abs(a.value), abs(b.value)) + 1e-15, (
                a.key,
                a.value,
                b.value,
            )
    return got


# ---- sample_data/ -------------------------------------------------------------------------------------------


@functools.cache
def _read_sample(name: str, streams: tuple[str, ...]) -> TokenBatch:
    run = pgdiag.read_run(SAMPLE_DATA / name)
    return read_token_batch(run, streams=list(streams), entropy=[]).batch


def _sample_batch(name: str, settings: MetricSettings) -> tuple[TokenBatch, MetricSettings]:
    settings = resolve_streams(pgdiag.read_run(SAMPLE_DATA / name), settings)
    return _read_sample(name, tuple(metric_streams(settings))), settings


@pytest.mark.parametrize("docs_per_step", [None, 3, 16])
@pytest.mark.parametrize(("style", "flags"), STYLE_FLAGS, ids=[f"{s}-{'-'.join(f)}" for s, f in STYLE_FLAGS])
@pytest.mark.parametrize("run", ["run_a", "synthetic_b"])
def test_sample_runs_pool_to_the_pooled_batch(
    run: str, style: str, flags: dict[str, object], docs_per_step: int | None
) -> None:
    if flags.get("beta"):
        flags = {**flags, "beta": None}  # the sample runs have no reference stream
    settings = MetricSettings.from_options(key_style=style, docs_per_step=docs_per_step, **flags)
    batch, settings = _sample_batch(run, settings)
    assert_pooled_equals_reference(batch, settings)


# ---- synthetic runs: uneven and empty steps, multi-row documents, NaN/inf, straddling groups ---------------


def synthetic_run(*, seed: int, nonfinite: bool = False, group_size: int = 3) -> TokenBatch:
    """Four steps of 5, 3, 2 and 7 rows; step 2's rows have no loss token, some rows elsewhere neither;
    rows 1-2 and 12-13 are one document each (same sample_id); groups of `group_size` consecutive rows."""
    rng = np.random.default_rng(seed)
    steps = [0] * 5 + [1] * 3 + [2] * 2 + [3] * 7
    lengths = [int(x) for x in rng.integers(1, 7, size=len(steps))]
    lengths[3] = lengths[9] = lengths[8] = lengths[15] = 0
    sample_ids = [f"s{i}" for i in range(len(steps))]
    sample_ids[2], sample_ids[13] = sample_ids[1], sample_ids[12]
    groups = [f"g{i // group_size}" for i in range(len(steps))]

    def tokens(scale: float, shift: float) -> list[list[float]]:
        return [list(shift + scale * rng.standard_normal(n)) for n in lengths]

    old = [[-abs(x) for x in row] for row in tokens(1.0, 0.0)]
    new = [
        [o + d for o, d in zip(row, deltas, strict=True)]
        for row, deltas in zip(old, tokens(0.3, 0.0), strict=True)
    ]
    rollout = [
        [o + d for o, d in zip(row, deltas, strict=True)]
        for row, deltas in zip(old, tokens(0.1, 0.0), strict=True)
    ]
    ref = [
        [o + d for o, d in zip(row, deltas, strict=True)]
        for row, deltas in zip(new, tokens(0.2, 0.0), strict=True)
    ]
    advantages = tokens(1.0, 0.1)
    entropy = [[abs(x) for x in row] for row in tokens(1.0, 0.5)]
    reward = [float(x) for x in rng.integers(0, 2, size=len(steps))]
    reward[15] = reward[16] = reward[14]  # a zero-std group at the end
    if nonfinite:
        new[0][0] = math.nan  # step 0: a NaN new log-prob
        rollout[11][0] = -math.inf  # step 3: an infinite rollout log-prob
        advantages[5][0] = math.inf  # step 1: an infinite advantage
    return make_batch(
        new=new,
        old=old,
        rollout=rollout,
        ref=ref,
        advantages=advantages,
        entropy=entropy,
        groups=groups,
        steps=steps,
        sample_ids=sample_ids,
        reward=reward,
        lengths=lengths,
    )


def _synthetic_settings(style: str, flags: dict[str, object], **extra: object) -> MetricSettings:
    base = {
        "new": "new",
        "old": "old",
        "stream_a": "rollout",
        "stream_b": "old",
        "ref": "ref",
        "entropy": "rc",
    }
    return MetricSettings.from_options(key_style=style, **base, **flags, **extra)


@pytest.mark.parametrize(
    ("nonfinite", "docs_per_step", "group_size"),
    [(False, None, 3), (True, None, 3), (False, 2, 3), (False, 3, 3), (True, 3, 2)],
    ids=["clean", "nonfinite", "docs2-straddling", "docs3-aligned", "docs3-nonfinite"],
)
@pytest.mark.parametrize(("style", "flags"), STYLE_FLAGS, ids=[f"{s}-{'-'.join(f)}" for s, f in STYLE_FLAGS])
def test_synthetic_runs_pool_to_the_pooled_batch(
    style: str, flags: dict[str, object], nonfinite: bool, docs_per_step: int | None, group_size: int
) -> None:
    batch = synthetic_run(seed=7, nonfinite=nonfinite, group_size=group_size)
    settings = _synthetic_settings(style, flags, docs_per_step=docs_per_step)
    got = assert_pooled_equals_reference(batch, settings)
    statuses = {v.key: v for v in got.values}
    assert statuses["count/tokens_masked"].value == batch.n_tokens


def test_every_printed_key_has_a_rule() -> None:
    """Every key any style prints on the fully-fed synthetic run is in POOL_RULES (no fallback in use)."""
    batch = synthetic_run(seed=3)
    for style, flags in STYLE_FLAGS:
        settings = _synthetic_settings(style, flags)
        rules = pool_rules(settings)
        for v in compute_step_style(batch, settings, groups_split=0).values:
            assert v.key in rules, (style, v.key)
    assert set(POOL_RULES) == set(STYLE_NAMES)
