"""GPU accuracy of the LM-head kernels at real sizes (d = 4096, V = 151936) against fp64 full logits.

Targets (design/performance.md §1): bf16 head max |delta| <= 1e-3 nats and mean <= 1e-5 for logprob and
entropy; fp32 head max <= 1e-5. The fp64 reference uses the same (already rounded) inputs.
"""

from __future__ import annotations

import pytest
import torch
from lm_head_cases import IGNORE, fp64_reference, make_case, worst_mismatch

from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.lm_head_logprobs_triton import TritonTiles, lm_head_partials
from pgdiag.kernels.vocab_parallel import finish_partials, merge_partials

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN, VOCAB, TOKENS = 4096, 151936, 2048


@pytest.fixture(scope="module")
def qwen_sized() -> dict[str, torch.Tensor]:
    case = make_case(TOKENS, HIDDEN, VOCAB, seed=7, device="cuda")
    return {"hidden": case.hidden, "weight": case.weight, "targets": case.targets}


def _check(out_lp: torch.Tensor, out_ent: torch.Tensor, want: tuple, max_tol: float, mean_tol: float) -> list:
    return [
        p
        for p in (
            worst_mismatch("logprobs", out_lp, want[0], max_tol, mean_tol),
            worst_mismatch("entropy", out_ent, want[1], max_tol, mean_tol),
        )
        if p
    ]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau={t}")
def test_bf16_head_vs_fp64(qwen_sized: dict, impl: str, temperature: float) -> None:
    hidden, weight = qwen_sized["hidden"].bfloat16(), qwen_sized["weight"].bfloat16()
    targets = qwen_sized["targets"]
    want = fp64_reference(hidden, weight, targets, temperature)
    out = lm_head_logprobs(hidden, weight, targets, temperature=temperature, impl=impl, head_dtype="bf16")
    assert (out.impl, out.head_mode) == (impl, "bf16")
    problems = _check(out.logprobs, out.entropy, want, 1e-3, 1e-5)
    assert not problems, problems
    assert float(out.logprobs[1]) == 0.0 and targets[1] == IGNORE


@pytest.mark.parametrize(
    ("impl", "weight_dtype", "mode"),
    [
        ("triton", torch.bfloat16, "bf16x3"),
        ("triton", torch.float32, "tf32x3"),
        ("torch", torch.bfloat16, "fp32"),
    ],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau={t}")
def test_fp32_head_vs_fp64(
    qwen_sized: dict, impl: str, weight_dtype: torch.dtype, mode: str, temperature: float
) -> None:
    hidden, weight = qwen_sized["hidden"], qwen_sized["weight"].to(weight_dtype)  # fp32 hidden
    targets = qwen_sized["targets"]
    want = fp64_reference(hidden, weight, targets, temperature)
    out = lm_head_logprobs(hidden, weight, targets, temperature=temperature, impl=impl, head_dtype="fp32")
    assert (out.impl, out.head_mode) == (impl, mode)
    problems = _check(out.logprobs, out.entropy, want, 1e-5, 1e-6)
    assert not problems, problems


@pytest.mark.parametrize("loads", ["pointers", "tma_flat"])
@pytest.mark.parametrize("n_splits", [0, 1, 3, 7])
@pytest.mark.parametrize(("n_tokens", "hidden_size", "vocab"), [(1, 100, 1000), (300, 128, 4099)], ids=str)
def test_odd_shapes_and_splits(
    n_tokens: int, hidden_size: int, vocab: int, n_splits: int, loads: str
) -> None:
    case = make_case(n_tokens, hidden_size, vocab, seed=n_tokens, device="cuda")
    hidden, weight = case.hidden.bfloat16(), case.weight.bfloat16()
    local = torch.where(case.targets == IGNORE, -1, case.targets)
    tiles = TritonTiles(n_splits=n_splits, use_tma=loads == "tma_flat", flatten=loads == "tma_flat")
    for head_dtype, hid, tol in (("bf16", hidden, 1e-3), ("fp32", case.hidden, 1e-5)):
        partials = lm_head_partials(hid, weight, local, temperature=0.7, head_dtype=head_dtype, tiles=tiles)
        logprobs, entropy, _ = finish_partials(merge_partials(partials))
        want = fp64_reference(hid, weight, case.targets, 0.7)
        problems = _check(logprobs, entropy, want, tol, tol)
        assert not problems, (head_dtype, problems)


@pytest.mark.parametrize(
    "tiles",
    [TritonTiles(use_tma=True), TritonTiles(use_tma=True, flatten=True), TritonTiles(flatten=True)],
    ids=["tma", "tma_flat", "flat"],
)
def test_launch_variants_agree_at_full_size(qwen_sized: dict, tiles: TritonTiles) -> None:
    hidden, weight = qwen_sized["hidden"].bfloat16(), qwen_sized["weight"].bfloat16()
    local = torch.where(qwen_sized["targets"] == IGNORE, -1, qwen_sized["targets"])
    base = finish_partials(
        merge_partials(lm_head_partials(hidden, weight, local, temperature=1.0, head_dtype="bf16"))
    )
    other = finish_partials(
        merge_partials(
            lm_head_partials(hidden, weight, local, temperature=1.0, head_dtype="bf16", tiles=tiles)
        )
    )
    assert float((other[0] - base[0]).abs().max()) <= 1e-5 and float((other[1] - base[1]).abs().max()) <= 1e-5
