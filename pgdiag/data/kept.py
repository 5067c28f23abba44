"""Kept sets of the sampling stream: the tokens that survived min-p / top-k / top-p at each position, in CSR form.

What: per sample, ``sampling_kept_ids`` (list<int32>) holds the kept token ids of every position concatenated in
position order and ``sampling_kept_offsets`` (list<int32>, T + 1 values from 0 to ``len(ids)``) delimits them:
position p's set is ``ids[offsets[p]:offsets[p + 1]]``; an empty set means "not recorded" (score the full
vocabulary there). Large sets may be stored as packed bitmasks instead (vLLM sends ids up to 2,048 a position
and a bitmask beyond): ``sampling_kept_bitmask_positions`` (list<int32>, increasing) names the positions so
stored, whose id range must be empty, and ``sampling_kept_bitmask`` (list<uint8>) holds one bitmask of B bytes
per such position (bit j of byte b, least significant first, is token ``8 b + j``; B = len / positions).
``sampling_kept_logprobs`` (list<float32>, aligned with the ids) is the engine's own log-prob of each kept id.

Why here: the reader (`pgdiag.data.runs`), the importers' writer and ``check`` validate these columns with the
same vectorised rules (`kept_issues`: E220 offsets, E221 sampled token outside its set, E222 id outside the
vocabulary, E223 duplicate in a set), and the zero-fill rules (E206, W216) need `position_sizes`: a renormalised
log-prob of exactly 0.0 is legitimate where the recorded set holds one token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList, flat_list, row_of
from pgdiag.errors import Code

KEPT_IDS = "sampling_kept_ids"
KEPT_OFFSETS = "sampling_kept_offsets"
KEPT_LOGPROBS = "sampling_kept_logprobs"
KEPT_BITMASK = "sampling_kept_bitmask"
KEPT_BITMASK_POSITIONS = "sampling_kept_bitmask_positions"
KEPT_COLUMNS = (KEPT_IDS, KEPT_OFFSETS, KEPT_LOGPROBS, KEPT_BITMASK, KEPT_BITMASK_POSITIONS)
BITMASK_THRESHOLD = 2048  # vLLM's: ids up to this many a position, a bitmask beyond


@dataclass(frozen=True)
class KeptColumns:
    """The kept-set columns of R rows, flattened (`FlatList` each; the optional ones None when absent)."""

    ids: FlatList  # row r: the kept ids of its positions, concatenated
    offsets: FlatList  # row r: T_r + 1 offsets into its ids
    logprobs: FlatList | None = None  # aligned with `ids`
    bitmask: FlatList | None = None  # row r: B bytes per bitmask position
    bitmask_positions: FlatList | None = None  # row r: positions stored as bitmasks

    def take(self, keep: np.ndarray) -> KeptColumns:
        """The rows `keep` ((K,) int64, in the order given), re-flattened."""
        return KeptColumns(
            *(None if flat is None else take_rows(flat, keep) for flat in self._fields())  # type: ignore[arg-type]
        )

    def _fields(self) -> tuple[FlatList | None, ...]:
        return (self.ids, self.offsets, self.logprobs, self.bitmask, self.bitmask_positions)


def kept_from_series(columns: Mapping[str, pl.Series]) -> KeptColumns | None:
    """The kept-set columns among `columns` (name -> polars list series), flattened; None without ids and
    offsets (a run that records no K)."""
    if KEPT_IDS not in columns or KEPT_OFFSETS not in columns:
        return None

    def flat(name: str) -> FlatList | None:
        series = columns.get(name)
        if series is None:
            return None
        if isinstance(series.dtype, pl.Array):
            series = series.cast(pl.List(series.dtype.inner))
        return flat_list(series)

    ids, offsets = flat(KEPT_IDS), flat(KEPT_OFFSETS)
    assert ids is not None and offsets is not None
    return KeptColumns(ids, offsets, flat(KEPT_LOGPROBS), flat(KEPT_BITMASK), flat(KEPT_BITMASK_POSITIONS))


def take_rows(flat: FlatList, keep: np.ndarray) -> FlatList:
    """The rows `keep` of one flat list column, re-flattened."""
    keep = np.asarray(keep, dtype=np.int64)
    lengths = flat.lengths[keep]
    offsets = np.zeros(keep.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    take = np.repeat(flat.offsets[:-1][keep] - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    return FlatList(
        offsets,
        flat.values[take],
        None if flat.valid is None else flat.valid[take],
        None if flat.row_valid is None else flat.row_valid[keep],
    )


def _within_row_diff(flat: FlatList) -> tuple[np.ndarray, np.ndarray]:
    """(D,) consecutive differences of the values inside each row, and (D,) the flat index of the later value."""
    values = flat.values.astype(np.int64, copy=False)
    if values.size < 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    later = np.arange(1, values.size, dtype=np.int64)
    inside = np.ones(values.size - 1, dtype=bool)
    starts = flat.offsets[1:-1]
    inside[starts[(starts > 0) & (starts < values.size)] - 1] = (
        False  # a row's first value has no predecessor
    )
    return np.diff(values)[inside], later[inside]


def offsets_sound(kept: KeptColumns, seq_lengths: np.ndarray) -> np.ndarray:
    """(R,) bool: the row's offsets have T + 1 values, start at 0, end at len(ids) and never decrease; or the
    row records no set at all (offsets and ids both empty or null: "not recorded" at every position)."""
    offsets, ids = kept.offsets, kept.ids
    n_rows = seq_lengths.shape[0]
    unrecorded = (offsets.lengths == 0) & (ids.lengths == 0)
    ok = offsets.lengths == seq_lengths + 1
    nonempty = offsets.lengths > 0
    first = np.full(n_rows, -1, dtype=np.int64)
    last = np.full(n_rows, -1, dtype=np.int64)
    values = offsets.values.astype(np.int64, copy=False)
    first[nonempty] = values[offsets.offsets[:-1][nonempty]]
    last[nonempty] = values[offsets.offsets[1:][nonempty] - 1]
    ok &= (first == 0) & (last == ids.lengths)
    diff, later = _within_row_diff(offsets)
    if (diff < 0).any():
        rows = row_of(offsets.offsets, later[diff < 0])
        ok[rows] = False
    if offsets.valid is not None or offsets.row_valid is not None:
        bad = np.zeros(n_rows, dtype=bool)
        if offsets.valid is not None:
            bad_index = np.flatnonzero(~offsets.valid)
            bad[row_of(offsets.offsets, bad_index)] = True
        ok &= ~bad
    return ok | unrecorded


def _bitmask_width(kept: KeptColumns) -> np.ndarray | None:
    """(R,) bytes per bitmask of each row (-1 where the row's bitmask length is not a multiple of its positions)."""
    if kept.bitmask is None or kept.bitmask_positions is None:
        return None
    n_pos = kept.bitmask_positions.lengths
    n_bytes = kept.bitmask.lengths
    width = np.where(n_pos > 0, n_bytes // np.maximum(n_pos, 1), 0)
    width[(n_pos > 0) & (width * n_pos != n_bytes)] = -1
    width[(n_pos == 0) & (n_bytes > 0)] = -1
    return width


def id_sizes(kept: KeptColumns, seq_offsets: np.ndarray) -> np.ndarray:
    """(N,) int64 number of kept ids (the CSR form only) at every flat token position (rows delimited by
    `seq_offsets` (R + 1,)); rows whose offsets are not sound (`offsets_sound`) count 0 everywhere."""
    seq_lengths = np.diff(seq_offsets)
    sound = offsets_sound(kept, seq_lengths)
    sizes = np.zeros(int(seq_offsets[-1]), dtype=np.int64)
    rows = np.flatnonzero(sound & (kept.offsets.lengths > 0))  # rows that record sets (others: all 0)
    if rows.size:
        flat = take_rows(kept.offsets, rows)
        diff, _ = _within_row_diff(flat)
        token_index = np.repeat(seq_offsets[:-1][rows], seq_lengths[rows])
        token_index = token_index + _ramp(seq_lengths[rows])
        sizes[token_index] = diff
    return sizes


def position_sizes(kept: KeptColumns, seq_offsets: np.ndarray) -> np.ndarray:
    """(N,) int64 size of the kept set at every flat token position (rows delimited by `seq_offsets` (R + 1,)),
    ids or bitmask; 0 = not recorded. Rows whose offsets are not sound (`offsets_sound`) count 0 everywhere."""
    seq_lengths = np.diff(seq_offsets)
    sound = offsets_sound(kept, seq_lengths)
    sizes = id_sizes(kept, seq_offsets)
    width = _bitmask_width(kept)
    if width is not None and kept.bitmask_positions is not None and kept.bitmask is not None:
        width = np.where(sound, width, 0)
        b_rows, b_pos, b_start = _bitmask_entries(kept, width)
        inside = (b_pos >= 0) & (b_pos < seq_lengths[b_rows])
        for each in np.unique(width[b_rows[inside]]).tolist():  # one width a run, as a rule
            sel = inside & (width[b_rows] == each)
            sizes[seq_offsets[b_rows[sel]] + b_pos[sel]] = bitmask_sizes(
                _gather_bitmasks(kept, b_start[sel], each)
            )
    return sizes


def _ramp(lengths: np.ndarray) -> np.ndarray:
    """0..len-1 for each length, concatenated."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts


def bitmask_ids(bits: np.ndarray) -> np.ndarray:
    """(K,) int64 token ids set in a packed little-endian bitmask (bit j of byte b is token 8 b + j)."""
    return np.flatnonzero(np.unpackbits(bits.astype(np.uint8, copy=False), bitorder="little")).astype(
        np.int64
    )


def pack_bitmask(token_ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """The packed little-endian bitmask of `token_ids` over a vocabulary of `vocab_size`: ceil(V / 8) uint8."""
    bits = np.zeros(vocab_size, dtype=np.uint8)
    bits[np.asarray(token_ids, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little")


UNPACK_CHUNK_BYTES = 64 << 20  # the (rows, 8 B) unpacked bits of one expansion chunk


def bitmask_sets(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids of Q packed little-endian bitmasks at once: bits (Q, B) uint8 -> ((E,) int64 ids, ascending
    within a row; (Q + 1,) int64 CSR offsets). Equal to `bitmask_ids` row by row, without a Python loop per
    bitmask: rows are unpacked together (chunks of `UNPACK_CHUNK_BYTES` of unpacked bits) and their set bits
    found by one `nonzero` a chunk."""
    bits = np.ascontiguousarray(bits, dtype=np.uint8)
    n_rows, width = bits.shape
    step = max(1, UNPACK_CHUNK_BYTES // max(8 * width, 1))
    ids: list[np.ndarray] = []
    sizes = np.zeros(n_rows, dtype=np.int64)
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        unpacked = np.unpackbits(bits[start:stop].reshape(-1), bitorder="little").view(bool)  # (rows * 8 B,)
        where = np.flatnonzero(unpacked)  # row-major: ids ascending within a row
        rows = where // (8 * width)
        ids.append(where - rows * (8 * width))
        sizes[start:stop] = np.bincount(rows, minlength=stop - start)
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return (np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)), offsets


def bitmask_sizes(bits: np.ndarray) -> np.ndarray:
    """(Q,) int64 number of set bits of each of Q packed bitmasks (Q, B), by a 256-entry popcount table."""
    table = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1).astype(np.uint8)
    return table[np.asarray(bits, dtype=np.uint8)].sum(axis=1, dtype=np.int64)


def _bitmask_entries(kept: KeptColumns, width: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every position stored as a bitmask: ((P,) row, (P,) position, (P,) start of its bytes in
    ``kept.bitmask.values``), rows ascending and positions ascending within a row (rows with width > 0)."""
    assert kept.bitmask_positions is not None and kept.bitmask is not None
    positions = kept.bitmask_positions
    n_pos = np.where(width > 0, positions.lengths, 0)
    rows = np.repeat(np.arange(n_pos.size, dtype=np.int64), n_pos)
    k = _ramp(n_pos)
    take = positions.offsets[:-1][rows] + k
    pos = positions.values[take].astype(np.int64)
    start = kept.bitmask.offsets[:-1][rows] + k * width[rows]
    return rows, pos, start


def _gather_bitmasks(kept: KeptColumns, start: np.ndarray, width: int) -> np.ndarray:
    """(P, width) uint8: the bitmasks whose bytes start at `start` (P,)."""
    assert kept.bitmask is not None
    index = start[:, None] + np.arange(width, dtype=np.int64)[None, :]
    return kept.bitmask.values[index].astype(np.uint8, copy=False)


def _match_bitmask(
    kept: KeptColumns, width: np.ndarray, rows: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For queries (Q,) at (row, pos): ((Q,) bool stored as a bitmask, (Q,) start of its bytes or -1)."""
    b_rows, b_pos, b_start = _bitmask_entries(kept, width)
    found = np.zeros(rows.size, dtype=bool)
    start = np.full(rows.size, -1, dtype=np.int64)
    if not b_rows.size or not rows.size:
        return found, start
    span = int(max(b_pos.max(initial=0), pos.max(initial=0))) + 2
    b_key = b_rows * span + (b_pos + 1)
    order = np.argsort(b_key, kind="stable")
    b_key, b_start = b_key[order], b_start[order]
    key = rows * span + (pos + 1)
    at = np.minimum(np.searchsorted(b_key, key), b_key.size - 1)
    found = (b_key[at] == key) & (pos >= 0)
    start = np.where(found, b_start[at], -1)
    return found, start


@dataclass(frozen=True)
class PositionSets:
    """The kept sets of Q token positions in CSR form, with the engine's log-probs of each kept id when the run
    records them (NaN for ids expanded from a bitmask, which carries none)."""

    ids: np.ndarray  # (E,) int64
    offsets: np.ndarray  # (Q + 1,) int64
    logprobs: np.ndarray | None  # (E,) float32, or None without sampling_kept_logprobs
    bitmask_queries: np.ndarray | None = None  # (Q_b,) int64 queries left packed (their CSR sets are empty)
    bitmasks: np.ndarray | None = None  # (Q_b, B) uint8 their packed bitmasks


def position_sets(
    kept: KeptColumns, seq_offsets: np.ndarray, tokens: np.ndarray, *, expand_bitmasks: bool = True
) -> PositionSets:
    """The kept sets of the flat token positions `tokens` (Q,) (`PositionSets`).

    Bitmask positions are expanded to ids here (`bitmask_sets`, all at once; memory: bounded by the piece the
    caller read), or with `expand_bitmasks` False handed back packed (`PositionSets.bitmasks`, their sets
    empty in the CSR) for the LM head to read as bits on its device (`kernels.kept_set.KeptSet`). Rows must
    have sound offsets (validated by the reader)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = row_of(seq_offsets, tokens)
    pos = tokens - seq_offsets[rows]
    off_values = kept.offsets.values.astype(np.int64, copy=False)
    recorded = kept.offsets.lengths[rows] > 0  # a row without offsets records no set anywhere
    base = np.where(recorded, kept.offsets.offsets[rows] + pos, 0)
    lo = np.where(recorded, off_values[base] if off_values.size else 0, 0) + kept.ids.offsets[rows]
    hi = np.where(
        recorded, off_values[np.minimum(base + 1, max(off_values.size - 1, 0))] if off_values.size else 0, 0
    )
    hi = np.where(recorded, hi + kept.ids.offsets[rows], lo)
    sizes = hi - lo
    width = _bitmask_width(kept)
    packed_queries = np.zeros(0, dtype=np.int64)
    groups: list[tuple[np.ndarray, np.ndarray]] = []  # (queries, (Q_b, B) bitmasks) a width
    if width is not None and kept.bitmask_positions is not None:
        found, start = _match_bitmask(kept, np.maximum(width, 0), rows, pos)
        found &= sizes == 0
        for each in np.unique(width[rows[found]]).tolist():
            queries = np.flatnonzero(found & (width[rows] == each))
            groups.append((queries, _gather_bitmasks(kept, start[queries], each)))
    if not expand_bitmasks and len(groups) == 1:
        packed_queries, packed = groups[0]
        groups = []
    expanded: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for queries, bits in groups:
        ids, set_offsets = bitmask_sets(bits)
        sizes[queries] = np.diff(set_offsets)
        expanded.append((queries, ids, np.diff(set_offsets)))
    offsets = np.zeros(tokens.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    ids_values = kept.ids.values.astype(np.int64, copy=False)
    gather = np.repeat(lo - offsets[:-1], sizes) + np.arange(offsets[-1], dtype=np.int64)
    out = np.empty(int(offsets[-1]), dtype=np.int64)
    plain = np.ones(tokens.size, dtype=bool)
    for queries, ids, counts in expanded:
        plain[queries] = False
        out[np.repeat(offsets[queries], counts) + _ramp(counts)] = ids
    plain_elements = np.repeat(plain, sizes)
    out[plain_elements] = ids_values[gather[plain_elements]]
    logprobs = None
    if kept.logprobs is not None:
        logprobs = np.full(out.shape[0], np.nan, dtype=np.float32)
        source = kept.logprobs.values.astype(np.float32, copy=False)
        logprobs[plain_elements] = source[gather[plain_elements]]
        if kept.logprobs.valid is not None:
            logprobs[plain_elements] = np.where(
                kept.logprobs.valid[gather[plain_elements]], logprobs[plain_elements], np.nan
            )
    if packed_queries.size:
        return PositionSets(out, offsets, logprobs, packed_queries, packed)
    return PositionSets(out, offsets, logprobs)


IssueMaker = Callable[..., object]


def kept_issues(
    kept: KeptColumns,
    input_ids: FlatList,
    *,
    issue: IssueMaker,
    on: Callable[[str], bool],
    vocab_size: int | None,
    max_examples: int,
) -> list:
    """E220-E223 (and E201 for misaligned kept log-probs) on the kept-set columns of structurally sound rows.

    `issue(code, severity, text, rows, count, pos=..., notes=..., hint=...)` makes one located issue (the
    validator's locator); `on(code)` says whether a rule runs. Rules after E220 skip rows whose offsets are
    not sound."""
    found: list = []
    seq_lengths = input_ids.lengths
    sound = offsets_sound(kept, seq_lengths)
    width = _bitmask_width(kept)
    if on(Code.KEPT_OFFSETS_BROKEN):
        bad = np.flatnonzero(~sound)
        notes = [
            f"{kept.offsets.lengths[r]} offsets for {seq_lengths[r]} tokens, ids {kept.ids.lengths[r]}"
            for r in bad[:max_examples]
        ]
        if bad.size:
            found.append(
                issue(
                    Code.KEPT_OFFSETS_BROKEN,
                    "error",
                    f"{KEPT_OFFSETS}: not T + 1 offsets from 0 to len({KEPT_IDS}) never decreasing",
                    bad,
                    bad.size,
                    notes=notes,
                    hint="CSR offsets of the kept sets: one per position plus one, starting at 0",
                )
            )
        if width is not None and (width < 0).any():
            rows = np.flatnonzero(width < 0)
            found.append(
                issue(
                    Code.KEPT_OFFSETS_BROKEN,
                    "error",
                    f"{KEPT_BITMASK}: length not a multiple of its {KEPT_BITMASK_POSITIONS}",
                    rows,
                    rows.size,
                )
            )
    if kept.logprobs is not None and on(Code.LENGTH_MISMATCH):
        wrong = np.flatnonzero(kept.logprobs.lengths != kept.ids.lengths)
        if wrong.size:
            found.append(
                issue(
                    Code.LENGTH_MISMATCH,
                    "error",
                    f"{KEPT_LOGPROBS}: length differs from {KEPT_IDS}",
                    wrong,
                    wrong.size,
                )
            )
    rows = np.flatnonzero(sound)
    if not rows.size:
        return found
    sub = kept.take(rows)
    sub_ids = take_rows(input_ids, rows)
    ids = sub.ids.values.astype(np.int64, copy=False)
    element_row = np.repeat(np.arange(rows.size, dtype=np.int64), sub.ids.lengths)  # (E,)
    n_ids = id_sizes(sub, sub_ids.offsets)  # (N,) kept ids per flat token position
    sizes = position_sizes(sub, sub_ids.offsets) if width is not None else n_ids  # ids or bitmask
    element_token = np.repeat(np.arange(n_ids.size, dtype=np.int64), n_ids)  # (E,) flat token position
    element_pos = element_token - sub_ids.offsets[element_row]
    if on(Code.KEPT_OUT_OF_VOCAB):
        bad = ids < 0
        if vocab_size is not None:
            bad |= ids >= vocab_size
        if sub.ids.valid is not None:
            bad |= ~sub.ids.valid  # a null id
        where = np.flatnonzero(bad)
        if where.size:
            limit = f" or >= vocab_size {vocab_size}" if vocab_size is not None else ""
            found.append(
                issue(
                    Code.KEPT_OUT_OF_VOCAB,
                    "error",
                    f"{KEPT_IDS}: kept token id < 0{limit}",
                    rows[element_row[where]],
                    where.size,
                    pos=element_pos[where],
                    notes=[f"id {ids[e]}" for e in where[:max_examples]],
                )
            )
    if on(Code.KEPT_DUPLICATE) and ids.size:
        order = np.lexsort((ids, element_token))
        same = (ids[order][1:] == ids[order][:-1]) & (element_token[order][1:] == element_token[order][:-1])
        where = np.unique(element_token[order][1:][same])
        if where.size:
            owner = row_of(sub_ids.offsets, where)
            found.append(
                issue(
                    Code.KEPT_DUPLICATE,
                    "error",
                    f"{KEPT_IDS}: a token id twice in one kept set",
                    rows[owner],
                    where.size,
                    pos=where - sub_ids.offsets[owner],
                )
            )
    if on(Code.SAMPLED_OUTSIDE_KEPT):
        token_values = sub_ids.values.astype(np.int64, copy=False)
        hit = ids == token_values[element_token]
        found_in_set = np.bincount(element_token[hit], minlength=sizes.size) > 0
        outside = np.flatnonzero((sizes > 0) & ~found_in_set)
        if width is not None:
            outside = _outside_bitmask(sub, sub_ids, width[rows], outside)
        if outside.size:
            owner = row_of(sub_ids.offsets, outside)
            found.append(
                issue(
                    Code.SAMPLED_OUTSIDE_KEPT,
                    "error",
                    "input_ids: the sampled token is not in its kept set",
                    rows[owner],
                    outside.size,
                    pos=outside - sub_ids.offsets[owner],
                    notes=[f"token {token_values[t]}" for t in outside[:max_examples]],
                    hint=f"{KEPT_IDS} aligned with another position? (the set of position p holds input_ids[p])",
                )
            )
    return found


def _outside_bitmask(
    sub: KeptColumns, sub_ids: FlatList, width: np.ndarray, outside: np.ndarray
) -> np.ndarray:
    """`outside` without the positions stored as bitmasks whose bit of the sampled token is set."""
    assert sub.bitmask is not None
    if not outside.size:
        return outside
    rows = row_of(sub_ids.offsets, outside)
    pos = outside - sub_ids.offsets[rows]
    found, start = _match_bitmask(sub, np.maximum(width, 0), rows, pos)
    sampled = sub_ids.values[outside].astype(np.int64)
    inside = found & (sampled >= 0) & (sampled < 8 * np.maximum(width[rows], 0))
    byte = sub.bitmask.values[np.where(inside, start + sampled // 8, 0)].astype(np.int64)
    covered = inside & (((byte >> (sampled % 8)) & 1) == 1)
    return outside[~covered]
