"""GPU accuracy of the kept-set head in bf16 at a real size (d = 4096, V = 151936) against fp64.

K per token: the top-|K| logits with the target forced in, |K| in {1, 64, 2048}. Both impls (torch, triton),
bf16 and fp32 heads. Bounds: renormalised log-prob and entropy max |delta| <= 1e-3 nats (bf16 head; the bf16
rounding of the inputs is in the fp64 truth, so what is left is fp32 summation), kept mass relative 1e-4, and a
one-token set exactly 0.0. The fp32 head: 1e-4 nats. Every test prints its measured errors (pytest -rP).
"""

from __future__ import annotations

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


def test_triton_and_torch_gather_dots_agree() -> None:
    hidden, weight, targets, kept, _ = _case(64)
    a = lm_head_logprobs(hidden, weight, targets, head_dtype="bf16", impl="torch", kept=kept)
    b = lm_head_logprobs(hidden, weight, targets, head_dtype="bf16", impl="triton", kept=kept)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    torch.testing.assert_close(a.kept_mass, b.kept_mass, rtol=1e-4, atol=1e-6)
