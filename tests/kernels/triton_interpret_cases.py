"""Triton kernel cases run under the Triton interpreter (TRITON_INTERPRET=1) on the CPU.

Not collected by the main test run: `test_lm_head_triton.py` runs this file in a child pytest with the
interpreter switched on (Triton reads that variable when the kernel is defined, so it needs a fresh process).
fp16 and fp32 only: the interpreter's bf16 dot is not trustworthy.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
from lm_head_cases import IGNORE, fp64_reference, make_case, worst_mismatch

from pgdiag.kernels import fp32_head_triton, lm_head_logprobs
from pgdiag.kernels.lm_head_logprobs_triton import head_mode_for, lm_head_partials
from pgdiag.kernels.triton_shared import TritonTiles
from pgdiag.kernels.vocab_parallel import finish_partials, merge_partials

SMALL_TILES = TritonTiles(block_n=16, block_v=16, block_k=16, num_warps=4, num_stages=1)


def test_interpreter_is_on() -> None:
    assert triton.knobs.runtime.interpret


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau={t}")
@pytest.mark.parametrize(
    ("hidden_dtype", "weight_dtype", "head_dtype", "mode"),
    [
        (torch.float16, torch.float16, "bf16", "bf16"),
        (torch.float32, torch.float16, "fp32", "fp16x3"),
        (torch.float16, torch.float16, "fp32", "fp16x1"),
        (torch.float32, torch.float32, "fp32", "tf32x3"),
    ],
    ids=["fp16_plain", "fp16_split3", "fp16_exact_hidden", "fp32_tf32x3"],
)
@pytest.mark.parametrize(("fresh_steps", "fresh_per_group"), [(1, 1), (1, 2), (2, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize(
    ("n_tokens", "hidden_size", "vocab", "n_splits"),
    [(1, 16, 5, 0), (37, 40, 131, 3), (20, 32, 80, 2)],
    ids=["n1", "odd_k_3splits", "even_2splits"],
)
def test_triton_matches_fp64(
    n_tokens: int,
    hidden_size: int,
    vocab: int,
    n_splits: int,
    fresh_steps: int,
    fresh_per_group: int,
    hidden_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    head_dtype: str,
    mode: str,
    temperature: float,
) -> None:
    case = make_case(
        n_tokens,
        hidden_size,
        vocab,
        seed=vocab + n_tokens,
        hidden_dtype=hidden_dtype,
        weight_dtype=weight_dtype,
    )
    local = torch.where(case.targets == IGNORE, -1, case.targets)
    tiles = replace(SMALL_TILES, n_splits=n_splits, fresh_steps=fresh_steps, fresh_per_group=fresh_per_group)
    partials = lm_head_partials(
        case.hidden, case.weight, local, temperature=temperature, head_dtype=head_dtype, tiles=tiles
    )
    assert partials.shape == (max(n_splits, 1), 4, n_tokens)
    assert head_mode_for(head_dtype, case.weight.dtype, case.hidden.dtype) == mode
    logprobs, entropy, _ = finish_partials(merge_partials(partials))
    want_logprobs, want_entropy = fp64_reference(case.hidden, case.weight, case.targets, temperature)
    problems = [
        worst_mismatch("logprobs", logprobs, want_logprobs, 2e-5, 3e-6),
        worst_mismatch("entropy", entropy, want_entropy, 2e-5, 3e-6),
    ]
    assert not any(problems), problems


def test_fp32_head_in_token_chunks_equals_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pieces budget of one token block per chunk (37 tokens -> 3 launches) gives the same partials."""
    case = make_case(37, 40, 131, seed=11, weight_dtype=torch.float16)
    local = torch.where(case.targets == IGNORE, -1, case.targets)
    tiles = replace(SMALL_TILES, n_splits=2)
    whole = lm_head_partials(case.hidden, case.weight, local, temperature=0.7, head_dtype="fp32", tiles=tiles)
    monkeypatch.setattr(fp32_head_triton, "PIECES_BUDGET_BYTES", 6 * 40 * 16)
    chunked = lm_head_partials(
        case.hidden, case.weight, local, temperature=0.7, head_dtype="fp32", tiles=tiles
    )
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)


