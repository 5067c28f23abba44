"""`compute_metrics --docs-per-step N` reading a run in chunks gives the numbers of a whole-run read.

The run is read in its read order (files in order, rows in file order), which here is not step order: files
hold their steps in shuffled order, one file mixes two steps row by row, documents have several segments
(consecutive rows sharing a sample_id), one document runs on from the last row of a file into the first row
of the next file (another real step), prompt groups straddle the cuts, and a recompute tag brings entropy. A
budget of one row per chunk reads one real step (or one span of interleaved steps) at a time; the whole-run
engine is `metrics_report` on the batch of one `read_token_batch`, the code that served `--docs-per-step`
before it streamed.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal
from rollout_factory import rollouts_frame, valid_rows, write_logprobs_part, write_rollouts_file

from pgdiag.data.load import read_token_batch
from pgdiag.data.pieces import read_order_chunks
from pgdiag.data.runs import read_run, row_keys
from pgdiag.data.seqhash import seq_hash
from pgdiag.data.validate import CheckSettings
from pgdiag.errors import InvalidInputError, PgdiagError
from pgdiag.metrics.api import (
    StreamSettings,
    compute_metrics,
    metric_streams,
    metrics_report,
    resolve_streams,
)
from pgdiag.metrics.docsteps import plan_doc_steps
from pgdiag.metrics.settings import MetricSettings

# file k holds these steps; a list of two steps is interleaved row by row in blocks of three
FILE_STEPS: list[list[int]] = [[4], [1], [10, 11], [0], [3], [2]]


def _sample(
    rng: np.random.Generator, step: int, sample_id: str, segment: int, group: str
) -> tuple[dict, dict]:
    n = int(rng.integers(4, 60))
    prompt = 2
    ids = rng.integers(10, 1000, n + prompt).tolist()
    old = -rng.exponential(1.0, n)
    new = np.minimum(old + rng.standard_t(3, n) * 0.05, -1e-4)
    rollout = np.minimum(old + rng.normal(0, 0.01, n), -1e-4)
    pad = [None] * prompt
    row = dict(
        step=step,
        sample_id=sample_id,
        segment_idx=segment,
        group_id=group,
        input_ids=ids,
        prompt_len=prompt,
        loss_mask=[False] * prompt + [True] * n,
        old_logprobs=pad + old.tolist(),
        new_logprobs=pad + new.tolist(),
        rollout_logprobs=pad + rollout.tolist(),
        advantages=pad + [float(rng.normal())] * n,
        reward=float(rng.integers(0, 2)),
    )
    part = dict(
        step=step,
        sample_id=sample_id,
        segment_idx=segment,
        seq_hash=seq_hash(ids),
        logprobs=pad + (old - 0.01).tolist(),
        entropy=pad + rng.exponential(1.0, n).tolist(),
    )
    return row, part


def _step_rows(rng: np.random.Generator, step: int) -> list[tuple[dict, dict]]:
    """12 to 30 rows of one step: groups of four samples, every fifth document in two segments."""
    out = []
    for i in range(int(rng.integers(12, 30))):
        group = f"g{step}_{i // 4}"
        for segment in range(2 if i % 5 == 0 else 1):
            out.append(_sample(rng, step, f"s{step}_{i}", segment, group))
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory):
    rng = np.random.default_rng(11)
    root = tmp_path_factory.mktemp("docs") / "run"
    tag_dir = root / "logprobs" / "rc"
    tag_dir.mkdir(parents=True)
    (tag_dir / "_manifest.json").write_text(json.dumps({"tag": "rc", "complete": True}))
    files = []
    for steps in FILE_STEPS:
        if len(steps) == 1:
            files.append(_step_rows(rng, steps[0]))
            continue
        a, b = (_step_rows(rng, s) for s in steps)
        mixed = []
        for k in range(0, max(len(a), len(b)), 3):
            mixed += a[k : k + 3] + b[k : k + 3]
        files.append(mixed)
    # the document "carry" runs on from the last row of file 0 (step 4) into the first row of file 1 (step 1)
    files[0].append(_sample(rng, FILE_STEPS[0][0], "carry", 0, "g_carry"))
    files[1].insert(0, _sample(rng, FILE_STEPS[1][0], "carry", 1, "g_carry"))
    for k, rows in enumerate(files):
        write_rollouts_file(root / "rollouts" / f"part-{k:05d}.parquet", [r for r, _ in rows])
        write_logprobs_part(tag_dir / f"part-{k:05d}.parquet", [p for _, p in rows])
    return root


def _whole(run, settings: MetricSettings, checks: CheckSettings = CheckSettings()) -> pl.DataFrame:
    """The report of the engine on one whole read (what `--docs-per-step` computed before it streamed)."""
    resolved = resolve_streams(run, settings)
    loaded = read_token_batch(
        run,
        streams=metric_streams(resolved),
        entropy=[resolved.entropy] if resolved.entropy else [],
        ignore=checks.ignore,
    )
    return metrics_report(loaded.batch, resolved, run=run).summary


def _value(summary: pl.DataFrame, bucket: str, metric: str) -> float:
    return summary.filter(pl.col("bucket") == bucket, pl.col("metric") == metric)["value"].item()


@pytest.mark.parametrize("docs_per_step", [1, 7, 23, 60])
def test_docs_per_step_in_tiny_chunks_equals_one_chunk_and_the_whole_read(
    run_dir, docs_per_step: int
) -> None:
    run = read_run(run_dir)
    settings = MetricSettings.from_options(
        new="new", old="old", entropy="rc", divisor=256.0, docs_per_step=docs_per_step
    )
    many = compute_metrics(run, settings, stream=StreamSettings(max_rows=1))
    one = compute_metrics(run, settings, stream=StreamSettings(max_rows=10**9))
    assert many.meta["chunks"] == len(FILE_STEPS) and one.meta["chunks"] == 1  # steps 10 and 11 share one
    assert many.meta["pooled_quantiles"]["exact"] is True
    # every row, the pooled `all` row included, is bit-identical to the whole read
    assert_frame_equal(many.summary, one.summary, check_exact=True)
    assert_frame_equal(many.summary, _whole(run, settings), check_exact=True)
    assert many.meta["steps"] == one.meta["steps"]
    assert {"entropy/p50", "mismatch/abs_p99", "policy/logratio_p999"} <= set(many.summary["metric"])


def test_the_cut_steps_are_counted_over_the_read_order(run_dir) -> None:
    run = read_run(run_dir)
    keys = row_keys(run)
    assert keys is not None
    # the read order is the file order, not step order, and the "carry" document is one across two files
    first_rows = keys.group_by("step", maintain_order=True).first()["step"].to_list()
    assert first_rows == [4, 1, 10, 11, 0, 3, 2]
    documents = keys.height - int(
        (keys["sample_id"] == keys["sample_id"].shift(1)).fill_null(False).sum()
    )  # rows minus continuations
    settings = MetricSettings.from_options(new="new", old="old", docs_per_step=7)
    report = compute_metrics(run, settings, stream=StreamSettings(max_rows=1)).summary
    steps = report.filter(pl.col("breakdown") == "step")
    n_steps = -(-documents // 7)
    assert steps["bucket"].unique(maintain_order=True).to_list() == [str(k) for k in range(n_steps)]
    docs = steps.filter(pl.col("metric") == "count/docs")["value"].to_list()
    assert docs == [7.0] * (n_steps - 1) + [float(documents - 7 * (n_steps - 1))]
    assert _value(report, "all", "count/samples") == keys.height


def test_a_final_partial_step_and_straddling_groups(run_dir) -> None:
    run = read_run(run_dir)
    plan = plan_doc_steps(row_keys(run), 7)
    assert plan.partial  # the fixture's document count is not a multiple of 7
    settings = MetricSettings.from_options(new="new", old="old", docs_per_step=7)
    report = compute_metrics(run, settings, stream=StreamSettings(max_rows=1))
    statuses = [s["status"] for s in report.meta["steps"]]
    assert statuses[-2:] == ["partial", "ok"]  # the last cut step, then the `all` row
    assert "partial" not in statuses[:-2]
    split = report.summary.filter(pl.col("metric") == "count/groups_split")
    per_step = split.filter(pl.col("breakdown") == "step")["value"].sum()
    # each straddling group is counted in every step it touches, and once in the `all` row, where it is whole
    assert split.filter(pl.col("bucket") == "all")["value"].item() == plan.split_groups.shape[0] > 0
    assert per_step >= 2 * plan.split_groups.shape[0]
    groups = report.summary.filter(pl.col("metric") == "count/groups", pl.col("bucket") == "all")
    assert groups["value"].item() == plan.group_names.shape[0]


@pytest.mark.parametrize(("style", "flags"), [("verl", {"divisor": 256.0}), ("trl", {}), ("pipelinerl", {})])
def test_key_styles_with_docs_per_step_in_tiny_chunks_equal_the_whole_read(
    run_dir, style: str, flags
) -> None:
    run = read_run(run_dir)
    settings = MetricSettings.from_options(new="new", old="old", key_style=style, docs_per_step=9, **flags)
    many = compute_metrics(run, settings, stream=StreamSettings(max_rows=1))
    one = compute_metrics(run, settings, stream=StreamSettings(max_rows=10**9))
    assert many.meta["chunks"] == len(FILE_STEPS)
    assert_frame_equal(many.summary, one.summary, check_exact=True)
    assert_frame_equal(many.summary, _whole(run, settings), check_exact=True)
    assert [s["status"] for s in many.meta["steps"]] == [s["status"] for s in one.meta["steps"]]
    assert many.summary.filter(pl.col("bucket") == "all").height > 0


def test_read_order_chunks_keep_interleaved_steps_together() -> None:
    steps = np.array([3, 3, 0, 0, 1, 0, 2, 2, 5])  # step 1 lies inside step 0's rows
    assert read_order_chunks(steps, 1) == [((3,), 0, 2), ((0, 1), 2, 6), ((2,), 6, 8), ((5,), 8, 9)]
    assert read_order_chunks(steps, 5) == [((3,), 0, 2), ((0, 1), 2, 6), ((2, 5), 6, 9)]
    assert read_order_chunks(steps, 6) == [((3, 0, 1), 0, 6), ((2, 5), 6, 9)]
    assert read_order_chunks(steps, 100) == [((3, 0, 1, 2, 5), 0, 9)]
    assert read_order_chunks(np.zeros(0, dtype=np.int64), 1) == []


def test_plan_cuts_by_consecutive_sample_ids_across_real_steps() -> None:
    keys = pl.DataFrame(
        {
            "step": [0, 0, 1, 1, 1, 2],
            "sample_id": ["a", "b", "b", "c", "d", "d"],  # b runs on from step 0 into step 1; so does d
            "group_id": ["p", "p", "q", "q", "r", "r"],
        }
    )
    plan = plan_doc_steps(keys, 2)  # documents a | b b | c | d d -> steps 0 0 0 1 1 1
    assert plan.step.tolist() == [0, 0, 0, 1, 1, 1]
    assert not plan.partial and plan.n_steps == 2
    assert plan.split_groups.tolist() == [1]  # q (code 1 of p, q, r) is in both cut steps
    odd = plan_doc_steps(keys, 3)  # documents 0..3 -> steps 0 0 0 0 1 1, the last one partial
    assert odd.step.tolist() == [0, 0, 0, 0, 1, 1] and odd.partial


def _tiny_rows(steps: list[int | None]) -> list[dict]:
    return [
        dict(
            step=step,
            sample_id=f"s{i}",
            group_id=f"g{i // 2}",
            input_ids=[1, 2, 3, 4],
            prompt_len=2,
            loss_mask=[False, False, True, True],
            old_logprobs=[None, None, -0.5 - 0.1 * i, -1.5],
            new_logprobs=[None, None, -0.4 - 0.1 * i, -1.5],
            advantages=[None, None, 1.0, 1.0],
        )
        for i, step in enumerate(steps)
    ]


def test_docs_per_step_on_a_run_with_a_null_step_is_e213_as_before(tmp_path) -> None:
    write_rollouts_file(tmp_path / "nulls.parquet", _tiny_rows([0, 0, 1, None, 1]))
    run = read_run(tmp_path / "nulls.parquet")
    settings = MetricSettings.from_options(new="new", old="old", docs_per_step=2)
    with pytest.raises(InvalidInputError) as refused:
        compute_metrics(run, settings, stream=StreamSettings(max_rows=1))
    assert refused.value.code == "E213"
    ignored = CheckSettings(ignore=("E213",))
    report = compute_metrics(run, settings, checks=ignored, stream=StreamSettings(max_rows=1))
    assert report.meta["inputs"]["n_samples"] == 4  # the null-step row is left out, as by a whole read
    assert_frame_equal(report.summary, _whole(run, settings, ignored), check_exact=True)
    # documents s0 s1 | s2 s4: the cut counts the rows kept
    assert _value(report.summary, "1", "count/samples") == 2


def test_rows_left_out_by_an_ignored_error_are_cut_as_a_whole_read_cuts_them(tmp_path) -> None:
    rows = _tiny_rows([0, 0, 0, 1, 1, 1])
    rows[1]["loss_mask"] = [False, True]  # not as long as input_ids: E201, ignored, so the row is left out
    write_rollouts_file(tmp_path / "short.parquet", rows)
    run = read_run(tmp_path / "short.parquet")
    settings = MetricSettings.from_options(new="new", old="old", docs_per_step=2)
    ignored = CheckSettings(ignore=("E201",))
    report = compute_metrics(run, settings, checks=ignored, stream=StreamSettings(max_rows=1))
    assert report.meta["inputs"]["n_samples"] == 5
    assert_frame_equal(report.summary, _whole(run, settings, ignored), check_exact=True)
    # documents s0 s2 | s3 s4 | s5: the left-out s1 is no document
    assert [s["status"] for s in report.meta["steps"]] == ["ok", "ok", "partial", "ok"]
    assert _value(report.summary, "2", "count/samples") == 1


def test_hand_checked_logratio_of_a_cut_step(tmp_path) -> None:
    write_rollouts_file(tmp_path / "hand.parquet", _tiny_rows([0, 0, 0, 1, 1, 1]))
    run = read_run(tmp_path / "hand.parquet")
    report = compute_metrics(
        run,
        MetricSettings.from_options(new="new", old="old", docs_per_step=3),
        stream=StreamSettings(max_rows=1),
    ).summary
    # step 0 = s0 s1 s2 (real step 0), step 1 = s3 s4 s5; every sample's first loss token has new − old = 0.1
    # (float32 inputs), its second 0
    assert _value(report, "0", "count/tokens") == _value(report, "1", "count/tokens") == 6
    assert _value(report, "0", "policy/logratio_mean") == pytest.approx(0.05, abs=1e-7)
    # g1 = {s2, s3} straddles the cut: counted in both steps, whole in the `all` row (3 groups)
    assert _value(report, "0", "count/groups_split") == _value(report, "1", "count/groups_split") == 1
    assert _value(report, "all", "count/groups_split") == 1
    assert _value(report, "all", "count/groups") == 3


TYPE_CASES = [
    ("step", pl.String),
    ("step", pl.Float64),
    ("step", pl.UInt64),
    ("sample_id", pl.Int64),
    ("sample_id", pl.Categorical),
    ("group_id", pl.Int64),
    ("input_ids", pl.List(pl.Float64)),
    ("input_ids", pl.List(pl.String)),
    ("loss_mask", pl.List(pl.String)),
    ("old_logprobs", pl.List(pl.Float64)),
    ("old_logprobs", pl.List(pl.String)),
    ("prompt_len", pl.String),
]


@pytest.mark.parametrize("docs_per_step", [None, 1])
@pytest.mark.parametrize(("column", "dtype"), TYPE_CASES, ids=[f"{c}-{t}" for c, t in TYPE_CASES])
def test_a_column_of_another_type_gives_the_whole_reads_outcome(
    tmp_path, column: str, dtype, docs_per_step: int | None
) -> None:
    """The clean error code (or the numbers) of the whole read, whatever the key columns hold; a step column
    of strings or floats is E103 (chunks of steps used to exit 101 on it: polars cannot filter it by step)."""
    frame = rollouts_frame(valid_rows()).with_columns(pl.col(column).cast(dtype, strict=False))
    write_rollouts_file(tmp_path / "typed.parquet", frame.to_dicts(), raw_types={column: dtype})
    settings = MetricSettings.from_options(new="old", old="rollout", docs_per_step=docs_per_step)

    def outcome(compute) -> object:
        try:
            return compute(read_run(tmp_path / "typed.parquet"))
        except PgdiagError as exc:
            return exc.code

    chunked = outcome(lambda run: compute_metrics(run, settings, stream=StreamSettings(max_rows=1)).summary)
    whole = outcome(lambda run: _whole(run, settings))
    if column == "step" and dtype in (pl.String, pl.Float64):
        assert whole == "E103"
    if isinstance(whole, str):
        assert chunked == whole
    else:
        assert_frame_equal(chunked, whole, check_exact=True)
