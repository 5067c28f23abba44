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

Without a `seq_hash` per sample (a batch built in memory) the hash is a content hash of the loss tokens,
their positions and the sequence length, computed vectorised; it plays the same role within one comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from pgdiag.checks.pairs import (
    Locations,
    ShiftSample,
    shift_issue,
    shift_verdict,
    value_issues,
)
from pgdiag.checks.samples import mask_issue
from pgdiag.data.batch import TokenBatch
from pgdiag.data.pieces import rank_join
from pgdiag.data.schema import stream_column
from pgdiag.data.token_issues import zero_fill_issues
from pgdiag.data.validate import Issue
from pgdiag.errors import Code, InvalidInputError, UsageError

JOIN_MODES = ("auto", "id", "hash", "hash-any-step")


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


@dataclass(frozen=True)
class Deferred:
    """The counts behind E304, E306 and E303/W303 of one piece of a run read step by step (`align_batches`
    with ``deferred=True``); `merge` pools consecutive pieces and `issues` raises or lists them as a run read
    whole would (first locations in step order)."""

    pair_name: str
    label_a: str
    label_b: str
    join: str
    n_a: int  # samples of side a
    n_b: int
    n_matched: int
    only_a: int  # samples of a with no match in b
    only_b: int
    first_only: tuple[str, int, str] | None  # (text, step, sample_id) of the first unmatched sample
    first_only_b: tuple[str, int, str] | None  # the first unmatched sample of b (used when a has none)
    steps: tuple[int, int] | None  # (min, max) step of side a
    steps_b: tuple[int, int] | None
    mask_only_a: int = 0  # matched loss positions on side a only
    mask_a: int = 0  # matched loss positions of side a
    mask_only_b: int = 0
    mask_b: int = 0
    mask_first: tuple[str, int, str, int] | None = (
        None  # (text, step, sample_id, pos) of the first difference
    )
    shift: ShiftSample | None = None  # E302's sample of the matched tokens, pooled over the pieces
    shift_names: tuple[str, str] = ("", "")  # (name_a, name_b) of the E302 message

    def merge(self, other: Deferred) -> Deferred:
        def span(x: tuple[int, int] | None, y: tuple[int, int] | None) -> tuple[int, int] | None:
            return x if y is None else y if x is None else (min(x[0], y[0]), max(x[1], y[1]))

        return replace(
            self,
            n_a=self.n_a + other.n_a,
            n_b=self.n_b + other.n_b,
            n_matched=self.n_matched + other.n_matched,
            only_a=self.only_a + other.only_a,
            only_b=self.only_b + other.only_b,
            first_only=self.first_only or other.first_only,
            first_only_b=self.first_only_b or other.first_only_b,
            steps=span(self.steps, other.steps),
            steps_b=span(self.steps_b, other.steps_b),
            mask_only_a=self.mask_only_a + other.mask_only_a,
            mask_a=self.mask_a + other.mask_a,
            mask_only_b=self.mask_only_b + other.mask_only_b,
            mask_b=self.mask_b + other.mask_b,
            mask_first=self.mask_first or other.mask_first,
            shift=self.shift
            if other.shift is None
            else other.shift
            if self.shift is None
            else self.shift.merge(other.shift),
            shift_names=self.shift_names if self.shift is not None else other.shift_names,
        )

    def unmatched_issues(self, ignore: Collection[str]) -> list[Issue]:
        """E304 (raised) when nothing matched, then E306 (raised unless ignored, else dropped)."""
        if self.n_matched == 0:
            raise InvalidInputError(
                Code.NOTHING_MATCHED,
                f"{self.pair_name}: 0 of {self.n_a} samples matched by {_JOIN_KEYS[self.join]}; steps "
                f"{_span_text(self.steps)} vs {_span_text(self.steps_b)}",
                _HINTS[Code.NOTHING_MATCHED],
            )
        issues: list[Issue] = []
        if self.only_a or self.only_b:
            first = self.first_only if self.only_a else self.first_only_b
            assert first is not None
            _raise_or_record(
                Issue(
                    Code.UNMATCHED_SAMPLES,
                    "error",
                    self.only_a + self.only_b,
                    f"{self.pair_name}: {self.only_a} of {self.n_a} samples of {self.label_a} have no match in "
                    f"{self.label_b} and {self.only_b} of {self.n_b} of {self.label_b} none in {self.label_a} "
                    f"(first: {first[0]}; join {_JOIN_KEYS[self.join]})",
                    first[1],
                    first[2],
                ),
                ignore,
                issues,
            )
        return issues

    def shift_issues(self, ignore: Collection[str]) -> list[Issue]:
        """E302 (raised unless ignored) on the matched tokens' sample pooled over the pieces (`ShiftSample`)."""
        if self.shift is None or Code.SHIFTED in ignore:
            return []
        name_a, name_b = self.shift_names
        found = shift_verdict(self.shift, name_a=name_a, name_b=name_b)
        issues: list[Issue] = []
        if found is not None:
            _raise_or_record(replace(found, message=f"{self.pair_name}: {found.message}"), ignore, issues)
        return issues

    def mask_issues(self, ignore: Collection[str]) -> list[Issue]:
        """E303 (raised unless ignored) or W303 over the pooled loss positions of the matched samples."""
        if self.mask_first is None:
            return []
        text, step, sample_id, pos = self.mask_first
        found = mask_issue(
            self.mask_only_a,
            self.mask_a,
            self.mask_only_b,
            self.mask_b,
            f"{self.mask_only_a} only in {self.label_a}, {self.mask_only_b} only in {self.label_b}; first: "
            f"{text}; metrics use the intersection",
        )
        issues: list[Issue] = []
        if found is not None:
            found = replace(
                found, message=f"{self.pair_name}: {found.message}", step=step, sample_id=sample_id, pos=pos
            )
            _raise_or_record(found, ignore, issues)
        return issues


