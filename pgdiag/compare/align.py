"""Join two runs on sample identity and check that their loss tokens can be compared (docs/compare.md).

What: `align_batches(a, b, ...)` pairs the samples of two `TokenBatch`es, pairs their loss positions, and
returns an `AlignedPair` holding, for every matched loss token, the two log-probs side by side (Δ = lp_b − lp_a).
Why: every parity number is only as good as the alignment under it, so alignment failures are errors that
stop the comparison with the first bad sample and position, never silently wrong numbers.
How: samples are joined with polars on (step, sample_id, segment_idx) (`join="id"`), or on (step, seq_hash,
rank) where rank orders identical sequences of one step by sample_id (`"hash"`), or on (seq_hash, rank)
over all steps (`"hash-any-step"`, `rank_join`; a comparison read in pieces pairs them once on the whole runs'
keys and passes each piece's pairs as `matches`); `"auto"` falls back from id to hash when fewer than half of
side a's ids match. Loss positions are paired by (sample, pos) with a fast path when both masks are identical. Checks, in
order (each error raises `InvalidInputError`, exit 3, unless its code is in `ignore`):

    E304 nothing matched · E306 samples present on one side only · E301 token ids differ ·
    E303/W303 loss masks differ (`checks.samples.mask_issue`) · E302 off-by-one shift · E207 NaN/inf (or
    null) · E205 positive log-probs · E206 zero-filled log-probs (`checks.pairs`, as `pgdiag check` runs them)

Apart: which samples pair up (`pgdiag.compare.matching`), the token index arithmetic
(`pgdiag.compare.token_index`), and how the issues are raised, or held back over the pieces of a run read step by
step (`pgdiag.compare.alignment_issues`).

Without a `seq_hash` per sample (a batch built in memory) the hash is a content hash of the loss tokens,
their positions and the sequence length, computed vectorised; it plays the same role within one comparison.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import numpy as np

from pgdiag.checks.pairs import Locations, ShiftSample, shift_issue, value_issues
from pgdiag.checks.samples import mask_issue
from pgdiag.compare.alignment_issues import (
    ALIGN_HINTS,
    Deferred,
    first_unmatched,
    raise_or_record,
    span_text,
    step_span,
    where_text,
)
from pgdiag.compare.matching import JOIN_KEYS, content_hash, match_samples
from pgdiag.compare.token_index import (
    first_mask_difference,
    gather,
    intersect_positions,
    position_keys,
    token_indices,
    token_take,
)
from pgdiag.data.batch import TokenBatch
from pgdiag.data.schema import stream_column
from pgdiag.data.token_issues import zero_fill_issues
from pgdiag.data.validate import Issue
from pgdiag.errors import Code, InvalidInputError, UsageError


@dataclass(frozen=True)
class AlignedPair:
    """Matched loss tokens of two streams. S matched samples (side a's order), M matched tokens."""

    label_a: str
    label_b: str
    stream_a: str
    stream_b: str
    join: str  # resolved: "id" | "hash" | "hash-any-step"
    step: np.ndarray  # (S,) int64
    sample_id: np.ndarray  # (S,) object, side a's ids
    sample_id_b: np.ndarray  # (S,) object, side b's ids
    offsets: np.ndarray  # (S + 1,) int64
    token_row: np.ndarray  # (M,) int32 matched sample owning each token
    pos: np.ndarray  # (M,) int32 position in input_ids
    resp_pos: np.ndarray  # (M,) int32 pos - prompt_len (0 = first response token)
    token_id: np.ndarray  # (M,) int32
    lp_a: np.ndarray  # (M,) float64
    lp_b: np.ndarray  # (M,) float64
    delta: np.ndarray  # (M,) float64 Δ = lp_b − lp_a, computed once (read-only for every consumer)
    entropy: np.ndarray | None  # (M,) float64, nats, from side b's stream (else side a's)
    reward: np.ndarray | None  # (S,) float64, side a
    env: np.ndarray | None  # (S,) object, side a
    rows_a: np.ndarray  # (S,) int64 row of each matched sample in batch a
    rows_b: np.ndarray  # (S,) int64 row in batch b
    n_samples_a: int
    n_samples_b: int
    n_invalid: int  # matched tokens dropped as non-finite (only when E207 is ignored)
    issues: tuple[Issue, ...]
    deferred: Deferred | None = None  # E304/E306/E303/W303 inputs, when aligned with `deferred=True`

    @property
    def pair(self) -> str:
        return f"{self.label_a}:{self.stream_a} vs {self.label_b}:{self.stream_b}"

    @property
    def n_samples(self) -> int:
        return int(self.step.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.lp_a.shape[0])

    @property
    def n_loss(self) -> np.ndarray:
        """(S,) int64 matched loss tokens per sample."""
        return np.diff(self.offsets)

    def token_sample(self) -> np.ndarray:
        """(M,) int32 index of the matched sample owning each token."""
        return self.token_row


def align_batches(
    a: TokenBatch,
    b: TokenBatch,
    *,
    stream_a: str,
    stream_b: str,
    join: str = "auto",
    ignore: Collection[str] = (),
    deferred: bool = False,
    matches: tuple[np.ndarray, np.ndarray] | None = None,
    keep_nonfinite: bool = False,
) -> AlignedPair:
    """Pair the samples and loss tokens of `a` and `b` and run the alignment checks (module docstring).

    `deferred`: for a piece of a run read step by step: E304, E306 and E303/W303 are not raised or listed but
    counted in `AlignedPair.deferred`, to be merged over the pieces (`Deferred`); `join` must then be resolved
    ("id", "hash" or "hash-any-step"), as "auto" decides on the whole run.
    `matches`: (rows of a, rows of b) of the matched samples in a's row order, when the caller paired them on the
    whole runs' keys (`--join hash-any-step` read in pieces, `compare.pieces`); needs `deferred`, and the
    deferred sample counts (E304, E306) are then the caller's: zero here.
    `keep_nonfinite` (E207 ignored): keep non-finite tokens (`compare --exact`; `finite_only` drops them).
    """
    for batch, stream, side in ((a, stream_a, "a"), (b, stream_b, "b")):
        if stream not in batch.streams:
            listed = ", ".join(batch.streams) or "none"
            raise UsageError(
                Code.STREAM_NOT_FOUND, f"{batch.label}: no stream {stream!r} (side {side}); streams: {listed}"
            )
    pair_name = f"{a.label}:{stream_a} vs {b.label}:{stream_b}"
    seq_hash_a, seq_hash_b = a.seq_hash, b.seq_hash  # (S,) as read; None for batches built in memory
    use_seq_hash = seq_hash_a is not None and seq_hash_b is not None

    def hashes() -> tuple[np.ndarray, np.ndarray]:
        if use_seq_hash:
            return np.asarray(seq_hash_a, dtype=np.uint64), np.asarray(seq_hash_b, dtype=np.uint64)
        return content_hash(a), content_hash(b)

    if matches is None:
        ia, ib, resolved = match_samples(a, b, join=join, hashes=hashes)
    else:
        ia, ib, resolved = (
            np.asarray(matches[0], dtype=np.int64),
            np.asarray(matches[1], dtype=np.int64),
            join,
        )
    issues: list[Issue] = []

    # 1. samples
    only_a = np.setdiff1d(np.arange(a.n_samples), ia)
    only_b = np.setdiff1d(np.arange(b.n_samples), ib)
    held = None
    if matches is not None:  # the sample counts come from the whole runs' keys (the caller's)
        held = Deferred(pair_name, a.label, b.label, resolved, 0, 0, 0, 0, 0, None, None, None, None)
    elif deferred:
        held = Deferred(
            pair_name,
            a.label,
            b.label,
            resolved,
            a.n_samples,
            b.n_samples,
            int(ia.shape[0]),
            int(only_a.size),
            int(only_b.size),
            first_unmatched(a, only_a),
            first_unmatched(b, only_b),
            step_span(a.step),
            step_span(b.step),
        )
    elif ia.shape[0] == 0:
        raise InvalidInputError(
            Code.NOTHING_MATCHED,
            f"{pair_name}: 0 of {a.n_samples} samples matched by {JOIN_KEYS[resolved]}; steps "
            f"{span_text(step_span(a.step))} vs {span_text(step_span(b.step))}",
            ALIGN_HINTS[Code.NOTHING_MATCHED],
        )
    if held is None and (only_a.size or only_b.size):
        first = (
            f"first: {where_text(a.step, a.sample_id, int(only_a[0]))} of {a.label}"
            if only_a.size
            else f"first: {where_text(b.step, b.sample_id, int(only_b[0]))} of {b.label}"
        )
        loc = (a, int(only_a[0])) if only_a.size else (b, int(only_b[0]))
        raise_or_record(
            Issue(
                Code.UNMATCHED_SAMPLES,
                "error",
                int(only_a.size + only_b.size),
                f"{pair_name}: {only_a.size} of {a.n_samples} samples of {a.label} have no match in {b.label} "
                f"and {only_b.size} of {b.n_samples} of {b.label} none in {a.label} ({first}; join "
                f"{JOIN_KEYS[resolved]})",
                int(loc[0].step[loc[1]]),
                str(loc[0].sample_id[loc[1]]),
            ),
            ignore,
            issues,
        )

    # 2. tokens of matched samples
    take_a, off_a = token_take(a.offsets, ia)
    take_b, off_b = token_take(b.offsets, ib)
    step, sample_id = a.step[ia], a.sample_id[ia]
    if use_seq_hash and resolved == "id":
        differs = np.asarray(seq_hash_a)[ia] != np.asarray(seq_hash_b)[ib]
    else:
        differs = a.seq_len[ia] != b.seq_len[ib]
    same_layout = np.array_equal(off_a, off_b) and np.array_equal(
        gather(a.pos, take_a), gather(b.pos, take_b)
    )
    mask = None
    if same_layout:
        idx_a, idx_b, offsets = take_a, take_b, off_a
        if held is not None:
            held = replace(held, mask_a=int(off_a[-1]), mask_b=int(off_b[-1]))
    else:
        take_a, take_b = token_indices(take_a, a.n_tokens), token_indices(take_b, b.n_tokens)
        key_a, key_b = position_keys(a.pos, take_a, off_a, b.pos, take_b, off_b)  # (M_a,), (M_b,)
        idx_a, idx_b, offsets = intersect_positions(key_a, key_b, take_a, take_b, int(ia.shape[0]))
        n_a, n_b, n_both = take_a.shape[0], take_b.shape[0], idx_a.shape[0]
        row, pos = first_mask_difference(key_a, key_b) if n_a + n_b > 2 * n_both else (0, 0)
        mask = mask_issue(
            n_a - n_both,
            n_a,
            n_b - n_both,
            n_b,
            f"{n_a - n_both} only in {a.label}, {n_b - n_both} only in {b.label}; first: "
            f"{where_text(step, sample_id, row, pos)}; metrics use the intersection",
        )
        if held is not None and n_a + n_b > 2 * n_both:
            held = replace(
                held,
                mask_only_a=n_a - n_both,
                mask_a=n_a,
                mask_only_b=n_b - n_both,
                mask_b=n_b,
                mask_first=(where_text(step, sample_id, row, pos), int(step[row]), str(sample_id[row]), pos),
            )
            mask = None
        elif held is not None:
            held = replace(held, mask_a=n_a, mask_b=n_b)
        if mask is not None:
            mask = replace(
                mask,
                message=f"{pair_name}: {mask.message}",
                step=int(step[row]),
                sample_id=str(sample_id[row]),
                pos=pos,
            )
    token_id = gather(a.token_id, idx_a)
    tok_diff = token_id != gather(b.token_id, idx_b)
    token_row = np.repeat(np.arange(ia.shape[0], dtype=np.int32), np.diff(offsets))  # S < 2^31
    differs = differs.copy()
    differs[token_row[tok_diff]] = True
    if differs.any():
        first_row = int(np.flatnonzero(differs)[0])
        bad = np.flatnonzero(tok_diff & (token_row == first_row))
        if bad.size:
            t = int(bad[0])
            ta = t if idx_a is None else int(idx_a[t])
            tb = t if idx_b is None else int(idx_b[t])
            detail = (
                f"first at {where_text(step, sample_id, first_row, int(a.pos[ta]))}: "
                f"{int(a.token_id[ta])} vs {int(b.token_id[tb])}"
            )
        else:
            detail = f"first: {where_text(step, sample_id, first_row)}, outside the loss positions (prompt or length)"
        raise_or_record(
            Issue(
                Code.TOKENS_DIFFER,
                "error",
                int(differs.sum()),
                f"{pair_name}: {int(differs.sum())} matched samples differ in tokens ({detail})",
                int(step[first_row]),
                str(sample_id[first_row]),
            ),
            ignore,
            issues,
        )
    if mask is not None:  # tokens first (E301), then masks, the order `pgdiag check` reports them in
        raise_or_record(mask, ignore, issues)

    lp_a = gather(np.asarray(a.streams[stream_a], dtype=np.float64), idx_a)
    lp_b = gather(np.asarray(b.streams[stream_b], dtype=np.float64), idx_b)
    pos = gather(a.pos, idx_a)
    prompt_len = a.prompt_len[ia]
    where = Locations(offsets, pos, step, sample_id)
    name_a, name_b = f"{a.label} {stream_column(stream_a)}", f"{b.label} {stream_column(stream_b)}"

    # 3. values (checks.pairs, the functions `pgdiag check` runs); a piece of a run read in pieces keeps its E302
    #    sample for the run's verdict, and leaves E206's share of exact 0.0 to the reader (judged over the run)
    shift = None
    if held is not None:
        held = replace(held, shift=ShiftSample.of_piece(lp_a, lp_b, where), shift_names=(name_a, name_b))
    else:
        shift = shift_issue(lp_a, lp_b, where, name_a=name_a, name_b=name_b)
    for issue in [shift] if shift is not None else []:
        raise_or_record(replace(issue, message=f"{pair_name}: {issue.message}"), ignore, issues)
    values = value_issues([(lp_a, name_a), (lp_b, name_b)], where)
    legit_a, legit_b = a.one_token_sets(stream_a), b.one_token_sets(stream_b)
    zero_fill = zero_fill_issues(
        lp_a,
        lp_b,
        where,
        name_a=name_a,
        name_b=name_b,
        single_stream=held is None,
        legit_a=None if legit_a is None else gather(legit_a, idx_a),
        legit_b=None if legit_b is None else gather(legit_b, idx_b),
    )
    for issue in values + zero_fill:
        raise_or_record(replace(issue, message=f"{pair_name}: {issue.message}"), ignore, issues)
    keep = None  # E207 ignored: the non-finite tokens are dropped and counted
    if any(i.code == Code.NON_FINITE for i in values):
        keep = np.isfinite(lp_a) & np.isfinite(lp_b)

    entropy_src = b.entropy.get(stream_b)
    entropy = None if entropy_src is None else gather(np.asarray(entropy_src, dtype=np.float64), idx_b)
    if entropy is None and a.entropy.get(stream_a) is not None:
        entropy = gather(np.asarray(a.entropy[stream_a], dtype=np.float64), idx_a)
    resp_pos = pos - prompt_len.astype(pos.dtype)[token_row]  # (M,) int32
    with np.errstate(invalid="ignore"):  # inf − inf kept for --exact: NaN in Δ, never read by its counts
        delta = lp_b - lp_a
    pair = AlignedPair(
        label_a=a.label,
        label_b=b.label,
        stream_a=stream_a,
        stream_b=stream_b,
        join=resolved,
        step=step.astype(np.int64),
        sample_id=sample_id,
        sample_id_b=b.sample_id[ib],
        offsets=offsets,
        token_row=token_row,
        pos=pos,
        resp_pos=resp_pos,
        token_id=token_id,
        lp_a=lp_a,
        lp_b=lp_b,
        delta=delta,
        entropy=entropy,
        reward=None if a.reward is None else np.asarray(a.reward, dtype=np.float64)[ia],
        env=None if a.env is None else a.env[ia],
        rows_a=ia,
        rows_b=ib,
        n_samples_a=a.n_samples,
        n_samples_b=b.n_samples,
        n_invalid=0,
        issues=tuple(issues),
        deferred=held,
    )
    return pair if keep is None or keep_nonfinite else finite_only(pair)


def finite_only(pair: AlignedPair) -> AlignedPair:
    """`pair` without its tokens that are non-finite on either side (counted in `n_invalid`)."""
    keep = np.isfinite(pair.lp_a) & np.isfinite(pair.lp_b)  # (M,)
    if keep.all():
        return pair
    counts = np.bincount(pair.token_row[keep], minlength=pair.n_samples)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (S + 1,)
    return replace(
        pair,
        offsets=offsets,
        token_row=pair.token_row[keep],
        pos=pair.pos[keep],
        resp_pos=pair.resp_pos[keep],
        token_id=pair.token_id[keep],
        lp_a=pair.lp_a[keep],
        lp_b=pair.lp_b[keep],
        delta=pair.delta[keep],
        entropy=None if pair.entropy is None else pair.entropy[keep],
        n_invalid=pair.n_invalid + int((~keep).sum()),
    )
