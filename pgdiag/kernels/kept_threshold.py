"""Kept sets by threshold bisection: vLLM's and SGLang's truncations without sorting the vocabulary.

What: `keep_mask_threshold(z, top_k, top_p, min_p, engine)` returns the (C, V) bool kept mask of tempered fp32
logits z, the same sets as the sort-based references `kept_reconstruct.keep_mask_vllm` / `keep_mask_sglang`
(the engines' rules and citations are in `kept_reconstruct`'s docstring). Every rule keeps a *prefix* of the
row sorted descending, ties ordered as a stable sort orders them (vLLM sorts ascending: among equal logits the
lower id comes first there, so last here; SGLang sorts descending: the lower id first):

``vllm``   floor = m + log(min_p) (min-p: p_j < min_p * p_max  <=>  z_j < m + log min_p, m the row max); top-k:
           floor = max(floor, the k-th largest z) (every tie at the k-th logit kept); top-p: the prefix of
           {z >= floor} whose tokens have mass above them (renormalised over {z >= floor}) < p, the first always.
``sglang`` the shortest of: k tokens (ties cut in the sort order), the tokens with mass above them (on the full
           distribution) <= p, the tokens with z >= m + log(min_p), the tokens with nonzero fp32 probability
           (taken as z >= m - 103.28: fp32's smallest subnormal is e^-103.28).

How (threshold bisection on the chunk's fp32 logits, no (C, V) sort): each rule is a *bracket search*. A bracket
[lo, hi) per row holds the boundary token: every token >= hi is in the prefix, every token < lo is out. One pass
(`levels`) evaluates LEVELS thresholds evenly spaced in [lo, hi] at once: the count #{z >= t} and the mass
Σ_{z >= t} exp(z - m) (fp64 sums) at each; the bracket shrinks to the two neighbouring thresholds around the
target (a count k, or a mass p·Z). When a bracket holds at most `WINDOW_MAX` tokens (or cannot shrink: ties), the
tokens inside it (a *window*) are taken out (`nonzero`) and ordered by (value, id) -- a sort of at most a few
thousand values a row -- and the boundary is decided token by token, exactly: the k-th value for top-k, the mass
above each token (the mass >= hi plus the window's prefix, fp64) for top-p. vLLM's top-k bracket starts at the
row's [min, max]; its top-p bracket at [floor, max], which after top-k usually holds <= WINDOW_MAX tokens, so no
pass is needed. `levels` is `levels_torch` (searchsorted + scatter_add, the plain-torch reference) or the Triton
kernel `kept_threshold_triton.levels_triton` (one read of the chunk a pass).

Boundary rounding: min-p is compared in logit space (z_j - m against log min_p) and masses are summed in fp64,
where the references compare fp32 softmax values and an fp32 cumulative sum: a token within fp32 rounding of the
min-p or top-p boundary may fall the other way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LEVELS = 16  # thresholds a pass
WINDOW_MAX = 1024  # a bracket with at most this many tokens a row is decided token by token
MAX_PASSES = 24
UNDERFLOW_NATS = 110.0  # exp(z - m) is 0 in fp32 below m - 103.97: such tokens carry no mass
SUBNORMAL_NATS = 103.28  # log of fp32's smallest subnormal, 2^-149
Levels = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def levels_torch(
    z: torch.Tensor, row_max: torch.Tensor, thresholds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """((C, S) int64 #{z >= t_s}, (C, S) fp64 Σ_{z >= t_s} exp(z - row_max)) for ascending thresholds (C, S)."""
    n_rows, n_levels = thresholds.shape
    bucket = torch.searchsorted(thresholds.contiguous(), z.contiguous(), right=True)  # (C, V) #{s: t_s <= z}
    hist = torch.zeros(n_rows, n_levels + 1, dtype=torch.int64, device=z.device)
    hist.scatter_add_(1, bucket, torch.ones_like(bucket))
    weights = torch.exp(z - row_max[:, None]).double()  # (C, V)
    mass = torch.zeros(n_rows, n_levels + 1, dtype=torch.float64, device=z.device)
    mass.scatter_add_(1, bucket, weights)
    # z >= t_s  <=>  bucket > s: the suffix sums from bucket s + 1
    counts = hist.flip(1).cumsum(1).flip(1)[:, 1:]
    masses = mass.flip(1).cumsum(1).flip(1)[:, 1:]
    return counts, masses


@dataclass
class Bracket:
    """Per row (C,): the bracket [lo, hi) and the count / mass of the tokens >= hi."""

    lo: torch.Tensor  # fp32
    hi: torch.Tensor  # fp32
    n_hi: torch.Tensor  # int64
    g_hi: torch.Tensor  # fp64


@dataclass
class Window:
    """The tokens of the rows' brackets, ordered by (row, value descending, id in the engine's tie order)."""

    rows: torch.Tensor  # (W,) int64
    cols: torch.Tensor  # (W,) int64
    values: torch.Tensor  # (W,) fp32
    rank: torch.Tensor  # (W,) int64 position inside its row's window
    above: torch.Tensor  # (W,) fp64 mass of the row's window tokens before it
    mass: torch.Tensor  # (W,) fp64 exp(z - m)
    total: torch.Tensor  # (C,) fp64 the window's mass a row


def _thresholds(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """(C, LEVELS) ascending fp32 thresholds from lo to hi."""
    frac = torch.linspace(0.0, 1.0, LEVELS, device=lo.device, dtype=torch.float32)
    t = lo[:, None] + (hi - lo)[:, None] * frac[None, :]
    t = torch.minimum(torch.maximum(t, lo[:, None]), hi[:, None])
    t[:, 0], t[:, -1] = lo, hi
    return torch.cummax(t, dim=1).values


def bracket_search(
    z: torch.Tensor,
    row_max: torch.Tensor,
    start: Bracket,
    n_lo: torch.Tensor | None,
    *,
    goal_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    by_mass: bool,
    strict_below: bool,
    levels: Levels,
) -> tuple[Bracket, torch.Tensor | None]:
    """Shrink `start` until every row's bracket holds <= WINDOW_MAX tokens (or stops shrinking).

    The target is ``goal_of(count >= start.lo, mass >= start.lo)`` ((C,) int64 and fp64, from the first pass).
    Count search: hi keeps #{z >= hi} < target, lo keeps #{z >= lo} >= target. Mass search (`by_mass`): hi
    keeps the mass >= hi <= target, lo keeps it >= target (> target unless `strict_below`). Returns the bracket
    and the target, None when no pass ran: `n_lo` (C,), the count >= start.lo when known, showed every window
    small already (the caller takes the target from the window)."""
    lo, hi, n_hi, g_hi = start.lo.clone(), start.hi.clone(), start.n_hi.clone(), start.g_hi.clone()
    if n_lo is not None and bool(((n_lo - n_hi) <= WINDOW_MAX).all()):
        return Bracket(lo, hi, n_hi, g_hi), None
    goal = g_hi
    steps = torch.arange(LEVELS, device=z.device)
    for step in range(MAX_PASSES):
        t = _thresholds(lo, hi)  # (C, S)
        counts, masses = levels(z, row_max, t)
        if step == 0:
            goal = goal_of(counts[:, 0], masses[:, 0]).double()
        measure = masses if by_mass else counts.double()
        above_ok = measure <= goal[:, None] if by_mass else measure < goal[:, None]  # (C, S), a suffix
        below = measure >= goal[:, None] if (strict_below or not by_mass) else measure > goal[:, None]
        i_hi = torch.where(above_ok, steps, LEVELS - 1).amin(dim=1)  # (C,)
        i_lo = torch.minimum(torch.where(below, steps, 0).amax(dim=1), i_hi)
        new_lo = t.gather(1, i_lo[:, None])[:, 0]
        new_hi = t.gather(1, i_hi[:, None])[:, 0]
        moved = (new_lo != lo) | (new_hi != hi)
        lo, hi = new_lo, new_hi
        n_hi = counts.gather(1, i_hi[:, None])[:, 0]
        g_hi = masses.gather(1, i_hi[:, None])[:, 0]
        width = counts.gather(1, i_lo[:, None])[:, 0] - n_hi
        if bool(((width <= WINDOW_MAX) | ~moved).all()):
            break
    return Bracket(lo, hi, n_hi, g_hi), goal


def take_window(
    z: torch.Tensor, row_max: torch.Tensor, bracket: Bracket, *, ties_high_id_first: bool
) -> Window:
    """The tokens lo <= z < hi of every row, ordered by (row, z descending, id: descending when
    `ties_high_id_first`, as a stable ascending sort read backwards, else ascending)."""
    inside = z >= bracket.lo[:, None]
    if not bool((bracket.hi > row_max).all()):  # else every token is below hi
        inside &= z < bracket.hi[:, None]
    rows, cols = inside.nonzero(as_tuple=True)  # (row, id) ascending
    if ties_high_id_first:
        rows, cols = rows.flip(0), cols.flip(0)
    values = z[rows, cols]
    order = torch.sort(values, descending=True, stable=True).indices
    order = order[torch.sort(rows[order], stable=True).indices]
    rows, cols, values = rows[order], cols[order], values[order]
    n_rows = z.shape[0]
    sizes = torch.bincount(rows, minlength=n_rows)  # (C,)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.arange(rows.shape[0], device=z.device) - starts[rows]
    mass = torch.exp(values.double() - row_max.double()[rows])
    inclusive = torch.cumsum(mass, 0)
    row_base = torch.zeros(n_rows, dtype=torch.float64, device=z.device)
    nonempty = sizes > 0
    first = starts[nonempty]
    row_base[nonempty] = inclusive[first] - mass[first]
    above = inclusive - mass - row_base[rows]
    total = torch.zeros(n_rows, dtype=torch.float64, device=z.device).index_add_(0, rows, mass)
    return Window(rows, cols, values, rank, above, mass, total)


def _start(lo: torch.Tensor, row_max: torch.Tensor) -> Bracket:
    hi = torch.nextafter(row_max, torch.full_like(row_max, float("inf")))
    zeros = torch.zeros_like(row_max)
    return Bracket(lo, hi, zeros.long(), zeros.double())


def kth_value(
    z: torch.Tensor,
    row_max: torch.Tensor,
    lo: torch.Tensor,
    k: torch.Tensor,
    levels: Levels,
    *,
    high_id: bool,
) -> tuple[torch.Tensor, torch.Tensor, Window, Bracket]:
    """The k-th largest z >= lo a row (k (C,) int64 >= 1, cut to #{z >= lo}), the k used, its window and
    bracket. Rows need a token >= lo."""
    bracket, goal = bracket_search(
        z, row_max, _start(lo, row_max), None, goal_of=lambda count, _: torch.minimum(k, count).clamp(min=1),
        by_mass=False, strict_below=True, levels=levels,
    )  # fmt: skip
    assert goal is not None
    used = goal.long()
    window = take_window(z, row_max, bracket, ties_high_id_first=high_id)
    at = window.rank == (used - 1 - bracket.n_hi)[window.rows]
    value = torch.full_like(row_max, float("-inf"))
    value[window.rows[at]] = window.values[at]
    return value, used, window, bracket


def mass_prefix(
    z: torch.Tensor,
    row_max: torch.Tensor,
    floor: torch.Tensor,
    n_floor: torch.Tensor | None,
    p: torch.Tensor,
    levels: Levels,
    *,
    strict: bool,
    high_id: bool,
) -> tuple[Bracket, Window, torch.Tensor]:
    """The top-p prefix of {z >= floor}: token j (in the tie order) is in iff the mass above it is < p·Z
    (`strict`, vLLM) or <= p·Z (SGLang), Z the mass >= floor, the first token always. `n_floor` (C,) the count
    >= floor when known (an upper bound is enough). Returns the bracket, its window and the (W,) bool window
    tokens in the prefix (every token >= bracket.hi is in)."""
    lo = torch.maximum(floor, row_max - UNDERFLOW_NATS)
    fraction = p.double().clamp(min=1e-30)
    bracket, goal = bracket_search(
        z, row_max, _start(lo, row_max), n_floor, goal_of=lambda _, mass: fraction * mass, by_mass=True,
        strict_below=strict, levels=levels,
    )  # fmt: skip
    window = take_window(z, row_max, bracket, ties_high_id_first=high_id)
    if goal is None:  # no pass ran: the window is every token >= lo
        goal = fraction * (bracket.g_hi + window.total)
    above = bracket.g_hi[window.rows] + window.above
    inside = above < goal[window.rows] if strict else above <= goal[window.rows]
    inside |= (window.rank == 0) & (bracket.n_hi[window.rows] == 0)  # the largest token always
    return bracket, window, inside


def _row_range(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((C,) max, (C,) smallest finite logit) of each row, one pass (a second only when a row has -inf)."""
    low, row_max = torch.aminmax(z, dim=1)
    if bool(torch.isinf(low).any()):
        low = torch.where(torch.isfinite(z), z, float("inf")).amin(dim=1)
    return row_max, low


def _coordinates(
    z: torch.Tensor, hi: torch.Tensor | None, window: Window, keep_window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """((E,) rows, (E,) ids) row-major of the tokens z >= hi (none when `hi` is None) and the window tokens
    `keep_window` (W,)."""
    rows, cols = window.rows[keep_window], window.cols[keep_window]
    if hi is not None:
        above_rows, above_cols = (z >= hi[:, None]).nonzero(as_tuple=True)
        rows, cols = torch.cat([above_rows, rows]), torch.cat([above_cols, cols])
    order = torch.sort(rows * z.shape[1] + cols).indices
    return rows[order], cols[order]


def kept_coordinates(
    z: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    engine: str,
    levels: Levels = levels_torch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """((E,) row, (E,) token id) of the tokens `engine` ("vllm" or "sglang") keeps, row-major, from tempered
    fp32 logits z (C, V); top_k (C,) int64 (<= 0 or >= V: off), top_p (C,) fp32 (>= 1: off), min_p (C,) fp32
    (<= 0: off). Rows need a finite max."""
    vocab = z.shape[1]
    row_max, low = _row_range(z)  # (C,)
    log_min_p = torch.log(torch.where(min_p > 0, min_p, 1.0).float())
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1
    all_k = torch.where(k_on, top_k.long(), vocab)
    if engine == "vllm":
        floor = torch.maximum(torch.where(min_p > 0, row_max + log_min_p, low), low)  # min-p, in logit space
        n_floor = None
        if bool(k_on.any()):
            kth, _, window, bracket = kth_value(z, row_max, floor, all_k, levels, high_id=True)
            floor = torch.maximum(floor, kth)  # ties at the k-th logit kept
            at_or_above = window.values >= kth[window.rows]
            n_floor = bracket.n_hi + torch.bincount(window.rows[at_or_above], minlength=z.shape[0])
        if not bool(p_on.any()):
            return (z >= floor[:, None]).nonzero(as_tuple=True)
        p = torch.where(p_on, top_p.float(), 1.0)
        bracket, window, inside = mass_prefix(
            z, row_max, floor, n_floor, p, levels, strict=True, high_id=True
        )
        inside &= p_on[window.rows]
        if bool(p_on.all()) and bool((bracket.n_hi == 0).all()):  # every kept token is in the window
            return _coordinates(z, None, window, inside)
        return _coordinates(z, torch.where(p_on, bracket.hi, floor), window, inside)
    # SGLang: the shortest of the k, min-p, nonzero-probability and top-p prefixes, cut in its sort order
    floor = torch.maximum(row_max - SUBNORMAL_NATS, low)
    floor = torch.where(min_p > 0, torch.maximum(floor, row_max + log_min_p), floor)
    length = torch.minimum((z >= floor[:, None]).sum(dim=1), all_k)  # (C,)
    if bool(p_on.any()):
        p = torch.where(p_on, top_p.float(), 1.0)
        bracket, window, inside = mass_prefix(z, row_max, low, None, p, levels, strict=False, high_id=False)
        n_prefix = bracket.n_hi + torch.bincount(window.rows[inside], minlength=z.shape[0])
        length = torch.where(p_on, torch.minimum(length, n_prefix), length)
    _, used, window, bracket = kth_value(z, row_max, low, length.clamp(min=1), levels, high_id=False)
    keep_window = (bracket.n_hi[window.rows] + window.rank) < used[window.rows]
    hi = None if bool((bracket.n_hi == 0).all()) else bracket.hi
    return _coordinates(z, hi, window, keep_window)


def keep_mask_threshold(
    z: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    engine: str,
    levels: Levels = levels_torch,
) -> torch.Tensor:
    """(C, V) bool mask of `kept_coordinates` (the contract of the sort references)."""
    rows, cols = kept_coordinates(z, top_k, top_p, min_p, engine=engine, levels=levels)
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[rows, cols] = True
    return keep