def _span_text(span: tuple[int, int] | None) -> str:
    if span is None:
        return "none"
    return str(span[0]) if span[0] == span[1] else f"{span[0]}-{span[1]}"


def _span(step: np.ndarray) -> tuple[int, int] | None:
    return None if step.size == 0 else (int(step.min()), int(step.max()))


def token_take(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """Token indices of samples `rows` (in that order) and the offsets of the gathered layout.

    The indices are None when `rows` is every sample in order (the common case: no gather, no copy).
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.shape[0] == offsets.shape[0] - 1 and np.array_equal(rows, np.arange(rows.shape[0])):
        return None, np.asarray(offsets, dtype=np.int64)
    starts = offsets[rows]
    counts = offsets[rows + 1] - starts
    new_offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    take = np.repeat(starts - new_offsets[:-1], counts) + np.arange(new_offsets[-1], dtype=np.int64)
    return take, new_offsets


def _gather(values: np.ndarray, take: np.ndarray | None) -> np.ndarray:
    """values[take], or `values` itself when take is None (identity)."""
    return values if take is None else values[take]


def _indices(take: np.ndarray | None, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) if take is None else take


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def content_hash(batch: TokenBatch) -> np.ndarray:
    """(S,) uint64 hash of each sample's loss tokens, their positions and its length (order-independent sum)."""
    with np.errstate(over="ignore"):
        tok = batch.token_id.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        per_token = _mix64(tok ^ _mix64(batch.pos.astype(np.uint64) + np.uint64(1)))  # (M,)
        out = _mix64(batch.seq_len.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019))  # (S,)
        counts = batch.n_loss
        nonempty = counts > 0
        if batch.n_tokens:
            sums = np.add.reduceat(per_token, batch.offsets[:-1][nonempty])
            out[nonempty] = out[nonempty] + sums
    return out


def _key_frame(batch: TokenBatch, hashes: np.ndarray, index_name: str) -> pl.DataFrame:
    return pl.DataFrame(
        {
            index_name: np.arange(batch.n_samples, dtype=np.int64),
            "step": batch.step.astype(np.int64),
            "sample_id": pl.Series(batch.sample_id.tolist(), dtype=pl.String),
            "segment_idx": batch.segment_idx.astype(np.int32),
            "hash": hashes.astype(np.uint64),
        }
    )


def match_samples(
    a: TokenBatch,
    b: TokenBatch,
    *,
    join: str,
    hashes: Callable[[], tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, str]:
    """(rows of a, rows of b, resolved join) of the matched samples, in side a's row order.

    `hashes()` gives the per-sample hashes of a and b; it is called only when a hash join runs.
    """
    if join not in JOIN_MODES:
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"unknown --join {join!r}", f"choose one of {', '.join(JOIN_MODES)}"
        )
    resolved = join
    if join in ("auto", "id"):
        on = ["step", "sample_id", "segment_idx"]
        no_hash = np.zeros(0, dtype=np.uint64)
        fa = _key_frame(a, np.zeros(a.n_samples, dtype=np.uint64) if a.n_samples else no_hash, "ia")
        fb = _key_frame(b, np.zeros(b.n_samples, dtype=np.uint64) if b.n_samples else no_hash, "ib")
        matched = fa.join(fb.drop("hash"), on=on, how="inner")
        resolved = "hash" if join == "auto" and 2 * matched.height < a.n_samples else "id"
    if resolved in ("hash", "hash-any-step"):
        hash_a, hash_b = hashes()
        fa, fb = _key_frame(a, hash_a, "ia"), _key_frame(b, hash_b, "ib")
        matched = rank_join(fa, fb, ["step", "hash"] if resolved == "hash" else ["hash"])
    matched = matched.sort("ia")
    return matched["ia"].to_numpy(), matched["ib"].to_numpy(), resolved


