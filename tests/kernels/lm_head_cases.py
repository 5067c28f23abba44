"""Shared inputs and the fp64 ground truth for the LM-head kernel tests (CPU, interpreter, GPU, TP).

`make_case` draws hidden states and a head with a realistic logit spread (std ~3, a few rows scaled up so the
max logit reaches ~20-30), targets that include ignored tokens and the last vocab row. `fp64_reference`
computes logprob and entropy from the full fp64 logits of the same (already rounded) inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass(frozen=True)
class Case:
    hidden: torch.Tensor  # (N, d)
    weight: torch.Tensor  # (V, d)
    targets: torch.Tensor  # (N,) int64, some == IGNORE


def make_case(
    n_tokens: int,
    hidden_size: int,
    vocab: int,
    *,
    seed: int,
    hidden_dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Case:
    """Random inputs with logits of std ~3 and hot rows reaching |z| ~ 25; targets hit the last row."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * (3.0 / hidden_size**0.5)
    hot = torch.randperm(vocab, generator=gen)[: max(1, vocab // 100)]
    weight[hot] *= 2.5  # a few high-variance rows: the max logit is ~20-30, as in real heads
    targets = torch.randint(0, vocab, (n_tokens,), generator=gen)
    targets[n_tokens // 2] = vocab - 1  # last row: the ragged last vocab tile
    if n_tokens > 2:
        targets[1] = IGNORE
        targets[-1] = 0
    return Case(hidden.to(hidden_dtype).to(device), weight.to(weight_dtype).to(device), targets.to(device))


def sample_targets(logits64: torch.Tensor, *, seed: int) -> torch.Tensor:
    """(N,) int64 tokens drawn from softmax(logits64) row by row, as a sampler writes RL rollouts."""
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(torch.softmax(logits64.cpu(), dim=1), 1, generator=gen)[:, 0]


def logits_reference(
    logits64: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (logprobs (N,), entropy (N,)) from fp64 logits (before the temperature)."""
    log_p = torch.log_softmax(logits64 / temperature, dim=1)
    picked = log_p.gather(1, targets.clamp(min=0)[:, None].to(log_p.device))[:, 0]
    logprobs = torch.where(targets.to(log_p.device) == IGNORE, 0.0, picked)
    return logprobs, -(log_p.exp() * log_p).sum(1)


def fp64_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (logprobs (N,), entropy (N,)) from full logits; ignored targets get logprob 0.0."""
    logprobs, entropy = [], []
    weight64 = weight.double()
    for start in range(0, hidden.shape[0], 1024):
        z = (hidden[start : start + 1024].double() @ weight64.T) / temperature  # (C, V) fp64
        log_p = torch.log_softmax(z, dim=1)
        tgt = targets[start : start + 1024]
        picked = log_p.gather(1, tgt.clamp(min=0)[:, None])[:, 0]
        logprobs.append(torch.where(tgt == IGNORE, 0.0, picked))
        entropy.append(-(log_p.exp() * log_p).sum(1))
    return torch.cat(logprobs), torch.cat(entropy)


def worst_mismatch(name: str, got: torch.Tensor, want: torch.Tensor, max_tol: float, mean_tol: float) -> str:
    """'' when |got - want| <= max_tol everywhere and its mean <= mean_tol, else a report of what failed."""
    delta = (got.double() - want.double()).abs()
    nonfinite = int((~torch.isfinite(got)).sum())
    if nonfinite == 0 and float(delta.max()) <= max_tol and float(delta.mean()) <= mean_tol:
        return ""
    worst = torch.topk(delta.nan_to_num(float("inf")).cpu(), k=min(3, delta.numel())).indices.tolist()
    return (
        f"{name}: {nonfinite} non-finite, {int((delta > max_tol).sum())}/{delta.numel()} over {max_tol:g}, "
        f"max {float(delta.max()):.3g}, mean {float(delta.mean()):.3g}; worst "
        + ", ".join(f"[{i}] {float(got[i]):.7g} vs {float(want[i]):.7g}" for i in worst)
    )
