"""Preset canonical and pgdiag.write_run: exact reproduction of sample runs, derived columns, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from sample_paths import SAMPLE_DATA

import pgdiag
from pgdiag.data.seqhash import seq_hash
from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.importers.base import ImportOptions
from tests.importers.conftest import assert_nothing_written


@pytest.mark.parametrize("run", ["run_a", "run_b", "synthetic_a", "synthetic_b"])
def test_canonical_reproduces_sample_runs(tmp_path, run):
    src = SAMPLE_DATA / run
    result = pgdiag.import_run("canonical", src, tmp_path / run)
    original = sorted((src / "rollouts").glob("step=*/part-*.parquet"))
    imported = sorted((tmp_path / run / "rollouts").glob("step=*/part-*.parquet"))
    assert [p.relative_to(src) for p in original] == [p.relative_to(tmp_path / run) for p in imported]
    for a, b in zip(original, imported, strict=True):
        ta, tb = pq.read_table(a), pq.read_table(b)
        assert ta.schema.equals(tb.schema, check_metadata=False)
        assert ta.equals(tb)
        meta_a, meta_b = dict(ta.schema.metadata), dict(tb.schema.metadata)
        assert json.loads(meta_b.pop(b"pgdiag.import")) == {
            "group_by": "auto",
            "ignored_codes": [],
            "shift": [],
        }
        assert meta_a == meta_b
    sidecar = json.loads((src / "pgdiag.json").read_text())
    assert (result.n_samples, result.n_tokens) == (sidecar["n_samples"], sidecar["n_tokens"])


def test_import_then_compare_has_zero_deltas(tmp_path):
    src = SAMPLE_DATA / "run_a"
    a = pgdiag.import_run("canonical", src, tmp_path / "a")
    b = pgdiag.import_run("canonical", src, tmp_path / "b")
    report = pgdiag.compare_runs(pgdiag.read_run(a.path), pgdiag.read_run(b.path)).report
    summary = report.summary.filter(
        (pl.col("breakdown") == "all")
        & pl.col("metric").is_in(["mismatch/abs_mean", "mismatch/rms", "mismatch/bias"])
    )
    assert summary.height >= 3 and summary["value"].to_list() == [0.0] * summary.height


def _frame() -> pl.DataFrame:
    # two prompts x two samples; prompt [5, 6] twice, [7] twice; token-aligned, values off the mask are junk
    return pl.DataFrame(
        {
            "step": [3, 3, 3, 3],
            "input_ids": [[5, 6, 10, 11], [5, 6, 12], [7, 13, 14], [7, 15]],
            "loss_mask": [
                [False, False, True, True],
                [False, False, True],
                [False, True, True],
                [False, True],
            ],
            "rollout_logprobs": [[0.0, 9.0, -0.5, -0.25], [0.0, 0.0, -1.0], [0.0, -0.1, -0.2], [0.0, -0.3]],
            "reward": [1.0, 0.0, 0.5, 0.5],
        }
    )


def test_write_run_derives_columns(tmp_path):
    result = pgdiag.write_run(_frame(), tmp_path / "mine", sampling={"temperature": 0.7, "tempered": False})
    assert (result.n_samples, result.n_tokens, result.n_loss_tokens) == (4, 12, 6)
    df = pl.read_parquet(tmp_path / "mine" / "rollouts" / "part-00000.parquet").sort("sample_id")
    assert df["sample_id"].to_list() == ["3:0", "3:1", "3:2", "3:3"]
    assert df["prompt_len"].to_list() == [2, 2, 1, 1]
    assert df["run"].cast(pl.String).to_list() == ["mine"] * 4
    groups = df["group_id"].to_list()
    assert groups[0] == groups[1] != groups[2] == groups[3] and groups[0].startswith("p")
    assert df["rollout_logprobs"].to_list()[0] == [None, None, -0.5, -0.25]  # masks, not values
    assert df["seq_hash"].to_list()[2] == seq_hash([7, 13, 14])
    meta = pgdiag.read_run(tmp_path / "mine").meta
    assert meta["sampling"]["temperature"] == 0.7 and meta["streams"]["rollout"]["tempered"] is False


def test_write_run_contiguous_groups_and_step(tmp_path):
    frame = _frame().drop("step")
    pgdiag.write_run(frame, tmp_path / "c", step=9, group_by="contiguous:2")
    df = pl.read_parquet(tmp_path / "c" / "rollouts" / "part-00000.parquet").sort("sample_id")
    assert df["group_id"].to_list() == ["c9:0", "c9:0", "c9:1", "c9:1"]
    assert df["step"].to_list() == [9] * 4


def test_response_aligned_and_next_token_lists(tmp_path):
    frame = pl.DataFrame(
        {
            "step": [0, 0],
            "tokens": [[5, 6, 10, 11], [7, 13, 14]],
            "prompt_len": [2, 1],
            "loss_mask": [[False, False, True, True], [False, True, True]],
            "behav": [[-0.5, -0.25], [-0.125, -0.375]],  # response-aligned
            "old_next": [[0.0, -0.75, -1.5], [-2.5, -0.0625]],  # next-token: element i scores token i + 1
        }
    )
    src = tmp_path / "rows.parquet"
    frame.write_parquet(src)
    options = ImportOptions(
        maps=(("tokens", "input_ids"), ("behav", "rollout_logprobs"), ("old_next", "old_logprobs")),
        shifts=(("old_logprobs", 1),),
    )
    pgdiag.import_run("canonical", src, tmp_path / "out", options=options)
    df = pl.read_parquet(tmp_path / "out" / "rollouts" / "part-00000.parquet").sort("sample_id")
    assert df["rollout_logprobs"].to_list() == [[None, None, -0.5, -0.25], [None, -0.125, -0.375]]
    assert df["old_logprobs"].to_list() == [
        [None, None, -0.75, -1.5],
        [None, -2.5, -0.0625],
    ]


def _jsonl(path: Path, rows: list[dict], *, torn: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text[:-1] if torn else text)
    return path


ROWS = [
    {
        "step": 1,
        "input_ids": [1, 2, 3],
        "loss_mask": [False, True, True],
        "rollout_logprobs": [None, -0.5, -0.7],
    },
    {"step": 1, "input_ids": [1, 4], "loss_mask": [False, True], "rollout_logprobs": [None, -0.9]},
]


def test_jsonl_imports(tmp_path):
    result = pgdiag.import_run("canonical", _jsonl(tmp_path / "r.jsonl", ROWS), tmp_path / "out")
    assert (result.n_samples, result.n_loss_tokens) == (2, 3)


def test_torn_jsonl_is_e703(tmp_path):
    src = _jsonl(tmp_path / "r.jsonl", ROWS, torn=True)
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("canonical", src, tmp_path / "out")
    assert err.value.code == "E703" and "r.jsonl" in err.value.message
    assert_nothing_written(tmp_path / "out")


def test_truncated_parquet_is_e703(tmp_path):
    src = tmp_path / "rows.parquet"
    pl.DataFrame(ROWS).write_parquet(src)
    src.write_bytes(src.read_bytes()[:-30])
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("canonical", src, tmp_path / "out")
    assert err.value.code == "E703"
    assert_nothing_written(tmp_path / "out")


def test_shifted_stream_is_refused(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[0]["rollout_logprobs"] = [-0.5, -0.7, None]  # one position early: null on the last loss position
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("canonical", _jsonl(tmp_path / "r.jsonl", rows), tmp_path / "out")
    assert err.value.code == "E204"
    assert_nothing_written(tmp_path / "out")


def test_zero_filled_stream_is_e206(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[0]["rollout_logprobs"] = [0.0, 0.0, 0.0]
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("canonical", _jsonl(tmp_path / "r.jsonl", rows), tmp_path / "out")
    assert err.value.code == "E206"
    assert_nothing_written(tmp_path / "out")


def test_error_on_a_later_step_writes_nothing(tmp_path):
    rows = [*ROWS, {**ROWS[0], "step": 2, "rollout_logprobs": [None, 0.5, -0.1]}]  # positive log-prob, step 2
    with pytest.raises(InvalidInputError) as err:
        pgdiag.import_run("canonical", _jsonl(tmp_path / "r.jsonl", rows), tmp_path / "out")
    assert err.value.code == "E205"
    assert_nothing_written(tmp_path / "out")


def test_existing_output_needs_overwrite(tmp_path):
    src = _jsonl(tmp_path / "r.jsonl", ROWS)
    pgdiag.import_run("canonical", src, tmp_path / "out")
    with pytest.raises(UsageError) as err:
        pgdiag.import_run("canonical", src, tmp_path / "out")
    assert err.value.code == "E502"
    result = pgdiag.import_run("canonical", src, tmp_path / "out", overwrite=True)
    assert result.n_samples == 2 and np.array(sorted(p.name for p in (tmp_path).iterdir())).tolist() == [
        "out",
        "r.jsonl",
    ]


def test_import_run_takes_options_as_keywords(tmp_path):
    src = _jsonl(tmp_path / "r.jsonl", ROWS)
    pgdiag.import_run("canonical", src, tmp_path / "out", temperature=0.6, label="kw")
    run = pgdiag.read_run(tmp_path / "out")
    assert run.meta["sampling"]["temperature"] == 0.6 and run.label == "kw"
    with pytest.raises(UsageError):
        pgdiag.import_run("canonical", src, tmp_path / "o2", tempreature=0.6)
