"""GPU accuracy of the kept-set head in bf16 at a real size (d = 4096, V = 151936) against fp64.

K per token: the top-|K| logits with the target forced in, |K| in {1, 64, 2048}, scored inside the head (ids,
and packed bitmasks), and the engine-log-prob KL over K. Both impls (torch, triton),
bf16 and fp32 heads. Bounds: renormalised log-prob and entropy max |delta| <= 1e-3 nats (bf16 head; the bf16
rounding of the inputs is in the fp64 truth, so what is left is fp32 summation), kept mass relative 1e-4, and a
one-token set exactly 0.0. The fp32 head: 1e-4 nats. Every test prints its measured errors (pytest -rP).
"""

from __future__ import annotations

import math

import pytest
import torch

from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels.kept_set import KeptSet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN, VOCAB, TOKENS = 4096, 151936, 96


def _case(size: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KeptSet, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (3.0 / HIDDEN**0.5)).bfloat16()
    logits64 = hidden.double() @ weight.double().T  # (N, V) fp64 of the rounded inputs
    targets = torch.multinomial(torch.softmax(logits64, dim=1).float(), 1, generator=gen)[:, 0]
    top = torch.topk(logits64, size, dim=1).indices  # (N, size)
    ids = []
    for n in range(TOKENS):
        row = top[n].tolist()
        target = int(targets[n])
        m = 1 if n == 0 else size
        ids.append(torch.tensor([target, *[t for t in row if t != target][: m - 1]], device="cuda"))
    sizes = torch.tensor([len(x) for x in ids], device="cuda")
    offsets = torch.zeros(TOKENS + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.cumsum(sizes, 0)
    return hidden, weight, targets, KeptSet(torch.cat(ids).long(), offsets), logits64


def _truth(logits64: torch.Tensor, targets: torch.Tensor, kept: KeptSet, temperature: float) -> dict:
    z = logits64 / temperature
    log_p = torch.log_softmax(z, dim=1)
    out = {"logprobs": [], "entropy": [], "kept_mass": []}
    for n in range(z.shape[0]):
        lo, hi = int(kept.offsets[n]), int(kept.offsets[n + 1])
        zk = z[n, kept.ids[lo:hi]]
        out["logprobs"].append(float(z[n, targets[n]] - torch.logsumexp(zk, 0)))
        out["entropy"].append(float(-(torch.softmax(zk, 0) * torch.log_softmax(zk, 0)).sum()))
        out["kept_mass"].append(float(log_p[n, kept.ids[lo:hi]].exp().sum()))
    return {k: torch.tensor(v, dtype=torch.float64, device="cuda") for k, v in out.items()}


@pytest.mark.parametrize("size", [1, 64, 2048])
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(("head_dtype", "bound"), [("bf16", 1e-3), ("fp32", 1e-4)])
def test_kept_head_bf16_inputs_against_fp64(size: int, impl: str, head_dtype: str, bound: float) -> None:
    hidden, weight, targets, kept, logits64 = _case(size)
    temperature = 0.7
    out = lm_head_logprobs(
        hidden, weight, targets, temperature=temperature, head_dtype=head_dtype, impl=impl, kept=kept
    )
    truth = _truth(logits64, targets, kept, temperature)
    err_lp = (out.logprobs.double() - truth["logprobs"]).abs().max().item()
    err_h = (out.entropy.double() - truth["entropy"]).abs().max().item()
    err_mass = ((out.kept_mass.double() - truth["kept_mass"]).abs() / truth["kept_mass"]).max().item()
    print(f"|K|={size} {impl} {head_dtype}: logprob {err_lp:.2e} entropy {err_h:.2e} mass rel {err_mass:.2e}")
    assert out.logprobs[0].item() == 0.0
    assert err_lp <= bound and err_h <= bound and err_mass <= 1e-4 * (10 if head_dtype == "bf16" else 1)


def test_triton_and_torch_kept_heads_agree() -> None:
    hidden, weight, targets, kept, _ = _case(64)
    a = lm_head_logprobs(hidden, weight, targets, head_dtype="bf16", impl="torch", kept=kept)
    b = lm_head_logprobs(hidden, weight, targets, head_dtype="bf16", impl="triton", kept=kept)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    torch.testing.assert_close(a.kept_mass, b.kept_mass, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("head_dtype", ["bf16", "fp32"])
def test_bitmask_sets_score_as_their_ids_on_the_gpu(head_dtype: str) -> None:
    """|K| = 2048 sets given as packed bitmasks (a third of the tokens) and as ids: the Triton head reads the
    same bits, so the numbers are the same; the words of both forms are equal."""
    from kept_cases import with_bitmask_rows

    from pgdiag.kernels.kept_set import kept_words

    hidden, weight, targets, kept, _ = _case(2048)
    packed = with_bitmask_rows(kept, list(range(0, TOKENS, 3)), VOCAB)
    for start, local in ((0, VOCAB), (75_000, VOCAB - 75_000)):  # the whole head, and a shard from mid-word
        assert torch.equal(
            kept_words(packed, 0, TOKENS, vocab_start=start, vocab_local=local, impl="triton"),
            kept_words(kept, 0, TOKENS, vocab_start=start, vocab_local=local, impl="torch"),
        )
    a = lm_head_logprobs(
        hidden, weight, targets, temperature=0.7, head_dtype=head_dtype, impl="triton", kept=kept
    )
    b = lm_head_logprobs(
        hidden, weight, targets, temperature=0.7, head_dtype=head_dtype, impl="triton", kept=packed
    )
    for name in ("logprobs", "entropy", "kept_mass", "logprobs_full"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_kept_kl_on_the_gpu_against_fp64() -> None:
    """The engine's kept log-probs (the model's own, perturbed): KL over K within 1e-4 of fp64 (bf16 head), 0 for
    the one-token set."""
    hidden, weight, targets, kept, logits64 = _case(64)
    z = logits64 / 0.7
    token = kept.element_token()
    gen = torch.Generator(device="cuda").manual_seed(2)
    noisy = z[token, kept.ids] + 0.05 * torch.randn(
        token.shape[0], device="cuda", generator=gen, dtype=z.dtype
    )
    with_lp = KeptSet(kept.ids, kept.offsets, noisy.float())
    out = lm_head_logprobs(
        hidden, weight, targets, temperature=0.7, head_dtype="bf16", impl="triton", kept=with_lp
    )
    assert out.kept_kl is not None and out.kept_kl[0].item() == 0.0
    worst = 0.0
    for n in range(1, TOKENS):
        lo, hi = int(kept.offsets[n]), int(kept.offsets[n + 1])
        engine = torch.log_softmax(with_lp.logprobs[lo:hi].double(), 0)
        model = torch.log_softmax(z[n, kept.ids[lo:hi]], 0)
        worst = max(worst, abs(float(out.kept_kl[n]) - float((engine.exp() * (engine - model)).sum())))
    print(f"kept_kl max |delta| {worst:.2e}")
    assert worst <= 1e-4


def _logits(seed: int = 5, tokens: int = 64) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (3.0 / HIDDEN**0.5)).bfloat16()
    return torch.mm(hidden, weight.T, out_dtype=torch.float32)  # (N, V) fp32, as reconstruct computes them


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(("k", "p", "m"), [(50, 0.9, 0.0), (0, 0.95, 0.0), (0, 0.9, 0.05), (2000, 0.99, 0.0)])
def test_threshold_bisection_on_the_gpu_equals_the_sort_reference(
    engine: str, k: int, p: float, m: float
) -> None:
    """The Triton counting pass at V = 151936 against the literal sort (CUDA's stable radix sort): the same
    sets, but for tokens within fp32 rounding of the top-p line (the reference sums fp32 probabilities over
    thousands of tokens, the bisection fp64 masses): their fp64 mass above is within 2e-5 of p."""
    from pgdiag.kernels.kept_reconstruct import keep_mask_sglang, keep_mask_vllm
    from pgdiag.kernels.kept_threshold import keep_mask_threshold, levels_torch
    from pgdiag.kernels.kept_threshold_triton import levels_triton

    z = _logits() / 0.7
    n = z.shape[0]
    args = (
        torch.full((n,), k, device="cuda"),
        torch.full((n,), p, device="cuda"),
        torch.full((n,), m, device="cuda"),
    )
    reference = keep_mask_vllm if engine == "vllm" else keep_mask_sglang
    want = reference(z, *args)
    got = keep_mask_threshold(z, *args, engine=engine, levels=levels_triton)
    differ = (got != want).any(dim=1)
    print(f"{engine} k={k} p={p} m={m}: rows differing {int(differ.sum())} of {n}, kept {int(want.sum())}")
    assert float(differ.float().mean()) <= 0.1
    _assert_boundary_only(z, got, want, k, p, m, engine)
    # the torch counting pass: the same sets but where fp32 exp / summation order moves a boundary token
    _assert_boundary_only(
        z, got, keep_mask_threshold(z, *args, engine=engine, levels=levels_torch), k, p, m, engine
    )


def _assert_boundary_only(z, got, want, k: int, p: float, m: float, engine: str) -> None:
    """Every token where two kept masks differ has fp64 mass above it within 2e-5 of p (renormalised over
    what vLLM's min-p and top-k leave, ties at the k-th logit kept; SGLang: the full distribution)."""
    for row in (got != want).any(dim=1).nonzero()[:, 0].tolist():
        zr = z[row].double()
        keep = torch.ones_like(zr, dtype=torch.bool)
        if engine == "vllm":
            if m > 0:
                keep &= zr >= zr.max() + math.log(m)
            if k > 0:
                keep &= zr >= torch.where(keep, zr, float("-inf")).topk(k).values[-1]
        probs = torch.softmax(torch.where(keep, zr, float("-inf")), 0)
        for token in (got[row] != want[row]).nonzero()[:, 0].tolist():
            above = float(probs[zr > zr[token]].sum())
            assert abs(above - p) <= 2e-5, (row, token, above)


def test_levels_kernel_equals_torch_on_the_gpu() -> None:
    from pgdiag.kernels.kept_threshold import levels_torch
    from pgdiag.kernels.kept_threshold_triton import levels_triton

    z = _logits(tokens=32)
    row_max = z.amax(1)
    frac = torch.linspace(0, 1, 16, device="cuda")
    t = row_max[:, None] - 12.0 * (1 - frac)[None, :]
    counts, masses = levels_triton(z, row_max, t)
    want_counts, want_masses = levels_torch(z, row_max, t)
    assert torch.equal(counts, want_counts)
    torch.testing.assert_close(masses, want_masses, rtol=1e-5, atol=1e-9)


def test_fp32_head_split_logits_are_exact_products() -> None:
    """reconstruct's fp32-hidden logits on CUDA (three bf16 pieces through cuBLAS) against fp64: within the
    tensor cores' fp32 accumulation (relative 1e-5 of the row's scale)."""
    from pgdiag.kernels.kept_reconstruct import reconstruct_logits

    gen = torch.Generator(device="cuda").manual_seed(8)
    hidden = torch.randn(64, HIDDEN, device="cuda", generator=gen)
    weight = (torch.randn(8192, HIDDEN, device="cuda", generator=gen) * (3.0 / HIDDEN**0.5)).bfloat16()
    got = reconstruct_logits(hidden, weight)
    truth = hidden.double() @ weight.double().T
    err = ((got.double() - truth).abs() / truth.abs().amax(1, keepdim=True)).max().item()
    print(f"split fp32 logits: max error relative to the row's largest |z| {err:.2e}")
    assert err <= 1e-5
