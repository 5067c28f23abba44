"""`compare --exact` and the `exact` gate: bitwise agreement, the first divergent token, the ULP histogram."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rollout_factory import valid_rows, write_rollouts_file
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.compare.api import compare_runs
from pgdiag.compare.exact import ordered_key, ulp_bucket_label, ulp_distance
from pgdiag.errors import InvalidInputError
from pgdiag.report.gates import GateSettings, outcome


def _run(tmp_path: Path, rows: list[dict], name: str = "r.parquet") -> Path:
    return write_rollouts_file(tmp_path / name, rows, streams={})


def _identical_rows() -> list[dict]:
    rows = valid_rows()
    for row in rows:
        row["old_logprobs"] = list(row["rollout_logprobs"])
    return rows


def test_ordered_key_is_monotone_and_adjacent_floats_are_one_apart() -> None:
    values = np.array([-2.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0], dtype=np.float32)
    keys = ordered_key(values)
    assert keys[3] == keys[4] == 0  # -0.0 and +0.0
    assert np.all(np.diff(keys[[0, 1, 2, 4, 5, 6]]) > 0)
    x = np.float32(-0.75)
    up = np.nextafter(x, np.float32(0))
    assert ulp_distance(np.array([x]), np.array([up]))[0] == 1
    # the smallest negative and positive subnormals are 2 apart (through 0)
    tiny = np.float32(1e-45)
    assert ulp_distance(np.array([-tiny]), np.array([tiny]))[0] == 2
    # across the exponent boundary at 1.0: 1.0 - 1ulp and 1.0 + 1ulp are 2 apart
    below, above = np.nextafter(np.float32(1), np.float32(0)), np.nextafter(np.float32(1), np.float32(2))
    assert ulp_distance(np.array([below]), np.array([above]))[0] == 2
    assert [ulp_bucket_label(i) for i in range(5)] == ["0", "1", "2-3", "4-7", "8-15"]


def test_bit_identical_streams_pass_the_exact_gate(tmp_path: Path) -> None:
    run = _run(tmp_path, _identical_rows())
    comparison = compare_runs(run, exact=True)
    exact = next(iter(comparison.report.meta["exact"].values()))
    assert exact["identical"] is True
    assert exact["n_tokens"] == 10 and exact["n_nonzero"] == 0 and exact["max_ulp"] == 0
    assert exact["ulp_histogram"] == {"0": 10}
    assert exact["first"] is None
    decision = outcome(comparison.report)
    assert decision.exit_code == 0
    assert {g.expr for g in decision.gates.gates} == {"exact/n_nonzero>0", "exact/mask_mismatch>0"}


def test_one_flipped_ulp_is_named_at_its_position(tmp_path: Path) -> None:
    rows = _identical_rows()
    value = np.float32(rows[2]["rollout_logprobs"][4])  # step 1, sample 1:0, pos 4
    rows[2]["old_logprobs"][4] = float(np.nextafter(value, np.float32(0)))
    comparison = compare_runs(_run(tmp_path, rows), exact=True)
    exact = next(iter(comparison.report.meta["exact"].values()))
    assert exact["n_nonzero"] == 1 and exact["max_ulp"] == 1
    assert exact["ulp_histogram"] == {"0": 9, "1": 1}
    first = exact["first"]
    assert (first["step"], first["sample_id"], first["pos"], first["token_id"], first["ulp"]) == (
        1,
        "1:0",
        4,
        15,
        1,
    )
    assert first["value_a"] == -1.25 and first["value_b"] == float(np.nextafter(value, np.float32(0)))
    decision = outcome(comparison.report)
    assert decision.exit_code == 1
    failed = [g for g in decision.gates.gates if g.status == "fail"]
    assert [g.expr for g in failed] == ["exact/n_nonzero>0"] and failed[0].value == 1


def test_equal_nonfinite_values_count_as_equal_and_unequal_ones_diverge(tmp_path: Path) -> None:
    rows = _identical_rows()
    rows[0]["rollout_logprobs"][2] = rows[0]["old_logprobs"][2] = float("-inf")
    rows[1]["rollout_logprobs"][3] = rows[1]["old_logprobs"][3] = float("nan")
    comparison = compare_runs(_run(tmp_path, rows), exact=True)
    exact = next(iter(comparison.report.meta["exact"].values()))
    assert exact["identical"] and exact["n_nonfinite_equal"] == 2 and exact["n_tokens"] == 10
    rows[2]["old_logprobs"][2] = float("-inf")  # step 1 sample 1:0 pos 2: -0.5 vs -inf
    exact = next(
        iter(compare_runs(_run(tmp_path, rows, "u.parquet"), exact=True).report.meta["exact"].values())
    )
    assert exact["n_nonzero"] == 1
    assert (exact["first"]["step"], exact["first"]["pos"], exact["first"]["ulp"]) == (1, 2, None)
    assert exact["first"]["value_b"] == "-inf"


def test_a_mask_difference_fails_the_gate(tmp_path: Path) -> None:
    rows = _identical_rows() * 1
    rows = [dict(r) for r in rows]
    for r in rows:  # many tokens, so one differing mask position is W303 (<= 1 %), not E303
        r["input_ids"] = r["input_ids"] + list(range(30, 230))
        r["loss_mask"] = r["loss_mask"] + [True] * 200
        r["rollout_logprobs"] = r["rollout_logprobs"] + [-0.5] * 200
        r["old_logprobs"] = list(r["rollout_logprobs"])
        r.pop("advantages")
    b_rows = [dict(r) for r in rows]
    b_rows[0] = dict(b_rows[0], loss_mask=list(b_rows[0]["loss_mask"]))
    b_rows[0]["loss_mask"][10] = False
    b_rows[0]["old_logprobs"] = list(b_rows[0]["old_logprobs"])
    b_rows[0]["old_logprobs"][10] = None
    a = write_rollouts_file(tmp_path / "a.parquet", rows)
    b = write_rollouts_file(tmp_path / "b.parquet", b_rows)
    comparison = compare_runs(a, b, exact=True)
    exact = next(iter(comparison.report.meta["exact"].values()))
    assert exact["n_nonzero"] == 0 and exact["mask_mismatch"] == 1 and not exact["identical"]
    assert outcome(comparison.report).exit_code == 1


def test_a_float64_value_float32_cannot_hold_is_refused(tmp_path: Path) -> None:
    import polars as pl

    rows = _identical_rows()
    rows[0]["old_logprobs"][2] = -0.1  # not a float32 value when stored as float64
    run = write_rollouts_file(
        tmp_path / "f64.parquet",
        rows,
        raw_types={"old_logprobs": pl.List(pl.Float64)},
        streams={},
    )
    with pytest.raises(InvalidInputError) as caught:
        compare_runs(run, exact=True)
    assert (
        caught.value.code == "E103"
        and "f64.parquet: column old_logprobs is stored as large_list<element: double>" in str(caught.value)
    )


def test_profile_exact_and_the_cli(tmp_path: Path) -> None:
    rows = _identical_rows()
    rows[1]["old_logprobs"][2] = float(np.nextafter(np.float32(-2.0), np.float32(0)))
    run = _run(tmp_path, rows)
    result = CliRunner().invoke(build_app(), ["compare", str(run), "--exact", "--json"])
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    exact = next(iter(payload["exact"].values()))
    assert exact["first"]["sample_id"] == "0:1" and exact["first"]["pos"] == 2
    assert payload["status"] == "fail"
    shown = CliRunner().invoke(build_app(), ["compare", str(run), "--exact"])
    assert "first: step 0, sample 0:1, pos 2, token 21" in shown.output
    assert "(1 ULP)" in shown.output
    # the `exact` profile on a report without exact rows skips; with them it fails
    plain = compare_runs(run)
    skipped = outcome(plain.report, GateSettings(profile="exact")).gates.gates
    assert {g.status for g in skipped} == {"skipped"}
    assert outcome(compare_runs(run, exact=True).report, GateSettings(profile="exact")).exit_code == 1
