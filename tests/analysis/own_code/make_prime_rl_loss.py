"""Writes prime_rl_loss.json: prime-rl's own per-sample losses run on a fixed batch, with their gradients.

Why: the whatif rules `dppo_tv`, `ipo` and `ref_kl` replay prime-rl's `default_loss_fn` (DPPO-Binary TV with the
Kimi-K2.5 KL term, its default loss), `ipo_loss_fn` and `ref_kl_loss_fn` (PrimeIntellect-ai/prime-rl @ 559b447,
`src/prime_rl/trainer/rl/loss.py`). The test beside this script checks pgdiag's per-token gradient coefficient
g_t = ∂ℓ/∂log π_trainer(t) against the gradient autograd takes through prime-rl's loss. How: prime-rl is not on
PyPI; its trainer loss imports on a CPU from a source checkout once its config package and a few light
dependencies are on the path:

    git clone https://github.com/PrimeIntellect-ai/prime-rl && cd prime-rl && git checkout 559b447
    cp -r packages/prime-rl-configs/src/prime_rl/configs src/prime_rl/
    cp packages/prime-rl-configs/src/prime_rl/utils/*.py src/prime_rl/utils/
    pip install --no-deps -t /tmp/primesite beartype jaxtyping prime-pydantic-config pydantic-settings \
        python-dotenv
    PYTHONPATH=src:/tmp/primesite python PGDIAG/tests/analysis/own_code/make_prime_rl_loss.py

The batch is float32, as prime-rl holds log-probs, with advantages of both signs and exactly 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from prime_rl.configs.trainer import DefaultLossConfig, IPOLossConfig
from prime_rl.trainer.rl.loss import LossInputs, default_loss_fn, ipo_loss_fn, ref_kl_loss_fn

# pgdiag rule -> prime-rl loss function and config
CASES = {
    "dppo_tv:0.2,0.2": (default_loss_fn, DefaultLossConfig()),
    "dppo_tv:0.05,0.1,0.01": (
        default_loss_fn,
        DefaultLossConfig(dppo_mask_low=0.05, dppo_mask_high=0.1, kl_tau=0.01),
    ),
    "ipo:0.1": (ipo_loss_fn, IPOLossConfig()),
    "ipo:0.05,0.01": (ipo_loss_fn, IPOLossConfig(ipo_threshold=0.05, kl_tau=0.01)),
    "ref_kl": (ref_kl_loss_fn, None),
}
ADVANTAGES = [1.5, -0.75, 0.0, 0.4, -2.0, 0.0]  # one per sample


def batch() -> list[dict[str, list[float]]]:
    """Samples of float32 inference (μ), trainer (π) and reference log-probs; trainer = μ + noise so that the
    probability differences straddle the trust-region bounds."""
    gen = torch.Generator().manual_seed(559)
    samples = []
    for length in (9, 5, 7, 1, 12, 6):
        inference = torch.log(torch.rand(length, generator=gen) * 0.97 + 0.02)
        trainer = inference + torch.randn(length, generator=gen) * 0.3
        trainer = torch.clamp(trainer, max=-1e-4)
        ref = inference + torch.randn(length, generator=gen) * 0.2
        samples.append(
            {
                "inference": inference.float().tolist(),
                "trainer": trainer.float().tolist(),
                "ref": ref.float().tolist(),
            }
        )
    return samples


def main() -> None:
    samples = batch()
    out: dict = {"prime_rl_commit": "559b447", "samples": samples, "advantages": ADVANTAGES, "grads": {}}
    for rule, (fn, config) in CASES.items():
        grads = []
        for sample, advantage in zip(samples, ADVANTAGES, strict=True):
            trainer = torch.tensor(sample["trainer"], dtype=torch.float32, requires_grad=True)
            n = trainer.shape[0]
            inputs = LossInputs(
                trainer_logprobs=trainer,
                inference_logprobs=torch.tensor(sample["inference"], dtype=torch.float32),
                ref_logprobs=torch.tensor(sample["ref"], dtype=torch.float32),
                advantages=torch.full((n,), advantage, dtype=torch.float32),
                loss_mask=torch.ones(n, dtype=torch.bool),
            )
            outputs = fn(inputs) if config is None else fn(inputs, config)
            outputs.loss.backward()
            grads.append(trainer.grad.tolist())
        out["grads"][rule] = grads
    Path(__file__).with_name("prime_rl_loss.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
