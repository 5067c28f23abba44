"""The CLI's numbers on sample_data/ are those saved at `fefc33e` (tests/golden/make_golden.py), within a
relative tolerance that summation order may move: |a - b| <= 1e-9 * max(|a|, |b|) + 1e-12, NaN equal to NaN.

Everything else (keys, strings, integers, nulls, lengths) is exact. Worst-token, worst-sequence and trace
tables are compared as sets ordered by (pair, step, sample_id, pos): ties in |delta| may come out in either
order, but the rows kept must be the same. New keys in today's output are allowed (a new metric is not a
regression); a missing key is not.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest
from make_golden import CASES, GOLDEN, _jsonable, copy_sample_data, run_case

REL, ABS = 1e-9, 1e-12
UNORDERED_TABLES = ("worst_tokens", "worst_seqs", "worst_trace")


def numbers_close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= REL * max(abs(a), abs(b)) + ABS


def _number(value: Any) -> float | None:
    """A JSON number, or a non-finite float written as a string by make_golden._jsonable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def differences(expected: Any, actual: Any, where: str = "") -> list[str]:
    """Every place where `actual` departs from `expected`, as 'path: expected != actual'."""
    a, b = _number(expected), _number(actual)
    if a is not None and b is not None:
        if isinstance(expected, int) and isinstance(actual, int) and not isinstance(expected, bool):
            return [] if expected == actual else [f"{where}: {expected} != {actual}"]
        return [] if numbers_close(a, b) else [f"{where}: {expected!r} != {actual!r}"]
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = []
        for key, value in expected.items():
            if key not in actual:
                found.append(f"{where}/{key}: missing")
            else:
                found += differences(value, actual[key], f"{where}/{key}")
        return found
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: {len(expected)} items != {len(actual)}"]
        found = []
        for i, (x, y) in enumerate(zip(expected, actual, strict=True)):
            found += differences(x, y, f"{where}[{i}]")
        return found
    return [] if expected == actual else [f"{where}: {expected!r} != {actual!r}"]


def _tie_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    key = ("pair", "step", "sample_id", "pos")
    return sorted(rows, key=lambda row: tuple(str(row.get(k)) for k in key))


def normalised(payload: dict[str, Any]) -> dict[str, Any]:
    tables = {
        name: _tie_order(rows) if any(t in name for t in UNORDERED_TABLES) else rows
        for name, rows in payload["tables"].items()
    }
    return {"result": payload["result"], "tables": tables}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("golden")
    copy_sample_data(root)
    return root


def test_the_tolerance_rule() -> None:
    assert numbers_close(1.0, 1.0 + 5e-10)
    assert not numbers_close(1.0, 1.0 + 5e-9)
    assert numbers_close(0.0, 5e-13) and not numbers_close(0.0, 5e-12)
    assert numbers_close(float("nan"), float("nan")) and not numbers_close(float("nan"), 0.0)
    assert differences({"x": [1, 2.0]}, {"x": [1, 2.0 + 1e-6]}) == ["/x[1]: 2.0 != 2.000001"]
    assert differences({"x": 1}, {"y": 1}) == ["/x: missing"]
    assert differences({"x": "nan"}, {"x": "nan"}) == []


@pytest.mark.parametrize("name", list(CASES))
def test_output_matches_golden(name: str, data: Path) -> None:
    expected = json.loads(gzip.decompress((GOLDEN / f"{name}.json.gz").read_bytes()))
    actual = json.loads(json.dumps(_jsonable(run_case(name, data))))
    found = differences(normalised(expected), normalised(actual))
    assert not found, f"{len(found)} differences, first: " + "; ".join(found[:10])
