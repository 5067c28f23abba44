"""The exploded token table of a comparison (`--tokens-out`, docs/compare.md).

What: one row per matched loss token: run, step, sample_id, pos, resp_pos, token_id, lp_a, lp_b, dlogp, ratio,
k3, abs_dlogp, prob_a, entropy. Why: users filter and plot tokens in a notebook without re-aligning the runs,
and the token plots (`plot_hexbin`, `plot_dlogp_hist`) redraw from it. How: columns are built from the aligned
arrays (no Python loop over tokens) and written atomically as zstd Parquet with 1,048,576-row groups: whole
(`write_token_table`), or piece by piece as `compare` reads the runs (`TokenTableWriter`: a temp file beside the
target, renamed over it only when the comparison finished, removed on any error).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

import numpy as np
import polars as pl
import pyarrow as pa

from pgdiag.compare.align import AlignedPair
from pgdiag.errors import Code, UsageError

TOKEN_TABLE_SCHEMA_ID = "pgdiag.compare-tokens/v1"


ROW_GROUP_ROWS = 1_048_576  # rows per row group of the token table


def token_frame(pair: AlignedPair, start: int = 0, stop: int | None = None) -> pl.DataFrame:
    """The token table of `pair` as a polars frame: its matched tokens `start` to `stop` (default all)."""
    stop = pair.n_tokens if stop is None else stop
    part = slice(start, stop)
    n = stop - start
    sample = pair.token_sample()[part]  # (n,)
    d = pair.delta[part]
    lp_a = pair.lp_a[part]
    with np.errstate(over="ignore"):
        ratio = np.exp(d)
        k3 = np.expm1(d) - d
    sample_ids = pl.Series("sample_id", [str(s) for s in pair.sample_id], dtype=pl.String)
    return pl.DataFrame(
        {
            "pair": pl.repeat(pair.pair, n, eager=True, dtype=pl.String),
            "run": pl.repeat(pair.label_a, n, eager=True, dtype=pl.String),
            "step": pair.step[sample],
            "sample_id": sample_ids.gather(sample),
            "pos": pair.pos[part].astype(np.int64),
            "resp_pos": pair.resp_pos[part].astype(np.int64),
            "token_id": pair.token_id[part].astype(np.int64),
            "lp_a": lp_a,
            "lp_b": pair.lp_b[part],
            "dlogp": d,
            "ratio": ratio,
            "k3": k3,
            "abs_dlogp": np.abs(d),
            "prob_a": np.exp(lp_a),
            "entropy": pair.entropy[part] if pair.entropy is not None else np.full(n, np.nan),
        }
    ).with_columns(pl.col("entropy").fill_nan(None))


def check_token_path(path: str | Path, *, overwrite: bool) -> Path:
    """`path` as a token table destination: E503 unless it ends in .parquet, E502 when it exists (no
    `overwrite`)."""
    path = Path(path)
    if path.suffix != ".parquet":
        raise UsageError(Code.BAD_OPTION_VALUE, f"--tokens-out {path}: give a .parquet file name")
    if path.exists() and not overwrite:
        raise UsageError(Code.OUTPUT_EXISTS, f"{path} exists", "pass --overwrite to replace it")
    return path


def write_token_table(pair: AlignedPair, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write the token table of `pair` to `path` (a .parquet file) atomically."""
    from pgdiag.data.writing import write_parquet

    path = check_token_path(path, overwrite=overwrite)
    return write_parquet(
        token_frame(pair),
        path,
        metadata={"pgdiag.schema": TOKEN_TABLE_SCHEMA_ID},
        row_group_rows=ROW_GROUP_ROWS,
    )


class TokenTableWriter:
    """The token table written piece by piece: `add(pair)` appends a piece's matched tokens, `commit()` renames
    the temp file over `path`; `abort()` (or leaving a `with` block on an exception) removes it.

    The file equals `write_token_table` of the pieces' tokens concatenated: same columns, types, footer, zstd
    level and statistics, and row groups of exactly 1,048,576 rows but the last (at most one group of rows is
    held in memory). The temp file is ``.<name>.tmp-<pid>-<random>`` beside `path`, as `atomic_write`'s.
    """

    def __init__(self, path: str | Path, *, overwrite: bool = False) -> None:
        from pgdiag.atomic_files import temp_path

        self.path = check_token_path(path, overwrite=overwrite)
        self.tmp = temp_path(self.path)
        self.n_rows = 0
        self._writer = None  # pyarrow.parquet.ParquetWriter, opened with the first piece's schema
        self._held: list[pa.Table] = []  # rows of the row group being filled
        self._held_rows = 0

    def __enter__(self) -> TokenTableWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self.abort()

    def add(self, pair: AlignedPair) -> None:
        """Append the matched tokens of one piece, in its order, one row group's worth at a time."""
        start = 0
        while start < pair.n_tokens or self._writer is None:
            stop = min(pair.n_tokens, start + ROW_GROUP_ROWS - self._held_rows)
            self._hold(token_frame(pair, start, stop).to_arrow())
            start = stop
            if pair.n_tokens == 0:
                break

    def _hold(self, table: pa.Table) -> None:
        if self._writer is None:
            self._open(table.schema)
        self._held.append(table)
        self._held_rows += table.num_rows
        self.n_rows += table.num_rows
        if self._held_rows >= ROW_GROUP_ROWS:
            self._flush()

    def _open(self, schema: pa.Schema) -> None:
        import pyarrow.parquet as pq

        from pgdiag.data.schema import encode_footer
        from pgdiag.data.writing import ZSTD_LEVEL

        existing = dict(schema.metadata or {})
        existing.pop(b"pandas", None)
        schema = schema.with_metadata({**existing, **encode_footer({"pgdiag.schema": TOKEN_TABLE_SCHEMA_ID})})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(
            self.tmp,
            schema,
            compression="zstd",
            compression_level=ZSTD_LEVEL,
            write_statistics=True,
            use_dictionary=[f.name for f in schema if not pa.types.is_list(f.type)],
        )

    def _flush(self) -> None:
        if not self._held:
            return
        assert self._writer is not None
        table = pa.concat_tables(self._held)  # chunks side by side, no copy
        self._held, self._held_rows = [], 0
        if not table.schema.equals(self._writer.schema):  # types only; the footer is the writer's
            table = table.cast(self._writer.schema)
        self._writer.write_table(table, row_group_size=ROW_GROUP_ROWS)

    def commit(self) -> Path:
        """Write the last row group, close, fsync and rename the temp file over `path`; returns `path`."""
        from pgdiag.atomic_files import replace_with

        if self._writer is None:
            raise ValueError("TokenTableWriter.commit needs at least one add (a piece without tokens is one)")
        try:
            self._flush()
            self._writer.close()
            self._writer = None
            replace_with(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Close and remove the temp file (nothing half-written is left)."""
        if self._writer is not None:
            try:
                self._writer.close()
            finally:
                self._writer = None
        self._held, self._held_rows = [], 0
        self.tmp.unlink(missing_ok=True)
