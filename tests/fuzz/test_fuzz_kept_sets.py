"""Hypothesis-driven kept-set columns (docs/schema.md, "Kept sets"; docs/reliability.md).

Each example gives the valid rows random ``sampling_kept_ids`` / ``sampling_kept_offsets`` (and sometimes kept
log-probs, bitmasks, a null row, another list type): sound sets that hold the sampled token, or broken ones
(offsets decreasing, too few or too many, not ending at len(ids); the sampled token missing; an id < 0 or a
duplicate). A plain-Python reference judges each example; the reader must agree: no E220-E223 for a sound
example, the reference's code among the errors of a broken one. Every command keeps the clean-error contract.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from clean_error import error_code, files_under, run_cli
from hypothesis import Phase, given
from hypothesis import strategies as st
from rollout_factory import valid_rows, write_rollouts_file
from test_fuzz_inputs import fuzz_settings

import pgdiag
from pgdiag.errors import PgdiagError

KEPT_CODES = ("E220", "E221", "E222", "E223")


@st.composite
def kept_row(draw: st.DrawFn, ids: list[int]) -> dict:
    """Sets for one sample of len(ids) tokens, and the code the reference expects (None = sound)."""
    n = len(ids)
    sets: list[list[int]] = []
    for pos in range(n):
        if pos < 2 or (draw(st.booleans()) and draw(st.booleans())):
            sets.append([])  # prompt, or not recorded
            continue
        others = draw(st.lists(st.integers(0, 40), max_size=5, unique=True))
        sets.append(list(dict.fromkeys([ids[pos], *others])))
    breakage = draw(
        st.sampled_from([None, None, None, "order", "short", "long", "end", "missing", "negative", "dup"])
    )
    expected = None
    flat = [t for s in sets for t in s]
    offsets = [0]
    for s in sets:
        offsets.append(offsets[-1] + len(s))
    recorded = [p for p in range(n) if sets[p]]
    if breakage == "order" and len(offsets) > 3:
        offsets[2], offsets[3] = offsets[3] + 1, offsets[2]
        expected = "E220"
    elif breakage == "short":
        offsets = offsets[:-1]
        expected = "E220"
    elif breakage == "long":
        offsets = [*offsets, offsets[-1]]
        expected = "E220"
    elif breakage == "end":
        offsets[-1] += 1
        expected = "E220"
    elif breakage == "missing" and recorded:
        p = recorded[0]
        start = offsets[p]
        flat[start] = 41 if ids[p] != 41 else 42  # the sampled token replaced by one outside the set
        expected = "E221" if flat[start] not in flat[start + 1 : offsets[p + 1]] else "E223"
    elif breakage == "negative" and flat:
        flat[-1] = -1 - draw(st.integers(0, 5))
        expected = "E222"
        if recorded and offsets[recorded[-1]] == len(flat) - 1:
            expected = "E221"  # the one id of a one-token set was the sampled token: also E221 (E221 < E222)
    elif breakage == "dup" and recorded:
        p = recorded[-1]
        flat.insert(offsets[p + 1], ids[p])
        offsets = [o + (1 if i > p else 0) for i, o in enumerate(offsets)]
        expected = "E223"
    return {"sampling_kept_ids": flat, "sampling_kept_offsets": offsets, "expected": expected}


def _write(tmp: Path, rows: list[dict], dtype: pl.DataType) -> Path:
    return write_rollouts_file(
        tmp / "run.parquet",
        rows,
        raw_types={"sampling_kept_ids": dtype, "sampling_kept_offsets": pl.List(pl.Int32)},
        sampling={"engine": "vllm", "logprobs_mode": "processed", "top_p": 0.9},
    )


def test_kept_columns_of_any_shape(tmp_path: Path, fuzz_examples: int) -> None:
    base = valid_rows()

    # no shrinking: every example runs two commands, and a shrunk case is no clearer than the drawn one
    @fuzz_settings(fuzz_examples * 5).__class__(
        parent=fuzz_settings(fuzz_examples * 5), phases=[Phase.explicit, Phase.reuse, Phase.generate]
    )
    @given(data=st.data(), wide=st.booleans())
    def case(data: st.DataObject, wide: bool) -> None:
        rows, expected = [], []
        for row in base:
            kept = data.draw(kept_row(row["input_ids"]))
            expected.append(kept.pop("expected"))
            rows.append({**row, **kept})
        dtype = pl.List(pl.Int64) if wide else pl.List(pl.Int32)  # int64 ids read losslessly
        run = _write(tmp_path, rows, dtype)
        result = pgdiag.check_run(pgdiag.read_run(run))
        codes = set(result.issues.filter(pl.col("severity") == "error")["code"].to_list())
        wanted = {c for c in expected if c is not None}
        if not wanted:
            assert not codes & set(KEPT_CODES), result.issues
        else:
            assert codes & wanted, (expected, result.issues)
        check = run_cli(["check", run])  # lists every broken rule, each with its hint
        assert "Traceback" not in check.output and "internal error" not in check.output, check.output
        assert check.exit_code == (3 if codes else 0) or (not codes and check.exit_code == 1), check.output
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        metrics = run_cli(["metrics", run, "--new", "old", "--old", "rollout", "--out", out])
        if metrics.exit_code in (0, 1):
            assert not wanted, metrics.output
        else:
            assert error_code(metrics) in {*KEPT_CODES, *codes}, metrics.output
            assert files_under(out) == set(), metrics.output

    case()


def test_kept_columns_of_another_type_are_e103(tmp_path: Path) -> None:
    for dtype, value in ((pl.List(pl.Float64), [1.5]), (pl.List(pl.String), ["a"]), (pl.String, "1,2")):
        rows = [{**r, "sampling_kept_ids": value, "sampling_kept_offsets": []} for r in valid_rows()]
        run = _write(tmp_path, rows, dtype)
        try:
            batch = pgdiag.read_token_batch(pgdiag.read_run(run), streams=["rollout"])
        except PgdiagError as error:
            assert error.code == "E103", error
        else:
            raise AssertionError(f"{dtype}: read without E103 ({batch})")


def test_null_rows_mean_not_recorded(tmp_path: Path) -> None:
    rows = [{**r, "sampling_kept_ids": None, "sampling_kept_offsets": None} for r in valid_rows()]
    run = _write(tmp_path, rows, pl.List(pl.Int32))
    result = pgdiag.check_run(pgdiag.read_run(run))
    assert not set(result.issues["code"].to_list()) & set(KEPT_CODES), result.issues
