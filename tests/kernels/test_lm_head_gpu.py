"""GPU accuracy of the LM-head kernels at real sizes (d = 4096, V = 151936) against fp64 full logits.

Targets: bf16 head max |delta| <= 1e-3 nats and mean <= 1e-5 for logprob and
entropy; fp32 head max <= 1e-5. The fp64 logits are computed on the CPU from the same (already rounded)
inputs. Accuracy is judged on targets sampled from the model's own distribution at the temperature under
test, as in RL rollouts; targets drawn uniformly from the vocabulary (|logprob| ~ 30-50) get the max bound
only, because the tensor cores' truncating accumulation biases logits by ~5e-6 relative (cuBLAS included),
~2e-4 nats at logprob -45 (measured: mean 1.0e-4 to 1.4e-4 for cuBLAS and the kernel alike).

fp32 head (bf16x3, bf16x1, tf32x3): max <= 1e-5 and mean <= 1e-6 on sampled targets; on uniform targets the
short tensor-core chains leave a small truncation bias, so max <= 1.5e-5 and mean <= 4e-6 (measured on an H100,
2026-11-21: sampled max 2.9e-6 to 8.4e-6; uniform max 7.9e-6 to 1.35e-5, mean 2.4e-6 to 3.3e-6; torch's own fp32
matmul on the same inputs: 4e-5 to 1.2e-4). Every test prints its measured errors (pytest -rP).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lm_head_cases import IGNORE, fp64_reference, logits_reference, make_case, sample_targets, worst_mismatch

from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.lm_head_logprobs_triton import default_tiles, head_mode_for, lm_head_partials
from pgdiag.kernels.triton_shared import TritonTiles
from pgdiag.kernels.vocab_parallel import finish_partials, merge_partials

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN, VOCAB, TOKENS = 4096, 151936, 256


@pytest.fixture(scope="module")
def qwen_sized() -> dict[str, torch.Tensor]:
    """Inputs on the GPU, fp64 logits (CPU) for each operand precision, and sampled targets."""
    case = make_case(TOKENS, HIDDEN, VOCAB, seed=7)
    hidden_bf16, weight_bf16 = case.hidden.bfloat16(), case.weight.bfloat16()
    logits = {
        "bf16": hidden_bf16.double() @ weight_bf16.double().T,  # (N, V) fp64
        "fp32_bf16w": case.hidden.double() @ weight_bf16.double().T,
        "fp32_fp32w": case.hidden.double() @ case.weight.double().T,
    }
    sampled = {}
    for temperature in (1.0, 0.7):
        sampled[temperature] = sample_targets(logits["bf16"] / temperature, seed=1)
        sampled[temperature][1] = IGNORE
    return {
        "hidden_bf16": hidden_bf16.cuda(),
        "hidden": case.hidden.cuda(),
        "weight_bf16": weight_bf16.cuda(),
        "weight": case.weight.cuda(),
        "uniform": case.targets,
        "sampled": sampled,
        **{f"logits_{k}": v for k, v in logits.items()},
    }


def _problems(out, want: tuple, max_tol: float, mean_tol: float, label: str) -> list[str]:
    for name, got, ref in (("logprobs", out.logprobs, want[0]), ("entropy", out.entropy, want[1])):
        delta = (got.cpu().double() - ref).abs()
        print(f"{label} {name}: max {float(delta.max()):.3g} mean {float(delta.mean()):.3g}")
    found = (
        worst_mismatch("logprobs", out.logprobs.cpu(), want[0], max_tol, mean_tol),
        worst_mismatch("entropy", out.entropy.cpu(), want[1], max_tol, mean_tol),
    )
    return [p for p in found if p]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau={t}")
def test_bf16_head_vs_fp64(qwen_sized: dict, impl: str, temperature: float) -> None:
    hidden, weight = qwen_sized["hidden_bf16"], qwen_sized["weight_bf16"]
    for kind, mean_tol in (("sampled", 1e-5), ("uniform", 1e-3)):
        targets = qwen_sized["sampled"][temperature] if kind == "sampled" else qwen_sized["uniform"]
        want = logits_reference(qwen_sized["logits_bf16"], targets, temperature)
        out = lm_head_logprobs(hidden, weight, targets.cuda(), temperature=temperature, impl=impl)
        assert (out.impl, out.head_mode) == (impl, "bf16")
        problems = _problems(out, want, 1e-3, mean_tol, f"bf16 {impl} tau={temperature} {kind}")
        assert not problems, problems
        assert float(out.logprobs[1]) == 0.0 and targets[1] == IGNORE


@pytest.mark.parametrize(
    ("hidden_key", "weights", "logits_key", "mode"),
    [
        ("hidden", "bf16w", "fp32_bf16w", "bf16x3"),
        ("hidden", "fp32w", "fp32_fp32w", "tf32x3"),
        ("hidden_bf16", "bf16w", "bf16", "bf16x1"),
    ],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau={t}")
def test_fp32_head_vs_fp64(
    qwen_sized: dict, hidden_key: str, weights: str, logits_key: str, mode: str, temperature: float
) -> None:
    weight = qwen_sized["weight_bf16"] if weights == "bf16w" else qwen_sized["weight"]
    hidden = qwen_sized[hidden_key]
    kwargs = {"temperature": temperature, "head_dtype": "fp32"}
    for kind in ("sampled", "uniform"):
        targets = qwen_sized["sampled"][temperature] if kind == "sampled" else qwen_sized["uniform"]
        want = logits_reference(qwen_sized[f"logits_{logits_key}"], targets, temperature)
        out = lm_head_logprobs(hidden, weight, targets.cuda(), impl="triton", **kwargs)
        assert (out.impl, out.head_mode) == ("triton", mode)
        torch_fp32 = lm_head_logprobs(hidden, weight, targets.cuda(), impl="torch", **kwargs)
        torch_errors = [
            float((got.cpu().double() - ref).abs().max())
            for got, ref in ((torch_fp32.logprobs, want[0]), (torch_fp32.entropy, want[1]))
        ]
        print(
            f"torch fp32 matmul tau={temperature} {kind}: max logprobs {torch_errors[0]:.3g} "
            f"entropy {torch_errors[1]:.3g}"
        )
        # sampled: the target (max 1e-5); uniform targets (logprob ~ -45) also see the truncation bias of the
        # short tensor-core chains, measured max 0.8e-5 to 1.35e-5 (tf32x3), mean 2.4e-6 to 3.3e-6
        max_tol, mean_tol = (1e-5, 1e-6) if kind == "sampled" else (1.5e-5, 4e-6)
        problems = _problems(out, want, max_tol, mean_tol, f"fp32 head {mode} tau={temperature} {kind}")
        assert not problems, problems


@pytest.mark.parametrize(
    ("hidden_key", "logits_key", "mode"),
    [("hidden", "fp32_bf16w", "bf16x3"), ("hidden_bf16", "bf16", "bf16x1")],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau={t}")
def test_fp32_head_triton_kernel_vs_fp64(
    qwen_sized: dict, hidden_key: str, logits_key: str, mode: str, temperature: float
) -> None:
    """On sm_90 the 16-bit fp32-head modes run the Gluon kernel (`fp32_head_gluon`, checked by the test above);
    the Triton kernel (the one the CPU interpreter checks, and the one every other GPU runs) keeps the same
    bounds at full size."""
    hidden, weight = qwen_sized[hidden_key], qwen_sized["weight_bf16"]
    tiles = replace(default_tiles(mode, HIDDEN), gluon=False)
    for kind in ("sampled", "uniform"):
        targets = qwen_sized["sampled"][temperature] if kind == "sampled" else qwen_sized["uniform"]
        kept = targets != IGNORE
        want = logits_reference(qwen_sized[f"logits_{logits_key}"], targets, temperature)
        local = torch.where(kept, targets, -1).cuda()
        partials = lm_head_partials(
            hidden, weight, local, temperature=temperature, head_dtype="fp32", tiles=tiles
        )
        logprobs, entropy, _ = finish_partials(merge_partials(partials))
        max_tol, mean_tol = (1e-5, 1e-6) if kind == "sampled" else (1.5e-5, 4e-6)
        problems = [
            p
            for p in (
                worst_mismatch("logprobs", logprobs.cpu()[kept], want[0][kept], max_tol, mean_tol),
                worst_mismatch("entropy", entropy.cpu(), want[1], max_tol, mean_tol),
            )
            if p
        ]
        delta = (logprobs.cpu().double()[kept] - want[0][kept]).abs()
        print(
            f"Triton kernel {mode} tau={temperature} {kind}: max {float(delta.max()):.3g} mean {float(delta.mean()):.3g}"
        )
        assert not problems, problems


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("n_splits", [0, 1, 3, 7])
@pytest.mark.parametrize(("n_tokens", "hidden_size", "vocab"), [(1, 100, 1000), (300, 128, 4099)], ids=str)
def test_odd_shapes_and_splits(
    n_tokens: int, hidden_size: int, vocab: int, n_splits: int, use_tma: bool
) -> None:
    case = make_case(n_tokens, hidden_size, vocab, seed=n_tokens, device="cuda")
    weight = case.weight.bfloat16()
    local = torch.where(case.targets == IGNORE, -1, case.targets)
    for head_dtype, hid, tol in (("bf16", case.hidden.bfloat16(), 1e-3), ("fp32", case.hidden, 5e-5)):
        tiles = replace(
            default_tiles(head_mode_for(head_dtype, weight.dtype, hid.dtype), hidden_size),
            n_splits=n_splits,
            use_tma=use_tma,
        )
        partials = lm_head_partials(hid, weight, local, temperature=0.7, head_dtype=head_dtype, tiles=tiles)
        logprobs, entropy, _ = finish_partials(merge_partials(partials))
        want = fp64_reference(hid.cpu(), weight.cpu(), case.targets.cpu(), 0.7)
        problems = [
            p
            for p in (
                worst_mismatch("logprobs", logprobs.cpu(), want[0], tol, tol),
                worst_mismatch("entropy", entropy.cpu(), want[1], tol, tol),
            )
            if p
        ]
        assert not problems, (head_dtype, problems)


def test_tma_and_pointer_loads_agree_at_full_size(qwen_sized: dict) -> None:
    hidden, weight = qwen_sized["hidden_bf16"], qwen_sized["weight_bf16"]
    targets = qwen_sized["uniform"].cuda()
    local = torch.where(targets == IGNORE, -1, targets)
    outs = [
        finish_partials(
            merge_partials(
                lm_head_partials(
                    hidden, weight, local, temperature=1.0, head_dtype="bf16", tiles=TritonTiles(use_tma=tma)
                )
            )
        )
        for tma in (True, False)
    ]
    assert float((outs[0][0] - outs[1][0]).abs().max()) <= 1e-5
    assert float((outs[0][1] - outs[1][1]).abs().max()) <= 1e-5


@pytest.mark.parametrize("hidden_size", [1024, 4608], ids=lambda d: f"d={d}")
def test_l2_aligned_plan_vs_fp64(hidden_size: int) -> None:
    """Many token blocks (the L2-aligned split plan, a ragged last group) with both default tile shapes:
    256 x 128 in groups of 6 at d <= 4096, 128 x 256 in groups of 12 above."""
    from pgdiag.kernels.triton_shared import plan_splits

    # 118 token blocks at d = 1024, 235 at d = 4608: aligned plans of 21 / 11 splits (one wave a group)
    n_tokens, vocab = 30000, 40000
    case = make_case(n_tokens, hidden_size, vocab, seed=3, device="cuda")
    hidden, weight = case.hidden.bfloat16(), case.weight.bfloat16()
    tiles = default_tiles("bf16", hidden_size)
    plan = plan_splits(n_tokens, vocab, tiles, hidden.device)
    if (
        torch.cuda.get_device_properties(0).multi_processor_count == 132
    ):  # H100 SXM / H200: aligned plan taken
        assert plan.group_blocks == tiles.aligned_group_blocks, plan
    local = torch.where(case.targets == IGNORE, -1, case.targets)
    partials = lm_head_partials(hidden, weight, local, temperature=0.7, head_dtype="bf16")
    assert partials.shape[0] == plan.n_splits
    logprobs, entropy, _ = finish_partials(merge_partials(partials))
    want_logprobs, want_entropy = (
        torch.empty(n_tokens, dtype=torch.float64, device="cuda"),
        torch.empty_like(logprobs, dtype=torch.float64),
    )
    for start in range(0, n_tokens, 4096):  # fp64 logits on the GPU, 4096 tokens at a time
        rows = slice(start, start + 4096)
        log_p = torch.log_softmax((hidden[rows].double() @ weight.double().T) / 0.7, dim=1)  # (n, V) fp64
        picked = log_p.gather(1, case.targets[rows].clamp(min=0)[:, None])[:, 0]
        want_logprobs[rows] = torch.where(case.targets[rows] == IGNORE, 0.0, picked)
        want_entropy[rows] = -(log_p.exp() * log_p).sum(1)
    for name, got, want in (("logprobs", logprobs, want_logprobs), ("entropy", entropy, want_entropy)):
        delta = (got.double() - want).abs()
        print(
            f"d={hidden_size} {name}: max {float(delta.max()):.3g} mean {float(delta.mean()):.3g} plan {plan}"
        )
        assert float(delta.max()) <= 1e-3, name