def _raise_or_record(issue: Issue, ignore: Collection[str], issues: list[Issue]) -> None:
    if issue.code in ignore:
        return
    if issue.severity == "error":
        hint = issue.hint or _HINTS.get(issue.code)
        raise InvalidInputError(issue.code, issue.message, hint)
    issues.append(issue)


_HINTS = {
    Code.TOKENS_DIFFER: "compare runs built from the same token ids (retokenized text or template drift?)",
    Code.NOTHING_MATCHED: "check --steps and --join (hash joins match sequences whose sample ids differ)",
    Code.UNMATCHED_SAMPLES: "compare matched samples only with --ignore E306",
}


def _where(step: np.ndarray, sample_id: np.ndarray, row: int, pos: int | None = None) -> str:
    text = f"step {int(step[row])}, sample {sample_id[row]}"
    return text if pos is None else f"{text}, pos {pos}"


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
            _first_unmatched(a, only_a),
            _first_unmatched(b, only_b),
            _span(a.step),
            _span(b.step),
        )
    elif ia.shape[0] == 0:
        raise InvalidInputError(
            Code.NOTHING_MATCHED,
            f"{pair_name}: 0 of {a.n_samples} samples matched by {_JOIN_KEYS[resolved]}; steps "
            f"{_step_range(a.step)} vs {_step_range(b.step)}",
            _HINTS[Code.NOTHING_MATCHED],
        )
    if held is None and (only_a.size or only_b.size):
        first = (
            f"first: {_where(a.step, a.sample_id, int(only_a[0]))} of {a.label}"
            if only_a.size
            else f"first: {_where(b.step, b.sample_id, int(only_b[0]))} of {b.label}"
        )
        loc = (a, int(only_a[0])) if only_a.size else (b, int(only_b[0]))
        _raise_or_record(
            Issue(
                Code.UNMATCHED_SAMPLES,
                "error",
                int(only_a.size + only_b.size),
                f"{pair_name}: {only_a.size} of {a.n_samples} samples of {a.label} have no match in {b.label} "
                f"and {only_b.size} of {b.n_samples} of {b.label} none in {a.label} ({first}; join "
                f"{_JOIN_KEYS[resolved]})",
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
        _gather(a.pos, take_a), _gather(b.pos, take_b)
    )
    mask = None
    if same_layout:
        idx_a, idx_b, offsets = take_a, take_b, off_a
        if held is not None:
            held = replace(held, mask_a=int(off_a[-1]), mask_b=int(off_b[-1]))
    else:
        take_a, take_b = _indices(take_a, a.n_tokens), _indices(take_b, b.n_tokens)
        idx_a, idx_b, offsets = _intersect_positions(a, b, take_a, off_a, take_b, off_b)
        n_a, n_b, n_both = take_a.shape[0], take_b.shape[0], idx_a.shape[0]
        row, pos = (
            _first_mask_difference(a, b, take_a, off_a, take_b, off_b) if n_a + n_b > 2 * n_both else (0, 0)
        )
        mask = mask_issue(
            n_a - n_both,
            n_a,
            n_b - n_both,
            n_b,
            f"{n_a - n_both} only in {a.label}, {n_b - n_both} only in {b.label}; first: "
            f"{_where(step, sample_id, row, pos)}; metrics use the intersection",
        )
        if held is not None and n_a + n_b > 2 * n_both:
            held = replace(
                held,
                mask_only_a=n_a - n_both,
                mask_a=n_a,
                mask_only_b=n_b - n_both,
                mask_b=n_b,
                mask_first=(_where(step, sample_id, row, pos), int(step[row]), str(sample_id[row]), pos),
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
    token_id = _gather(a.token_id, idx_a)
    tok_diff = token_id != _gather(b.token_id, idx_b)
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
                f"first at {_where(step, sample_id, first_row, int(a.pos[ta]))}: "
                f"{int(a.token_id[ta])} vs {int(b.token_id[tb])}"
            )
        else:
            detail = (
                f"first: {_where(step, sample_id, first_row)}, outside the loss positions (prompt or length)"
            )
        _raise_or_record(
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
        _raise_or_record(mask, ignore, issues)

    lp_a = _gather(np.asarray(a.streams[stream_a], dtype=np.float64), idx_a)
    lp_b = _gather(np.asarray(b.streams[stream_b], dtype=np.float64), idx_b)
    pos = _gather(a.pos, idx_a)
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
        _raise_or_record(replace(issue, message=f"{pair_name}: {issue.message}"), ignore, issues)
    values = value_issues([(lp_a, name_a), (lp_b, name_b)], where)
    legit_a, legit_b = a.one_token_sets(stream_a), b.one_token_sets(stream_b)
    zero_fill = zero_fill_issues(
        lp_a,
        lp_b,
        where,
        name_a=name_a,
        name_b=name_b,
        single_stream=held is None,
        legit_a=None if legit_a is None else _gather(legit_a, idx_a),
        legit_b=None if legit_b is None else _gather(legit_b, idx_b),
    )
    for issue in values + zero_fill:
        _raise_or_record(replace(issue, message=f"{pair_name}: {issue.message}"), ignore, issues)
    keep = None  # E207 ignored: the non-finite tokens are dropped and counted
    if any(i.code == Code.NON_FINITE for i in values):
        keep = np.isfinite(lp_a) & np.isfinite(lp_b)

    entropy_src = b.entropy.get(stream_b)
    entropy = None if entropy_src is None else _gather(np.asarray(entropy_src, dtype=np.float64), idx_b)
    if entropy is None and a.entropy.get(stream_a) is not None:
        entropy = _gather(np.asarray(a.entropy[stream_a], dtype=np.float64), idx_a)
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


def _first_unmatched(batch: TokenBatch, rows: np.ndarray) -> tuple[str, int, str] | None:
    """(text, step, sample_id) of the first of `rows`, for E306."""
    if rows.size == 0:
        return None
    r = int(rows[0])
    return (
        f"{_where(batch.step, batch.sample_id, r)} of {batch.label}",
        int(batch.step[r]),
        str(batch.sample_id[r]),
    )


def unmatched_side(batch: TokenBatch, *, side: str, pair_name: str, label_other: str, join: str) -> Deferred:
    """The `Deferred` counts of a piece where only one run has samples (`side` "a" or "b"): all unmatched."""
    rows = np.arange(batch.n_samples)
    first = _first_unmatched(batch, rows)
    empty = None  # no steps on the other side
    if side == "a":
        return Deferred(
            pair_name,
            batch.label,
            label_other,
            join,
            batch.n_samples,
            0,
            0,
            batch.n_samples,
            0,
            first,
            None,
            _span(batch.step),
            empty,
        )
    return Deferred(
        pair_name,
        label_other,
        batch.label,
        join,
        0,
        batch.n_samples,
        0,
        0,
        batch.n_samples,
        None,
        first,
        empty,
        _span(batch.step),
    )


_JOIN_KEYS = {
    "id": "(step, sample_id, segment_idx)",
    "hash": "(step, seq_hash)",
    "hash-any-step": "(seq_hash)",
    "auto": "(step, sample_id)",
}


def _step_range(step: np.ndarray) -> str:
    if step.size == 0:
        return "none"
    lo, hi = int(step.min()), int(step.max())
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _intersect_positions(
    a: TokenBatch,
    b: TokenBatch,
    take_a: np.ndarray,
    off_a: np.ndarray,
    take_b: np.ndarray,
    off_b: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token indices into a and b of the (sample, pos) present on both sides, and their offsets."""
    n_rows = off_a.shape[0] - 1
    row_a = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(off_a))
    row_b = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(off_b))
    key_a = (row_a << 32) | a.pos[take_a].astype(np.int64)
    key_b = (row_b << 32) | b.pos[take_b].astype(np.int64)
    _, ja, jb = np.intersect1d(key_a, key_b, assume_unique=True, return_indices=True)  # sorted by (row, pos)
    counts = np.bincount(row_a[ja], minlength=n_rows)
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return take_a[ja], take_b[jb], offsets


def _first_mask_difference(
    a: TokenBatch,
    b: TokenBatch,
    take_a: np.ndarray,
    off_a: np.ndarray,
    take_b: np.ndarray,
    off_b: np.ndarray,
) -> tuple[int, int]:
    """(matched row, pos) of the first loss position present on one side only."""
    n_rows = off_a.shape[0] - 1
    row_a = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(off_a))
    row_b = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(off_b))
    key_a = (row_a << 32) | a.pos[take_a].astype(np.int64)
    key_b = (row_b << 32) | b.pos[take_b].astype(np.int64)
    only = np.setxor1d(key_a, key_b, assume_unique=True)
    first = int(only.min())
    return first >> 32, first & 0xFFFFFFFF
