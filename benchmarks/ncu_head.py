"""Launch the LM-head partials kernels for `ncu` (bf16 head, fp32 head on fp32 and on bf16 hidden states), each
twice (the first launch compiles): ``ncu --kernel-name regex:_head_partials_kernel python benchmarks/ncu_head.py``."""

from __future__ import annotations

import torch

from pgdiag.kernels.lm_head_logprobs_triton import lm_head_partials


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 16384, 4096, 151936
    hidden = torch.randn(n, d, device="cuda", generator=gen)
    weight = (torch.randn(v, d, device="cuda", generator=gen) * d**-0.5).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen, dtype=torch.int32)
    for h, head in ((hidden.bfloat16(), "bf16"), (hidden, "fp32"), (hidden.bfloat16(), "fp32")):
        for _ in range(2):
            lm_head_partials(h, weight, targets, temperature=1.0, head_dtype=head)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