@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_split_hidden_parts_sum_to_the_hidden_state(low_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 40, generator=gen) * torch.logspace(-3, 3, 40)  # (37, 40), six decades
    scale = fp32_head_triton.fp16_scale(hidden) if low_dtype == torch.float16 else 1.0
    buffer = torch.full((3 * 37 + 5, 40), float("nan"), dtype=low_dtype)
    parts = fp32_head_triton.split_hidden(hidden, buffer, scale)  # (3 * 37, 40), the buffer's first rows
    assert parts.dtype == low_dtype and parts.shape == (3 * 37, 40) and parts.data_ptr() == buffer.data_ptr()
    hi, mid, lo = parts.double().split(37)
    error = ((hi + mid + lo) / scale - hidden.double()).abs()
    if low_dtype == torch.bfloat16:  # 3 x 8 bits hold the 24 bits of an fp32 number exactly
        assert float(error.max()) == 0.0
    else:  # scaled to max |h| ~ 2^14: absolute error at most 2^-38 max |h|
        assert float(error.max()) <= 2.0**-38 * float(hidden.abs().max())
        assert 2.0**13 <= float(hidden.abs().max()) * scale < 2.0**14
    assert bool((mid.abs() <= hi.abs() * 2.0**-7).all()) and bool((lo.abs() <= mid.abs() * 2.0**-7).all())


def test_public_api_runs_the_kernel_and_reports_it() -> None:
    case = make_case(12, 32, 300, seed=4, weight_dtype=torch.float16)
    out = lm_head_logprobs(case.hidden, case.weight, case.targets, impl="triton", head_dtype="fp32")
    ref = lm_head_logprobs(case.hidden, case.weight, case.targets, impl="torch", head_dtype="fp32")
    assert (out.impl, out.head_dtype, out.head_mode) == ("triton", "fp32", "fp16x3")
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.entropy, ref.entropy, rtol=0, atol=2e-5)
    assert out.logprobs[1] == 0.0  # ignored
    exact = lm_head_logprobs(case.hidden.half(), case.weight, case.targets, impl="triton", head_dtype="fp32")
    exact_ref = lm_head_logprobs(
        case.hidden.half(), case.weight, case.targets, impl="torch", head_dtype="fp32"
    )
    assert exact.head_mode == "fp16x1"
    torch.testing.assert_close(exact.logprobs, exact_ref.logprobs, rtol=0, atol=2e-5)
    torch.testing.assert_close(exact.entropy, exact_ref.entropy, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("n_tokens", "k", "hidden"), [(1, 1, 5), (9, 8, 1030), (13, 3, 64)], ids=str)
def test_moe_combine_kernel_equals_the_ordered_sum(
    dtype: torch.dtype, n_tokens: int, k: int, hidden: int
) -> None:
    """The Triton combine (tokens and columns not multiples of the blocks) rounds each weighted row to the rows'
    dtype and sums the k in fp32 in order: bit for bit that sum written in torch, and within one rounding of
    `combine_rows` (the reference, whose fp32 sum torch may order differently)."""
    from pgdiag.model.moe import combine_rows
    from pgdiag.model.moe_combine_triton import combine_rows_triton

    gen = torch.Generator().manual_seed(n_tokens * 31 + k)
    rows = (torch.randn(n_tokens * k + 2, hidden, generator=gen) * 3).to(dtype)  # (M, H)
    row_of = torch.randint(0, rows.shape[0], (n_tokens, k), generator=gen)
    weights = torch.rand(n_tokens, k, generator=gen)
    weights[0, 0] = 0.0  # an assignment another rank owns
    got = combine_rows_triton(rows, row_of, weights)
    assert got.dtype == dtype and got.shape == (n_tokens, hidden)
    products = (rows[row_of].float() * weights[..., None]).to(dtype)  # (N, k, H) each rounded
    ordered = products[:, 0].float()
    for j in range(1, k):
        ordered = ordered + products[:, j].float()
    assert torch.equal(got, ordered.to(dtype))
    reference = combine_rows(rows, row_of, weights)
    torch.testing.assert_close(
        got.double(), reference.double(), rtol=2**-10 if dtype == torch.float16 else 1e-6, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 5), (3, 1000), (5, 2048)], ids=str)
def test_residual_add_kernel_equals_the_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """The TP = 2 residual add x + (p + q) (element counts below, at and across the kernel's block): bit for bit
    the plain-torch reference (two eager adds, each rounded), also written into a row range of a larger tensor."""
    from pgdiag.model.residual_add_triton import residual_add_triton
    from pgdiag.model.tp_sums import residual_add_reference

    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    x, p, q = ((torch.randn(*shape, generator=gen) * 100).to(dtype) for _ in range(3))
    want = residual_add_reference(x, p, q)
    assert torch.equal(want, x + (p + q))
    assert torch.equal(residual_add_triton(x, p, q), want)
    big = torch.zeros(shape[0] + 2, shape[1], dtype=dtype)
    residual_add_triton(x, p, q, out=big[1 : 1 + shape[0]])
    assert torch.equal(big[1 : 1 + shape[0]], want)
    assert not big[0].any() and not big[-1].any()
