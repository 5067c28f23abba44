"""Inputs and the fp64 truth for the kept-set head tests (CPU, interpreter, GPU, TP).

`kept_case` draws a head case (`lm_head_cases.make_case`) and a kept set per token: the top-m logits for a
random m in [1, 12] with the target forced in (as an engine's K always holds the sampled token), a one-token
set, an empty set ("not recorded") and a set on an ignored token left empty. `edge_kept_case` adds a set of the
whole vocabulary (an all-ones bitmask row) and a set of two tied logits. `with_bitmask_rows` moves some sets to
the packed bitmask form. `kept_reference` computes the renormalised log-prob, its entropy, the kept mass and
the full log-prob from fp64 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from lm_head_cases import IGNORE, Case, make_case

from pgdiag.data.kept import pack_bitmask
from pgdiag.kernels.kept_set import KeptSet


@dataclass(frozen=True)
class KeptCase:
    case: Case
    kept: KeptSet


def kept_case(
    n_tokens: int,
    hidden_size: int,
    vocab: int,
    *,
    seed: int,
    max_set: int = 12,
    hidden_dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> KeptCase:
    case = make_case(
        n_tokens, hidden_size, vocab, seed=seed, hidden_dtype=hidden_dtype, weight_dtype=weight_dtype
    )
    logits = case.hidden.double() @ case.weight.double().T  # (N, V)
    gen = torch.Generator().manual_seed(seed + 1)
    ids, sizes = [], []
    for n in range(n_tokens):
        target = int(case.targets[n])
        if target == IGNORE or n == 3:  # ignored, or not recorded
            sizes.append(0)
            continue
        m = 1 if n == 0 else int(torch.randint(1, max_set + 1, (1,), generator=gen))
        top = torch.topk(logits[n], m).indices.tolist()
        chosen = [target, *[t for t in top if t != target][: m - 1]]
        ids += chosen
        sizes.append(len(chosen))
    offsets = torch.zeros(n_tokens + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(sizes), 0)
    moved = Case(case.hidden.to(device), case.weight.to(device), case.targets.to(device))
    return KeptCase(moved, KeptSet(torch.tensor(ids, dtype=torch.int64, device=device), offsets.to(device)))


def edge_kept_case(
    n_tokens: int, hidden_size: int, vocab: int, *, seed: int, dtype: torch.dtype = torch.float32
) -> KeptCase:
    """`kept_case` with token 2's set the whole vocabulary and token 4's two ids with tied logits: its target and
    another head row made equal to the target's row (tokens 0, 1, 3: one-token set, ignored, not recorded)."""
    kc = kept_case(n_tokens, hidden_size, vocab, seed=seed, hidden_dtype=dtype, weight_dtype=dtype)
    weight = kc.case.weight.clone()
    target = int(kc.case.targets[4])
    twin = (target + 7) % vocab
    weight[twin] = weight[target]  # tied logits at every token
    sets = [kc.kept.ids[kc.kept.offsets[n] : kc.kept.offsets[n + 1]].tolist() for n in range(n_tokens)]
    sets[2] = list(range(vocab)) if int(kc.case.targets[2]) != IGNORE else []
    sets[4] = [target, twin]
    ids = torch.tensor([i for one in sets for i in one], dtype=torch.int64)
    offsets = torch.zeros(n_tokens + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(one) for one in sets]), 0)
    return KeptCase(Case(kc.case.hidden, weight, kc.case.targets), KeptSet(ids, offsets))


def with_bitmask_rows(kept: KeptSet, tokens: list[int], vocab: int) -> KeptSet:
    """`kept` with the sets of `tokens` moved from the CSR ids to packed bitmasks over `vocab` ids (their engine
    log-probs, if any, dropped: a bitmask carries none)."""
    sizes = kept.sizes().clone()
    bits = []
    for token in tokens:
        lo, hi = int(kept.offsets[token]), int(kept.offsets[token + 1])
        bits.append(pack_bitmask(kept.ids[lo:hi].cpu().numpy(), vocab))
        sizes[token] = 0
    keep = ~torch.isin(kept.element_token(), torch.tensor(tokens, device=kept.ids.device))
    offsets = torch.zeros_like(kept.offsets)
    offsets[1:] = torch.cumsum(sizes, 0)
    logprobs = None if kept.logprobs is None else kept.logprobs[keep]
    device = kept.ids.device
    return KeptSet(
        kept.ids[keep],
        offsets,
        logprobs,
        torch.tensor(tokens, dtype=torch.int64, device=device),
        torch.from_numpy(np.stack(bits)).to(device),
    )


def kept_reference(kc: KeptCase, temperature: float) -> dict[str, torch.Tensor]:
    """fp64 renormalised logprobs / entropy, kept mass and full logprobs of the case's (rounded) inputs."""
    hidden, weight = kc.case.hidden.double().cpu(), kc.case.weight.double().cpu()
    z = (hidden @ weight.T) / temperature  # (N, V)
    log_p = torch.log_softmax(z, dim=1)
    targets = kc.case.targets.cpu()
    n_tokens = z.shape[0]
    out = {
        k: torch.zeros(n_tokens, dtype=torch.float64) for k in ("logprobs", "entropy", "kept_mass", "full")
    }
    offsets, ids = kc.kept.offsets.cpu(), kc.kept.ids.cpu()
    for n in range(n_tokens):
        target = int(targets[n])
        full = 0.0 if target == IGNORE else float(log_p[n, target])
        lo, hi = int(offsets[n]), int(offsets[n + 1])
        if hi == lo:
            p = log_p[n].exp()
            out["logprobs"][n], out["full"][n], out["kept_mass"][n] = full, full, 1.0
            out["entropy"][n] = -(p * log_p[n]).sum()
            continue
        zk = z[n, ids[lo:hi]]
        lse = torch.logsumexp(zk, 0)
        pk = torch.softmax(zk, 0)
        out["logprobs"][n] = float(z[n, target] - lse)
        out["entropy"][n] = float(-(pk * torch.log_softmax(zk, 0)).sum())
        out["kept_mass"][n] = float(log_p[n, ids[lo:hi]].exp().sum())
        out["full"][n] = full
    return out
