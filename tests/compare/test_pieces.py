"""A comparison read step by step (many pieces, `chunk_rows` tiny) reports what the same runs read in one piece do.

Exact: row set and order, counts, maxima, every `step` bucket, the sequence scope, the Δ histogram, worst-K
(spanning pieces), checks (E306 counts, W407, W410 examples) and the trace. Pooled means, spreads, fits and
quantiles of buckets spread over pieces agree to rounding (relative 1e-12; docs/compare.md says why).
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from batch_factory import random_samples, write_run

from pgdiag.checks.signatures import Comoments
from pgdiag.compare.api import compare_runs
from pgdiag.compare.pooled import StridedSample
from pgdiag.data.runs import read_run
from pgdiag.errors import InvalidInputError

STEP_SIZES = (3, 11, 1, 7, 5, 9)  # uneven steps: pieces of one and of several steps


def _samples(seed: int) -> list[dict]:
    samples = random_samples(seed, sum(STEP_SIZES), steps=1, max_response=40)
    steps = np.repeat(np.arange(len(STEP_SIZES)), STEP_SIZES)
    rng = np.random.default_rng(seed + 1)
    for i, (s, step) in enumerate(zip(samples, steps, strict=True)):
        s["step"] = int(step)
        noise = rng.normal(0.0, 0.3 if step == 4 else 0.02, len(s["loss"]))  # step 4 jumps: W407
        old = -np.abs(s["streams"]["rollout"] + noise)
        if i in (2, 30):  # tokens with |Δ| > 20 in two pieces: W410 counts both, names the first
            old[1] = s["streams"]["rollout"][1] - 25.0
        s["streams"]["old"] = old
    return samples


def _runs(tmp_path, samples_a: list[dict], samples_b: list[dict]):
    a = write_run(tmp_path / "a.parquet", samples_a, run="a", streams={"rollout_logprobs": "rollout"})
    b = write_run(tmp_path / "b.parquet", samples_b, run="b", streams={"rollout_logprobs": "old"})
    return read_run(a), read_run(b)


def _assert_same_report(one, many) -> None:
    s1, s2 = one.report.summary, many.report.summary
    keys = [
        "pair",
        "scope",
        "breakdown",
        "bucket",
        "metric",
        "unit",
        "reduction",
        "n",
        "bucket_lo",
        "bucket_hi",
    ]
    assert s1.select(keys).equals(s2.select(keys))
    v1, v2 = s1["value"].to_numpy(), s2["value"].to_numpy()
    exact = (
        (s1["breakdown"] == "step") | (s1["unit"] == "count") | (s1["scope"] == "sequence")
    ).to_numpy() | s1["metric"].str.contains(r"abs_(dprob_)?max").to_numpy() & (
        s1["breakdown"] == "all"
    ).to_numpy()
    np.testing.assert_array_equal(v1[exact], v2[exact])
    np.testing.assert_allclose(v1, v2, rtol=1e-12, atol=1e-15)
    assert one.report.worst_tokens.equals(many.report.worst_tokens)
    assert one.report.worst_seqs.equals(many.report.worst_seqs)
    assert one.report.checks.equals(many.report.checks)
    assert one.trace().equals(many.trace())
    assert one.report.meta["inputs"] == many.report.meta["inputs"]


def test_many_pieces_equal_one_piece(tmp_path) -> None:
    samples = _samples(3)
    run_a, run_b = _runs(tmp_path, samples, samples)
    one = compare_runs(run_a, run_b, worst_k=7)
    many = compare_runs(run_a, run_b, worst_k=7, chunk_rows=1)  # every step its own piece
    some = compare_runs(run_a, run_b, worst_k=7, chunk_rows=24)  # pieces of 1 to 3 steps
    assert one.pair is not None and many.pair is None
    _assert_same_report(one, many)
    _assert_same_report(one, some)
    # the worst tokens and sequences come from several pieces, the findings from the pooled sums
    assert one.report.worst_tokens["step"].n_unique() > 1
    assert one.report.worst_seqs["step"].n_unique() > 1
    codes = one.report.checks["code"].to_list()
    assert "W407" in codes and "W410" in codes
    w410 = one.report.checks.filter(pl.col("code") == "W410").row(0, named=True)
    assert w410["count"] == 2 and w410["step"] == 0
    # pooled values differ from the one-piece ones by rounding at most (not bit-identical everywhere)
    summary = many.report.summary.filter(pl.col("breakdown") == "all")
    assert summary.filter(pl.col("metric") == "count/mismatch_tokens")["value"][0] == one.pair.n_tokens
    # token plots read every token here (below the sample cap)
    np.testing.assert_array_equal(many.tokens["lp_a"].to_numpy(), one.pair.lp_a)


def test_a_step_in_one_run_only_is_counted_as_unmatched(tmp_path) -> None:
    samples = _samples(5)
    only_a = [s for s in samples if s["step"] != 2]  # step 2 (1 sample) in run b only
    only_b = [s for s in samples if s["step"] != 5]  # step 5 (9 samples) in run a only
    run_a, run_b = _runs(tmp_path, only_a, only_b)
    messages = []
    for chunk_rows in (10**6, 1, 24):
        with pytest.raises(InvalidInputError) as caught:
            compare_runs(run_a, run_b, chunk_rows=chunk_rows)
        assert caught.value.code == "E306"
        messages.append(caught.value.message)
    assert messages[0] == messages[1] == messages[2]
    assert "9 of 35 samples of a have no match in b and 1 of 27 of b none in a" in messages[0]
    assert "first: step 5, sample s27 of a" in messages[0]
    one = compare_runs(run_a, run_b, ignore=["E306"])
    many = compare_runs(run_a, run_b, ignore=["E306"], chunk_rows=1)
    _assert_same_report(one, many)
    assert one.report.meta["inputs"]["n_samples"] == {"a": 35, "b": 27}


def test_a_piece_with_no_match_is_counted_and_skipped(tmp_path) -> None:
    samples = _samples(6)
    renamed = [dict(s, sample_id=f"x{s['sample_id']}") if s["step"] == 3 else s for s in samples]
    run_a, run_b = _runs(tmp_path, samples, renamed)  # step 3 (7 samples) matches nothing by id
    one = compare_runs(run_a, run_b, join="id", ignore=["E306"])
    many = compare_runs(run_a, run_b, join="id", ignore=["E306"], chunk_rows=1)
    _assert_same_report(one, many)
    assert 3 not in one.report.meta["inputs"]["steps"]
    with pytest.raises(InvalidInputError, match="7 of 36 samples of a have no match in b and 7 of 36"):
        compare_runs(run_a, run_b, join="id", chunk_rows=1)


def test_no_sample_matched_is_e304_read_whole_or_by_step(tmp_path) -> None:
    samples = _samples(7)
    run_a, run_b = _runs(
        tmp_path, [s for s in samples if s["step"] < 3], [s for s in samples if s["step"] >= 3]
    )
    messages = []
    for chunk_rows in (10**6, 1):
        with pytest.raises(InvalidInputError) as caught:
            compare_runs(run_a, run_b, chunk_rows=chunk_rows)
        assert caught.value.code == "E304"
        messages.append(caught.value.message)
    assert messages[0] == messages[1] and "steps 0-2 vs 3-5" in messages[0]


def test_one_run_two_streams_by_step(tmp_path) -> None:
    samples = _samples(9)
    path = write_run(
        tmp_path / "r.parquet",
        samples,
        run="r",
        streams={"rollout_logprobs": "rollout", "old_logprobs": "old"},
    )
    run = read_run(path)
    _assert_same_report(compare_runs(run), compare_runs(run, chunk_rows=5))


def test_strided_sample_is_every_kth_token_however_the_run_is_split() -> None:
    values = np.arange(1000, dtype=np.float64)
    for splits in ([1000], [1, 2, 997], [333, 333, 334], [7] * 142 + [6]):
        sample = StridedSample(cap=100)
        start = 0
        for m in splits:
            sample.add({"x": values[start : start + m]}, m)
            start += m
        assert sample.stride == 16  # 1000 / 16 = 63 held; stride 8 would hold 125 > 100
        np.testing.assert_array_equal(sample.column("x"), values[::16])


def test_comoments_merge_equals_the_whole() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(-2.0, 1.5, 10_000)
    y = 0.9 * x + rng.normal(0.0, 0.1, 10_000)
    whole = Comoments.of(x, y)
    parts = Comoments.of(x[:10], y[:10])
    for lo, hi in ((10, 4000), (4000, 4001), (4001, 10_000)):
        parts = parts.merge(Comoments.of(x[lo:hi], y[lo:hi]))
    for field in ("mean_x", "mean_y", "sxx", "syy", "sxy"):
        assert getattr(parts, field) == pytest.approx(getattr(whole, field), rel=1e-12)
    slope, r = parts.slope_and_r()
    assert slope == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-12)
    assert r == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12)


def _two_stream_runs(tmp_path, samples_a: list[dict], samples_b: list[dict]):
    streams = {"rollout_logprobs": "rollout", "old_logprobs": "old"}
    a = write_run(tmp_path / "a2.parquet", samples_a, run="a", streams=streams)
    b = write_run(tmp_path / "b2.parquet", samples_b, run="b", streams=streams)
    return read_run(a), read_run(b)


def _batch_rows(comparison) -> pl.DataFrame:
    return comparison.report.summary.filter(pl.col("scope") == "batch")


def _whole_read_rows(run, stream: str, settings, label: str) -> pl.DataFrame:
    """What compare --metrics reported before it streamed: `metrics_report` on the run's batch read whole."""
    from pgdiag.compare.side_by_side import side_settings
    from pgdiag.data.load import read_token_batch
    from pgdiag.metrics.api import metric_streams, metrics_report

    resolved = side_settings(run, stream, settings)
    batch = read_token_batch(run, streams=metric_streams(resolved), env=True).batch
    summary = metrics_report(batch, resolved, run=run).summary
    return summary.filter(
        pl.col("breakdown").is_in(["all", "step"]) & ~pl.col("metric").str.starts_with("mismatch/")
    ).with_columns(pl.col("pair").str.replace(f"{run.label}:", f"{label}:", literal=True))


