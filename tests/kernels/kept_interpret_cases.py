"""Kept-set gather-dot cases under the Triton interpreter (TRITON_INTERPRET=1), fp16 and fp32 on the CPU.

Not collected by the main test run: `test_kept_set.py` runs this file in a child pytest with the interpreter on.
"""

from __future__ import annotations

import pytest
import torch
import triton
from kept_cases import kept_case, kept_reference

from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.kept_set import kept_logits
from pgdiag.kernels.kept_set_triton import kept_logits_triton


def test_interpreter_is_on() -> None:
    assert triton.knobs.runtime.interpret


@pytest.mark.parametrize(
    ("dtype", "head_dtype"),
    [(torch.float16, "bf16"), (torch.float16, "fp32"), (torch.float32, "fp32")],
    ids=["fp16_head16", "fp16_head32", "fp32"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_dot_equals_the_torch_reference(
    dtype: torch.dtype, head_dtype: str, temperature: float
) -> None:
    kc = kept_case(20, 40, 53, seed=9, hidden_dtype=dtype, weight_dtype=dtype)
    tokens = kc.kept.element_token()
    rows = kc.kept.ids.clone()
    rows[::5] = -1  # ids of another shard
    ref = kept_logits(
        kc.case.hidden, kc.case.weight, tokens, rows, temperature=temperature, head_dtype=head_dtype
    )
    got = kept_logits_triton(
        kc.case.hidden, kc.case.weight, tokens, rows, temperature=temperature, head_dtype=head_dtype
    )
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and bool(torch.isinf(got[::5]).all())
    torch.testing.assert_close(got[torch.isfinite(ref)], ref[torch.isfinite(ref)], rtol=1e-6, atol=1e-5)


def test_triton_impl_end_to_end_matches_fp64() -> None:
    kc = kept_case(24, 32, 61, seed=4)
    out = lm_head_logprobs(
        kc.case.hidden, kc.case.weight, kc.case.targets, temperature=0.7, head_dtype="fp32", impl="triton",
        kept=kc.kept,
    )  # fmt: skip
    assert out.impl == "triton"
    ref = kept_reference(kc, 0.7)
    torch.testing.assert_close(out.logprobs.double(), ref["logprobs"], rtol=0, atol=2e-5)
    torch.testing.assert_close(out.kept_mass.double(), ref["kept_mass"], rtol=5e-6, atol=1e-7)


def _ascending_thresholds(z: torch.Tensor, n_levels: int, gen: torch.Generator) -> torch.Tensor:
    """(C, S) ascending thresholds: random values in the rows' range, some equal to logits (ties with z)."""
    low = torch.where(torch.isfinite(z), z, float("inf")).amin(1, keepdim=True)  # thresholds are finite
    high = z.amax(1, keepdim=True)
    t = low + (high - low) * torch.rand(z.shape[0], n_levels, generator=gen)
    t[:, 3] = z[:, 7]  # a threshold equal to a logit: z >= t counts it
    return t.sort(dim=1).values


def test_levels_kernel_equals_the_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from pgdiag.kernels import kept_threshold_triton
    from pgdiag.kernels.kept_threshold import LEVELS, levels_torch

    monkeypatch.setattr(kept_threshold_triton, "SPLIT_COLUMNS", 256)  # three splits, the last one partial
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(12, 700, generator=gen) * 3
    z[:, 50:60] = 1.25  # ties
    z[2, 100:] = float("-inf")  # masked logits carry no count and no mass
    row_max = z.amax(1)
    t = _ascending_thresholds(z, LEVELS, gen)
    counts, masses = kept_threshold_triton.levels_triton(z, row_max, t)
    want_counts, want_masses = levels_torch(z, row_max, t)
    assert torch.equal(counts, want_counts)
    assert int(counts[0, 0]) == int((z[0] >= t[0, 0]).sum())
    torch.testing.assert_close(masses, want_masses, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_reconstruct_with_the_triton_pass_equals_the_sort_reference(
    engine: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pgdiag.kernels import kept_threshold, kept_threshold_triton
    from pgdiag.kernels.kept_reconstruct import keep_mask_sglang, keep_mask_vllm, reconstruct_kept

    monkeypatch.setattr(kept_threshold_triton, "SPLIT_COLUMNS", 256)
    monkeypatch.setattr(kept_threshold, "WINDOW_MAX", 4)  # several bisection passes
    kc = kept_case(16, 32, 600, seed=3, hidden_dtype=dtype, weight_dtype=dtype)
    n = kc.case.targets.shape[0]
    top_k = torch.tensor([0, 30, 5, 200] * (n // 4))
    top_p = torch.tensor([0.9, 0.8, 1.0, 0.95] * (n // 4))
    min_p = torch.tensor([0.02, 0.0, 0.0, 0.0] * (n // 4))
    rebuilt = reconstruct_kept(
        kc.case.hidden, kc.case.weight, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, engine=engine,
        impl="triton",
    )  # fmt: skip
    z = (kc.case.hidden.float() @ kc.case.weight.float().T) / 0.7
    reference = keep_mask_vllm if engine == "vllm" else keep_mask_sglang
    rows, cols = reference(z, top_k, top_p, min_p).nonzero(as_tuple=True)
    assert torch.equal(rebuilt.ids, cols)
    assert torch.equal(rebuilt.sizes(), torch.bincount(rows, minlength=n))
