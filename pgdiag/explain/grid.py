"""The sampling grid of `pgdiag explain`: one forward whose logits give the log-prob of every loss token at every
candidate temperature and truncation (plain torch, the reference beside any future kernel).

What: for each loss token t with logits z (the reference configuration: fp32 body and head, or the bf16-body
fallback when fp32 does not fit), `sampling_grid` returns ``lp[t, i, j] = log π_{T_i, K_j}(y_t)``:

    π_{T,K}(y) = softmax(z / T)[y] / Σ_{v ∈ K} softmax(z / T)[v]    if y ∈ K, else −inf

where K is the full vocabulary (variant ``full``), the top-p set (the smallest prefix of the tokens sorted by
probability whose mass reaches p: a token is kept when the mass *before* it is below p, so the first is always
kept; vLLM's and SGLang's rule) or the top-k set. Temperature is applied before truncation, as the engines do.
This is the kept-set renormalisation of the kept-set issue computed from pgdiag's own logits, because a run
that recorded no kept set can only be explained by trying candidate sets (docs/explain.md says so).
Also per token: the entropy at T = 1 and whether π_1(y) rounds to 1 (for the exact-zero signature).
Why a grid: the temperature and truncation an engine ran at are fitted from the data (a missing temperature is
the most common error), and every candidate costs one logsumexp over a sorted row, not a forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pgdiag.explain.settings import PER_TOKEN

TEMPERATURES = tuple(round(0.3 + 0.05 * i, 2) for i in range(27))  # 0.30 ... 1.60
TOP_PS = (0.98, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)


@dataclass(frozen=True)
class Variant:
    """One truncation candidate: ``full``, ``top_p`` with its p, or ``top_k`` with its k."""

    kind: str  # full | top_p | top_k
    value: float

    @property
    def label(self) -> str:
        return "full" if self.kind == "full" else f"{self.kind}={self.value:g}"


def variants(top_k: int | None = None, extra_top_p: Sequence[float] = ()) -> tuple[Variant, ...]:
    """The truncation candidates: full, the top-p grid (plus recorded values), a recorded top-k."""
    ps = sorted({*TOP_PS, *(float(p) for p in extra_top_p if 0 < p < 1)}, reverse=True)
    found = [Variant("full", 1.0), *(Variant("top_p", p) for p in ps)]
    if top_k is not None and top_k > 0:
        found.append(Variant("top_k", float(top_k)))
    return tuple(found)


def temperatures(extra: Sequence[float] = ()) -> tuple[float, ...]:
    """The temperature grid plus any recorded temperature, ascending."""
    return tuple(sorted({*TEMPERATURES, *(round(float(t), 4) for t in extra if t > 0)}))


@dataclass(frozen=True)
class GridValues:
    """Per loss token: log-probs over (temperature, truncation), entropy at T = 1, and π_1(y) ≈ 1."""

    temperatures: tuple[float, ...]
    variants: tuple[Variant, ...]
    logprobs: np.ndarray  # (M, n_T, n_K) float32, −inf where the token is outside the kept set
    entropy: np.ndarray  # (M,) float32 nats at T = 1, full vocabulary
    certain: np.ndarray  # (M,) bool: log π_1(y) > −1e-6

    def column(self, temperature: float, variant: Variant) -> np.ndarray:
        """(M,) float64 log-probs at one grid point."""
        i = self.temperatures.index(temperature)
        j = self.variants.index(variant)
        return self.logprobs[:, i, j].astype(np.float64)


def grid_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temps: Sequence[float],
    cands: Sequence[Variant],
    token_temps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lp (K, n_T, n_K) fp32, entropy (K,) at T = 1, certain (K,) bool) for logits (K, V) fp32 and targets (K,);
    the `PER_TOKEN` point divides each row by its own temperature, `token_temps` (K,)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (K, V)
    rank = (order == targets[:, None]).to(torch.int64).argmax(dim=-1)  # (K,) rank of each target
    out = torch.empty(logits.shape[0], len(temps), len(cands), dtype=torch.float32, device=logits.device)
    entropy = certain = None
    for i, temperature in enumerate(temps):
        if temperature == PER_TOKEN:
            scaled = sorted_logits / token_temps[:, None]  # (K, V) each token at its recorded temperature
        else:
            scaled = sorted_logits / temperature  # (K, V)
        logp = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)  # (K, V) full-vocabulary log-probs
        lp_full = logp.gather(1, rank[:, None])[:, 0]  # (K,)
        mass = logp.exp()  # (K, V)
        before = torch.cumsum(mass, dim=-1) - mass  # (K, V) mass of the tokens ranked above
        for j, cand in enumerate(cands):
            if cand.kind == "full":
                out[:, i, j] = lp_full
                continue
            if cand.kind == "top_p":
                n_kept = (before < cand.value).sum(dim=-1)  # (K,) >= 1
            else:
                n_kept = torch.full_like(rank, min(int(cand.value), logits.shape[-1]))
            kept_mass = (
                before.gather(1, (n_kept - 1)[:, None])[:, 0] + mass.gather(1, (n_kept - 1)[:, None])[:, 0]
            )
            value = lp_full - torch.log(kept_mass)
            out[:, i, j] = torch.where(rank < n_kept, value, torch.full_like(value, -torch.inf))
        if temperature == 1.0:
            entropy = -(mass * logp).sum(dim=-1)
            certain = lp_full > -1e-6
    if entropy is None:  # 1.0 is always on the grid; kept for a caller's own grid
        logp = torch.log_softmax(sorted_logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        certain = logp.gather(1, rank[:, None])[:, 0] > -1e-6
    return out, entropy, certain


def sampling_grid(
    model: torch.nn.Module,
    input_ids: Sequence[np.ndarray],
    loss_mask: Sequence[np.ndarray],
    temps: Sequence[float],
    cands: Sequence[Variant],
    *,
    batch_tokens: int = 32_768,
    chunk: int = 256,
    token_temperatures: Sequence[np.ndarray] | None = None,
) -> GridValues:
    """`GridValues` of every loss position (t >= 1) of the samples, in sample order then position order.

    `model` is a loaded `pgdiag.model.CausalLM` (one process: its head holds the whole vocabulary);
    `input_ids[i]`, `loss_mask[i]` (T_i,) of sample i. Logits are formed in fp32 `chunk` tokens at a time.
    `token_temperatures[i]` (T_i,): sample i's recorded temperature of each token (the temperature the token at
    that position was sampled at, as the recompute reads it), needed when `temps` holds `PER_TOKEN`.
    """
    from pgdiag.recompute.packing import pack_samples, plan_batches

    device = model.lm_head_weight.device
    head = model.lm_head_weight.float()  # (V, H)
    lengths = np.array([len(ids) for ids in input_ids], dtype=np.int64)
    n_loss = np.array([int(np.asarray(m[1:], dtype=bool).sum()) for m in loss_mask], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(n_loss)])  # (S+1,) first output row of each sample
    total = int(starts[-1])
    lp = np.zeros((total, len(temps), len(cands)), dtype=np.float32)
    entropy = np.zeros(total, dtype=np.float32)
    certain = np.zeros(total, dtype=bool)
    masks = [np.asarray(m, dtype=bool).copy() for m in loss_mask]
    for m in masks:
        if m.shape[0]:
            m[0] = False  # position 0 has no context (validation refused a loss there already)
    active = np.flatnonzero(n_loss > 0)
    with torch.inference_mode():
        for batch in plan_batches(lengths[active], batch_tokens, order="source"):
            rows = active[batch]
            packed = pack_samples(input_ids, masks, rows)
            trunk = model.forward_packed(
                packed.input_ids.to(device), packed.position_ids.to(device), packed.cu_seqlens.to(device)
            )
            hidden = trunk.hidden.index_select(0, packed.hidden_index.to(device)).float()  # (K, H)
            targets = packed.targets.to(device)  # (K,)
            # output row of each target: its sample's first row plus its rank among the sample's targets
            sample_first = starts[packed.target_sample]
            within = np.arange(packed.n_targets) - np.searchsorted(packed.target_sample, packed.target_sample)
            where = sample_first + within  # (K,)
            recorded = None
            if token_temperatures is not None:
                recorded = torch.tensor(
                    [
                        token_temperatures[s][p]
                        for s, p in zip(packed.target_sample, packed.target_pos, strict=True)
                    ],
                    dtype=torch.float32,
                    device=device,
                )  # (K,)
            for lo in range(0, packed.n_targets, chunk):
                hi = min(lo + chunk, packed.n_targets)
                logits = hidden[lo:hi] @ head.T  # (k, V) fp32
                part = None if recorded is None else recorded[lo:hi]
                values, ent, cert = grid_logprobs(logits, targets[lo:hi], temps, cands, part)
                lp[where[lo:hi]] = values.cpu().numpy()
                entropy[where[lo:hi]] = ent.cpu().numpy()
                certain[where[lo:hi]] = cert.cpu().numpy()
    return GridValues(tuple(temps), tuple(cands), lp, entropy, certain)
