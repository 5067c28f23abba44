"""CPU tests of `pgdiag.kernels.lm_head_logprobs` (torch reference) and the partials merge."""

from __future__ import annotations

import math

import pytest
import torch
from lm_head_cases import IGNORE, fp64_reference, make_case, worst_mismatch

from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.kernels import lm_head_logprobs, lm_head_logprobs_ref, resolve_impl
from pgdiag.kernels.lm_head_logprobs_ref import lm_head_partials
from pgdiag.kernels.vocab_parallel import finish_partials, merge_partials, vocab_shard_range


def test_worked_example_three_tokens_vocab() -> None:
    """z = [0, ln 2, ln 5]: p = [1, 2, 5] / 8; logprob(2) = ln(5/8); H = ln8/8 + ln4/4 + 5/8 ln(8/5)."""
    hidden = torch.tensor([[1.0], [1.0]])
    weight = torch.tensor([[0.0], [math.log(2.0)], [math.log(5.0)]])
    out = lm_head_logprobs(hidden, weight, torch.tensor([2, 0]), head_dtype="fp32")
    entropy = math.log(8) / 8 + math.log(4) / 4 + 5 / 8 * math.log(8 / 5)  # 0.900256...
    assert out.logprobs.tolist() == pytest.approx([math.log(5 / 8), math.log(1 / 8)], abs=1e-6)
    assert out.entropy.tolist() == pytest.approx([entropy, entropy], abs=1e-6)
    assert (out.impl, out.head_dtype, out.head_mode) == ("torch", "fp32", "fp32")
    # temperature 0.5 doubles z: p = [1, 4, 25] / 30
    hot = lm_head_logprobs(hidden, weight, torch.tensor([2, 1]), head_dtype="fp32", temperature=0.5)
    assert hot.logprobs.tolist() == pytest.approx([math.log(25 / 30), math.log(4 / 30)], abs=1e-6)
    hot_entropy = -sum(p * math.log(p) for p in (1 / 30, 4 / 30, 25 / 30))
    assert hot.entropy.tolist() == pytest.approx([hot_entropy, hot_entropy], abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau={t}")
@pytest.mark.parametrize(
    ("n_tokens", "hidden_size", "vocab"), [(1, 8, 5), (37, 24, 131), (64, 40, 1000)], ids=str
)
@pytest.mark.parametrize("head_dtype", ["fp32", "bf16"])
def test_torch_reference_matches_fp64(
    head_dtype: str, n_tokens: int, hidden_size: int, vocab: int, temperature: float
) -> None:
    low = torch.float32 if head_dtype == "fp32" else torch.bfloat16
    case = make_case(n_tokens, hidden_size, vocab, seed=n_tokens + vocab, hidden_dtype=low, weight_dtype=low)
    out = lm_head_logprobs(
        case.hidden, case.weight, case.targets, temperature=temperature, head_dtype=head_dtype
    )
    want_logprobs, want_entropy = fp64_reference(case.hidden, case.weight, case.targets, temperature)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    problems = [
        worst_mismatch("logprobs", out.logprobs, want_logprobs, 2e-5, 2e-6),
        worst_mismatch("entropy", out.entropy, want_entropy, 2e-5, 2e-6),
    ]
    assert not any(problems), problems


def test_reference_chunks_agree_with_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(50, 16, 97, seed=3)
    local = torch.where(case.targets == IGNORE, -1, case.targets)
    whole = lm_head_partials(case.hidden, case.weight, local, temperature=0.7, head_dtype="fp32")
    monkeypatch.setattr(lm_head_logprobs_ref, "LOGITS_BUDGET_BYTES", 3 * 4 * 97 * 7)  # 7-token chunks
    chunked = lm_head_partials(case.hidden, case.weight, local, temperature=0.7, head_dtype="fp32")
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)  # BLAS sums rows in other orders


def test_ignored_tokens_get_zero_logprob_and_a_real_entropy() -> None:
    case = make_case(9, 16, 50, seed=5)
    targets = case.targets.clone()
    targets[[0, 4]] = IGNORE
    out = lm_head_logprobs(case.hidden, case.weight, targets, head_dtype="fp32")
    full = lm_head_logprobs(case.hidden, case.weight, case.targets.clamp(min=0), head_dtype="fp32")
    assert out.logprobs[[0, 4]].tolist() == [0.0, 0.0]
    torch.testing.assert_close(out.entropy, full.entropy, rtol=0, atol=0)
    keep = targets != IGNORE
    torch.testing.assert_close(out.logprobs[keep], full.logprobs[keep], rtol=0, atol=0)
    other = lm_head_logprobs(
        case.hidden, case.weight, targets.where(targets != IGNORE, -1), ignore_index=-1, head_dtype="fp32"
    )
    torch.testing.assert_close(other.logprobs, out.logprobs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad_target", [50, 73, -5])
def test_out_of_vocab_target_is_e208(bad_target: int) -> None:
    case = make_case(6, 8, 50, seed=1)
    targets = case.targets.clone()
    targets[3] = bad_target
    with pytest.raises(InvalidInputError) as err:
        lm_head_logprobs(case.hidden, case.weight, targets)
    assert err.value.code == "E208"
    assert f"token id {bad_target}" in err.value.message and "token 3" in err.value.message


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"head_dtype": "fp16"}, "head_dtype"),
        ({"impl": "cuda"}, "impl"),
    ],
)
def test_bad_options_are_usage_errors(kwargs: dict, needle: str) -> None:
    case = make_case(4, 8, 10, seed=2)
    with pytest.raises(UsageError) as err:
        lm_head_logprobs(case.hidden, case.weight, case.targets, **kwargs)
    assert err.value.code == "E503" and needle in err.value.message


def test_shape_mismatch_is_a_usage_error() -> None:
    case = make_case(4, 8, 10, seed=2)
    with pytest.raises(UsageError, match="shapes disagree"):
        lm_head_logprobs(case.hidden[:, :7], case.weight, case.targets)


def test_impl_resolution_and_triton_needs_cuda() -> None:
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_impl("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_impl("torch", torch.device("cuda", 0)) == "torch"


def test_vocab_shard_range_is_an_uneven_partition() -> None:
    assert [vocab_shard_range(37, r, 3) for r in range(3)] == [(0, 13), (13, 25), (25, 37)]
    assert [vocab_shard_range(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]


def test_merging_any_vocab_partition_equals_the_whole() -> None:
    case = make_case(20, 12, 61, seed=9)
    local = torch.where(case.targets == IGNORE, -1, case.targets)
    whole = lm_head_partials(case.hidden, case.weight, local, temperature=0.7, head_dtype="fp32")[0]
    pieces = []
    for start, stop in [(0, 5), (5, 5), (5, 40), (40, 61)]:  # includes an empty piece
        shard_targets = torch.where((local >= start) & (local < stop), local - start, -1)
        pieces.append(
            lm_head_partials(
                case.hidden, case.weight[start:stop], shard_targets, temperature=0.7, head_dtype="fp32"
            )[0]
        )
    merged = merge_partials(torch.stack(pieces))
    want_lp, want_ent, want_found = finish_partials(whole)
    got_lp, got_ent, got_found = finish_partials(merged)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=2e-6)
    assert torch.equal(got_found, want_found) and int((~got_found).sum()) == 1  # the one ignored token