def _assert_same_batch_rows(one: pl.DataFrame, many: pl.DataFrame) -> None:
    """Step rows bit-identical; pooled `all` rows and their deltas to relative 1e-12 (docs/metrics.md)."""
    keys = ["pair", "breakdown", "bucket", "metric", "unit", "reduction", "n", "bucket_lo", "bucket_hi"]
    assert one.select(keys).equals(many.select(keys))
    step = (one["breakdown"] == "step").to_numpy()
    v1, v2 = one["value"].to_numpy(), many["value"].to_numpy()
    np.testing.assert_array_equal(v1[step], v2[step])
    np.testing.assert_allclose(v1, v2, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("key_style", ["pgdiag", "verl"])
def test_metrics_side_by_side_many_pieces_equal_one_piece_and_the_whole_read(tmp_path, key_style) -> None:
    from pgdiag.metrics.settings import MetricSettings

    samples = _samples(3)
    run_a, run_b = _two_stream_runs(tmp_path, samples, samples)
    settings = MetricSettings(key_style=key_style)
    one = compare_runs(run_a, run_b, stream_a="old", metrics=settings, worst_k=7)
    many = compare_runs(run_a, run_b, stream_a="old", metrics=settings, worst_k=7, chunk_rows=1)
    some = compare_runs(run_a, run_b, stream_a="old", metrics=settings, worst_k=7, chunk_rows=24)
    assert one.pair is not None and many.pair is None  # --metrics no longer forces one piece
    _assert_same_report(one, many)
    _assert_same_report(one, some)
    _assert_same_batch_rows(_batch_rows(one), _batch_rows(many))
    _assert_same_batch_rows(_batch_rows(one), _batch_rows(some))
    # one piece is the old whole read, bit for bit: metrics_report on each run's whole batch
    rows = _batch_rows(one).filter(pl.col("pair") != "b - a")
    reference = pl.concat(
        [_whole_read_rows(run_a, "old", settings, "a"), _whole_read_rows(run_b, "old", settings, "b")]
    )
    assert rows.drop("scope").equals(reference.drop("scope"))
    meta = many.report.meta["side_metrics"]
    assert set(meta) == {"a", "b"} and meta["a"]["pooled_quantiles"]["exact"] is True
    if key_style == "pgdiag":  # hand check: both runs are the same, every delta is 0; every step is a row
        deltas = _batch_rows(many).filter(pl.col("pair") == "b - a")["value"].drop_nulls()
        assert deltas.len() > 20 and (deltas == 0.0).all()
        tokens = _batch_rows(many).filter(
            (pl.col("pair") == "a:rollout vs a:old") & (pl.col("metric") == "count/tokens")
        )
        assert tokens["bucket"].to_list() == ["0", "1", "2", "3", "4", "5", "all"]
        assert tokens["value"][-1] == sum(len(s["loss"]) for s in samples)


def test_metrics_side_by_side_counts_a_step_of_one_run_only(tmp_path) -> None:
    from pgdiag.metrics.settings import MetricSettings

    samples = _samples(5)
    only_a = [s for s in samples if s["step"] != 2]  # step 2 in run b only
    only_b = [s for s in samples if s["step"] != 5]  # step 5 in run a only
    run_a, run_b = _two_stream_runs(tmp_path, only_a, only_b)
    options = {"stream_a": "old", "metrics": MetricSettings(), "ignore": ["E306"]}
    one = compare_runs(run_a, run_b, **options)
    many = compare_runs(run_a, run_b, chunk_rows=1, **options)
    _assert_same_report(one, many)
    _assert_same_batch_rows(_batch_rows(one), _batch_rows(many))
    steps = _batch_rows(many).filter(pl.col("breakdown") == "step")
    assert "5" in steps.filter(pl.col("pair") == "a:rollout vs a:old")["bucket"].to_list()
    assert "2" in steps.filter(pl.col("pair") == "b:rollout vs b:old")["bucket"].to_list()
    assert "2" not in steps.filter(pl.col("pair") == "a:rollout vs a:old")["bucket"].to_list()


def test_tokens_out_many_pieces_equal_the_whole_table(tmp_path, monkeypatch) -> None:
    import pyarrow.parquet as pq

    from pgdiag.compare import tokens

    monkeypatch.setattr(tokens, "ROW_GROUP_ROWS", 50)  # row groups cut across pieces and within them
    samples = _samples(3)
    run_a, run_b = _runs(tmp_path, samples, samples)
    whole = compare_runs(run_a, run_b, keep_tokens=True)
    assert whole.pair is not None and whole.tokens_file is None
    reference = tokens.write_token_table(whole.pair, tmp_path / "whole.parquet")
    written = {}
    for chunk_rows in (10**6, 1, 24):
        path = tmp_path / f"tokens-{chunk_rows}.parquet"
        comparison = compare_runs(run_a, run_b, tokens_out=path, chunk_rows=chunk_rows)
        assert comparison.tokens_file == path
        written[chunk_rows] = path
    expected = pl.read_parquet(reference)
    assert expected.height == whole.pair.n_tokens > 500
    ref_file = pq.ParquetFile(reference)
    for path in written.values():
        assert pl.read_parquet(path).equals(expected)
        file = pq.ParquetFile(path)
        assert file.schema_arrow.equals(ref_file.schema_arrow, check_metadata=True)
        sizes = [file.metadata.row_group(i).num_rows for i in range(file.num_row_groups)]
        assert sizes == [ref_file.metadata.row_group(i).num_rows for i in range(ref_file.num_row_groups)]
        assert sizes[:-1] == [50] * (len(sizes) - 1)
        assert file.metadata.row_group(0).column(0).compression == "ZSTD"
    table = pl.read_parquet(written[1])
    np.testing.assert_array_equal(
        table["dlogp"].to_numpy(), table["lp_b"].to_numpy() - table["lp_a"].to_numpy()
    )
    assert table["step"].to_list() == sorted(table["step"].to_list())  # pieces in step order
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_tokens_out_is_not_written_when_the_comparison_fails(tmp_path) -> None:
    samples = _samples(5)
    run_a, run_b = _runs(tmp_path, [s for s in samples if s["step"] != 5], samples)  # E306 after every piece
    out = tmp_path / "out"
    out.mkdir()
    for chunk_rows in (10**6, 1):
        with pytest.raises(InvalidInputError, match=r"no match"):
            compare_runs(run_a, run_b, tokens_out=out / "tokens.parquet", chunk_rows=chunk_rows)
        assert list(out.iterdir()) == []  # neither the table nor its temp file
    (out / "tokens.parquet").write_bytes(b"keep")
    from pgdiag.errors import UsageError

    with pytest.raises(UsageError) as caught:
        compare_runs(run_a, run_b, tokens_out=out / "tokens.parquet", ignore=["E306"])
    assert caught.value.code == "E502" and (out / "tokens.parquet").read_bytes() == b"keep"
    done = compare_runs(run_a, run_b, tokens_out=out / "tokens.parquet", ignore=["E306"], overwrite=True)
    assert pl.read_parquet(done.tokens_file).height == done.report.meta["inputs"]["n_tokens"]
    assert [p.name for p in out.iterdir()] == ["tokens.parquet"]


def test_metrics_side_by_side_of_one_run_by_step(tmp_path) -> None:
    from pgdiag.metrics.settings import MetricSettings

    run, _ = _two_stream_runs(tmp_path, _samples(9), _samples(9))
    one = compare_runs(run, metrics=MetricSettings())
    many = compare_runs(run, metrics=MetricSettings(), chunk_rows=5)
    _assert_same_report(one, many)
    _assert_same_batch_rows(_batch_rows(one), _batch_rows(many))
    assert set(_batch_rows(many)["pair"]) == {"a:rollout vs a:old"}  # one run: no deltas
    assert list(many.report.meta["side_metrics"]) == ["a"]


# ---- --join hash-any-step read in pieces ------------------------------------------------------------------
MOVED = {0: 1, 1: 0, 2: 3, 3: 3, 4: 2, 5: 5}  # run b holds run a's samples in other steps


def _any_step_runs(tmp_path, seed: int):
    """Run a: steps 0-5 and a step 7 of its own (two sequences b lacks). Run b: the other sequences under other
    ids, moved across steps (every fourth one two steps further), without samples 5 and 17 (unmatched in a),
    and a step 9 of its own (three sequences a lacks). Samples 3 and 20 hold the same sequence: b holds 3's
    copy in step 4 and 20's in step 0, so the first copy of a pairs with the first of b (20's) across
    pieces, as one read pairs it."""
    import copy

    samples = _samples(seed)
    twin = copy.deepcopy(samples[3])
    twin.update(step=samples[20]["step"], sample_id="s20")
    twin["streams"]["old"] = twin["streams"]["old"] - 0.01
    samples[20] = twin
    moved = []
    for i, s in enumerate(samples):
        if i in (5, 17):
            continue
        step = MOVED[s["step"]] if i % 4 else (MOVED[s["step"]] + 2) % 6
        if i == 3:
            step = 4
        elif i == 20:
            step = 0
        moved.append(dict(s, step=step, sample_id=f"x{s['sample_id']}"))
    extra = random_samples(seed + 50, 5, steps=1, max_response=30)
    for k, s in enumerate(extra):
        s.update(step=9 if k < 3 else 7, sample_id=f"new{k}")
        s["streams"]["old"] = s["streams"]["rollout"]
    moved = sorted(moved + extra[:3], key=lambda s: s["step"])
    return _runs(tmp_path, samples + extra[3:], moved)


def test_hash_any_step_in_many_pieces_equals_one_piece(tmp_path) -> None:
    run_a, run_b = _any_step_runs(tmp_path, 11)
    options = {"join": "hash-any-step", "ignore": ["E306"], "worst_k": 7}
    one = compare_runs(run_a, run_b, **options)
    assert one.pair is not None  # 38 + 37 rows: one piece, read whole
    for chunk_rows in (1, 24, 40):
        many = compare_runs(run_a, run_b, chunk_rows=chunk_rows, **options)
        assert many.pair is None
        _assert_same_report(one, many)
    # matches across steps: a's step 1 pairs with b's steps 0 and 2 (every fourth sample two steps further)
    step_b = dict(run_b.collect(["sample_id", "step"]).rows())
    spread: dict[int, set[int]] = {}
    for step, sample_b in zip(one.pair.step.tolist(), one.pair.sample_id_b.tolist(), strict=True):
        spread.setdefault(step, set()).add(step_b[sample_b])
    assert spread[1] == {0, 2} and spread[3] == {3, 4, 5} and one.pair.join == "hash-any-step"
    matched_b = dict(zip(one.pair.sample_id.tolist(), one.pair.sample_id_b.tolist(), strict=True))
    assert matched_b["s3"] == "xs20" and matched_b["s20"] == "xs3" and matched_b["s1"] == "xs1"
    inputs = one.report.meta["inputs"]
    assert inputs["n_samples"] == {"a": 38, "b": 37} and inputs["n_matched_samples"] == 34


def test_hash_any_step_unmatched_and_no_match_read_in_pieces(tmp_path) -> None:
    run_a, run_b = _any_step_runs(tmp_path, 12)
    messages = []
    for chunk_rows in (10**6, 1, 24):
        with pytest.raises(InvalidInputError) as caught:
            compare_runs(run_a, run_b, join="hash-any-step", chunk_rows=chunk_rows)
        assert caught.value.code == "E306"
        messages.append(caught.value.message)
    assert messages[0] == messages[1] == messages[2]
    assert "4 of 38 samples of a have no match in b and 3 of 37 of b none in a" in messages[0]
    assert "first: step 1, sample s5 of a" in messages[0] and "join (seq_hash)" in messages[0]
    samples = _samples(13)
    other = random_samples(14, 10, steps=5, max_response=30)
    for s in other:
        s["streams"]["old"] = s["streams"]["rollout"]
    run_a, run_b = _runs(tmp_path / "none", samples, sorted(other, key=lambda s: s["step"]))
    messages = []
    for chunk_rows in (10**6, 1):
        with pytest.raises(InvalidInputError) as caught:
            compare_runs(run_a, run_b, join="hash-any-step", chunk_rows=chunk_rows)
        assert caught.value.code == "E304"
        messages.append(caught.value.message)
    assert messages[0] == messages[1] and "steps 0-5 vs 0-4" in messages[0]


# ---- N-way compare read in pieces ---------------------------------------------------------------------------
def _nway_runs(tmp_path):
    """Three runs on the steps of `_samples`: a; b without samples 4 and 9 and with a step 8 of its own; c with
    its own noise, without step 5 (so step 5 is common to a and b only: in no piece's common samples)."""
    samples = _samples(21)
    rng = np.random.default_rng(22)
    b = [s for i, s in enumerate(samples) if i not in (4, 9)]
    extra = random_samples(23, 2, steps=1, max_response=30)
    for k, s in enumerate(extra):
        s.update(step=8, sample_id=f"b{k}")
        s["streams"]["old"] = s["streams"]["rollout"]
    c = []
    for s in samples:
        if s["step"] == 5:
            continue
        noisy = -np.abs(s["streams"]["rollout"] + rng.normal(0.0, 0.05, len(s["loss"])))
        streams = dict(s["streams"], old=noisy)
        c.append(dict(s, streams=streams))
    paths = []
    for name, rows, column in (("a", samples, "rollout"), ("b", b + extra, "old"), ("c", c, "old")):
        paths.append(
            write_run(tmp_path / f"{name}.parquet", rows, run=name, streams={"new_logprobs": column})
        )
    return [read_run(p) for p in paths]


def test_nway_in_many_pieces_equals_one_piece(tmp_path) -> None:
    from pgdiag.compare.nway import compare_many
    from pgdiag.compare.settings import CompareSettings

    runs = _nway_runs(tmp_path)
    one = compare_many(runs, CompareSettings(worst_k=5), baseline=1)
    assert all(c.pair is not None for c in one.comparisons)  # 36 + 36 + 27 rows: one piece
    for chunk_rows in (
        1,
        8,
        20,
    ):  # one row group per file: a piece may grow to 4 x chunk_rows (data/pieces.py)
        many = compare_many(runs, CompareSettings(worst_k=5, chunk_rows=chunk_rows), baseline=1)
        assert all(c.pair is None for c in many.comparisons)
        for c1, c2 in zip(one.comparisons, many.comparisons, strict=True):
            _assert_same_report(c1, c2)
        assert one.matrix.select("run_a", "run_b").equals(many.matrix.select("run_a", "run_b"))
        np.testing.assert_allclose(
            one.matrix["value"].to_numpy(), many.matrix["value"].to_numpy(), rtol=1e-12
        )
        s1, s2 = one.report.summary, many.report.summary
        assert s1.drop("value").equals(s2.drop("value"))
        np.testing.assert_allclose(s1["value"].to_numpy(), s2["value"].to_numpy(), rtol=1e-12, atol=1e-15)
        assert one.report.checks.equals(many.report.checks)
    # hand count: 36 samples in a; b lacks 4 and 9 (steps 0 and 1); c lacks step 5 (9 samples)
    inputs = one.comparisons[0].report.meta["inputs"]
    assert inputs["n_matched_samples"] == 36 - 2 - 9 and one.report.meta["pairs"][0] == "b:new vs a:new"
    assert inputs["steps"] == [0, 1, 2, 3, 4]
    a_vs_c = one.matrix.filter((pl.col("run_a") == "a") & (pl.col("run_b") == "c"))["value"][0]
    assert a_vs_c == pytest.approx(0.04, rel=0.1)  # mean |N(0, 0.05)| = 0.05 * sqrt(2 / pi) = 0.0399


def test_hash_any_step_plan_reads_whole_when_rows_may_drop_and_refuses_changed_rows(tmp_path) -> None:
    from pgdiag.compare.pieces import checked_matches
    from pgdiag.data.load import read_token_batch
    from pgdiag.data.pieces import any_step_pieces
    from pgdiag.data.runs import restrict_steps

    run_a, run_b = _any_step_runs(tmp_path, 15)
    plan = any_step_pieces(run_a, run_b, 1, ())
    assert len(plan.pieces) == 8 and plan.keys is not None and plan.keys.n_matched == 34
    # an ignored E213 lets the reader drop rows the key columns still list: read whole (one piece)
    dropping = any_step_pieces(run_a, run_b, 1, ("E213",))
    assert [p.steps for p in dropping.pieces] == [None] and dropping.keys is None
    # rows read for a piece must be the rows its keys listed (else E103, never a wrong pairing)
    piece = plan.pieces[1]
    batch_a = read_token_batch(restrict_steps(run_a, piece.steps), streams=["rollout"]).batch
    batch_b = read_token_batch(restrict_steps(run_b, piece.steps_b), streams=["rollout"]).batch
    assert checked_matches(piece, batch_a, batch_b) is piece.matches
    with pytest.raises(InvalidInputError, match="differ from the keys") as caught:
        checked_matches(piece, batch_a, batch_b.select(np.arange(batch_b.n_samples)[::-1]))
    assert caught.value.code == "E103"


def test_a_key_column_the_reader_refuses_gives_the_one_read_error(tmp_path) -> None:
    """A `sample_id` stored as a list: the key read cannot plan on it, and the reader's E103 is the error, read
    whole or in pieces, for N-way and for hash-any-step."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pgdiag.compare.nway import compare_many
    from pgdiag.compare.settings import CompareSettings

    runs = _nway_runs(tmp_path)
    table = pq.read_table(tmp_path / "c.parquet")
    listed = pa.array([[x] for x in table.column("sample_id").to_pylist()])
    index = table.schema.get_field_index("sample_id")
    table = table.set_column(index, pa.field("sample_id", listed.type), listed)
    pq.write_table(
        table.replace_schema_metadata(pq.read_schema(tmp_path / "c.parquet").metadata), tmp_path / "l.parquet"
    )
    runs[2] = read_run(tmp_path / "l.parquet")
    messages = []
    for chunk_rows in (10**6, 1):
        for call in (
            lambda rows=chunk_rows: compare_many(runs, CompareSettings(chunk_rows=rows)),
            lambda rows=chunk_rows: compare_runs(runs[0], runs[2], join="hash-any-step", chunk_rows=rows),
        ):
            with pytest.raises(InvalidInputError) as caught:
                call()
            messages.append((caught.value.code, caught.value.message))
    assert len(set(messages)) == 1 and messages[0][0] == "E103" and "sample_id" in messages[0][1]


def test_hash_any_step_tokens_out_in_pieces_and_metrics_read_whole(tmp_path) -> None:
    """`--tokens-out` writes each hash-any-step piece's tokens: the table of one read, row for row; `--metrics`
    (each run's own set wants each step of b once, in order) reads the runs whole."""
    from pgdiag.metrics.settings import MetricSettings

    run_a, run_b = _any_step_runs(tmp_path, 16)
    options = {"join": "hash-any-step", "ignore": ["E306"]}
    tables = []
    for chunk_rows in (10**6, 1):
        path = tmp_path / f"tokens-{chunk_rows}.parquet"
        with_tokens = compare_runs(run_a, run_b, tokens_out=path, chunk_rows=chunk_rows, **options)
        tables.append(pl.read_parquet(path))
    assert tables[0].height == with_tokens.report.meta["inputs"]["n_tokens"] > 0
    assert tables[0].equals(tables[1])
    with_metrics = compare_runs(run_a, run_b, metrics=MetricSettings(new="rollout"), chunk_rows=1, **options)
    assert with_metrics.pair is not None  # one piece
