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
