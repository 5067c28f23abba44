"""The token budget of `pgdiag explain`: whole samples, stratified by step, written as a run of their own.

What: `select_samples(run, budget, seed)` picks whole samples so that every step gets an equal share of the
`budget` loss tokens (samples shuffled with `seed` within each step, taken until the step's share is reached;
a step with fewer tokens gives all it has). `write_token_run` writes those rows, every column and the footer
kept, as a canonical run directory (`OUT/tokens/`), so the recompute matrix writes its tags beside them and
``pgdiag compare OUT/tokens --stream-a ex_ref --stream-b ex_bf16`` works afterwards.
Why a copy: the recompute machinery (parts, manifests, resume) works on runs; a budget of 200k tokens is a small
copy, and the user's run directory is never written to.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from pgdiag.data.runs import Run
from pgdiag.data.schema import BASE_STREAMS, stream_column
from pgdiag.data.writing import source_meta, write_rollouts
from pgdiag.errors import Code, InvalidInputError, UsageError

KEYS = ("step", "sample_id", "segment_idx")


@dataclass(frozen=True)
class TokenSelection:
    """The samples the budget took: their keys, and loss tokens taken and available per step."""

    keys: pl.DataFrame  # step, sample_id, segment_idx of the chosen samples
    tokens_per_step: dict[int, tuple[int, int]]  # step -> (loss tokens taken, loss tokens in the run)
    forwarded: int = 0  # prompt + response tokens of the chosen samples (what each forward processes)

    @property
    def n_tokens(self) -> int:
        return sum(taken for taken, _ in self.tokens_per_step.values())


def select_samples(run: Run, budget: int, seed: int = 0) -> TokenSelection:
    """Whole samples holding about `budget` loss tokens, an equal share per step (module docstring)."""
    columns = run.lazy.collect_schema().names()
    keys = [k for k in KEYS if k in columns]
    frame = run.lazy.select(
        *keys, pl.col("loss_mask").list.sum().alias("n_loss"), pl.col("input_ids").list.len().alias("n_ids")
    ).collect()
    if frame.height == 0:
        raise InvalidInputError(Code.NO_LOSS_TOKENS, f"{run.label}: the selection has no samples")
    steps = sorted(int(s) for s in frame["step"].unique().to_list())
    share = max(1, budget // len(steps))
    rng = np.random.default_rng(seed)
    chosen: list[pl.DataFrame] = []
    per_step: dict[int, tuple[int, int]] = {}
    for step in steps:
        rows = frame.filter(pl.col("step") == step)
        order = rng.permutation(rows.height)
        counts = rows["n_loss"].fill_null(0).to_numpy()[order]
        cumulative = np.cumsum(counts)
        take = int(np.searchsorted(cumulative, share) + 1)  # whole samples until the share is reached
        picked = rows[np.sort(order[:take])]
        chosen.append(picked)
        per_step[step] = (int(picked["n_loss"].fill_null(0).sum()), int(counts.sum()))
    picked_all = pl.concat(chosen)
    return TokenSelection(picked_all.select(keys), per_step, int(picked_all["n_ids"].fill_null(0).sum()))


def write_token_run(run: Run, selection: TokenSelection, out: Path, *, overwrite: bool = False) -> Path:
    """The chosen samples of `run` as a run directory at `out` (footer kept); returns `out`."""
    keys = [k for k in KEYS if k in selection.keys.columns]
    frame = run.lazy.join(selection.keys.lazy(), on=keys, how="semi").collect()
    meta = run.meta or {}
    streams_meta = {
        name: entry
        for name, entry in (meta.get("streams") or {}).items()
        if name in frame.columns or stream_column(name) in frame.columns
    }
    return write_rollouts(
        frame,
        out,
        label=run.label,
        source=meta.get("source") or source_meta("pgdiag explain"),
        streams_meta=streams_meta,
        sampling=meta.get("sampling"),
        tokenizer=meta.get("tokenizer"),
        model=meta.get("model"),
        created_by="pgdiag explain",
        overwrite=overwrite,
    )


def same_selection(run: Run, selection: TokenSelection, out: Path, pair: tuple[str, str]) -> None:
    """E502 unless the token run at `out` holds exactly the chosen samples of `run`: the same keys, token ids,
    loss masks and the pair's log-probs (a resume must not mix samples of two selections or two versions of a
    run)."""
    from pgdiag.data.runs import read_run

    keys = [k for k in KEYS if k in selection.keys.columns]
    columns = [*keys, "input_ids", "loss_mask", *(stream_column(s) for s in pair)]

    def rows(lazy: pl.LazyFrame) -> pl.DataFrame:
        frame = lazy.select([c for c in columns if c in lazy.collect_schema().names()]).collect()
        lists = [c for c in frame.columns if c.endswith("_logprobs")]
        return frame.with_columns(pl.col(lists).cast(pl.List(pl.Float64))).sort(keys)

    wanted = rows(run.lazy.join(selection.keys.lazy(), on=keys, how="semi"))
    try:
        held = rows(read_run(out).lazy)
    except (InvalidInputError, UsageError) as error:
        raise UsageError(
            Code.OUTPUT_EXISTS,
            f"{out} is not a readable token run ({error})",
            "pass --overwrite to replace it",
        ) from None
    if held.columns != wanted.columns or not held.equals(wanted):
        raise UsageError(
            Code.OUTPUT_EXISTS,
            f"{out} holds other samples than this run, --tokens and --seed choose (another budget, seed or run)",
            "pass --overwrite to replace it, or the --tokens and --seed of the interrupted call",
        )


def check_pair(run: Run, pair: tuple[str, str]) -> None:
    """E111 when a stream of `pair` is not a stored stream of `run` (explain compares stored streams)."""
    for stream in pair:
        if stream not in BASE_STREAMS:
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"--pair {','.join(pair)}: explain compares stored streams ({', '.join(BASE_STREAMS)}), "
                f"not {stream!r}",
                "compare a recompute tag with `pgdiag compare --stream-a/--stream-b`",
            )
        if stream not in run.streams:
            raise UsageError(
                Code.STREAM_NOT_FOUND,
                f"{run.label}: no stream {stream!r}; streams: {', '.join(run.streams) or 'none'}",
                "name two stored streams with --pair A,B",
            )
