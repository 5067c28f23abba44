"""Tests read a clean copy of `sample_data/` (tests/sample_paths.py), never the checkout's, whose ignored
`logprobs/` and `reports/` the README's own loop fills."""

from __future__ import annotations

import re
from pathlib import Path

from sample_paths import CHECKOUT_SAMPLE_DATA, SAMPLE_DATA

TESTS = Path(__file__).resolve().parent
# a path into the checkout's sample_data: `ROOT / "sample_data"` or a relative "sample_data/..." string (a test's
# own `tmp_path / "sample_data"` is its business)
CHECKOUT_PATH = re.compile(r"""(?<!tmp_path )/\s*["']sample_data["']|["']sample_data/""")


def test_no_test_names_the_checkouts_sample_data() -> None:
    offenders = [
        f"{path.relative_to(TESTS)}:{number}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name not in ("sample_paths.py", Path(__file__).name)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if CHECKOUT_PATH.search(line)
    ]
    assert offenders == [], "use sample_paths.SAMPLE_DATA: " + ", ".join(offenders)


def test_the_copy_holds_the_tracked_runs_and_no_recompute_outputs() -> None:
    assert SAMPLE_DATA != CHECKOUT_SAMPLE_DATA
    assert not SAMPLE_DATA.is_relative_to(CHECKOUT_SAMPLE_DATA.parent)
    for run in ("run_a", "run_b", "synthetic_a", "synthetic_b"):
        assert (SAMPLE_DATA / run / "pgdiag.json").is_file()
        assert not (SAMPLE_DATA / run / "logprobs").exists()
        assert not (SAMPLE_DATA / run / "reports").exists()
    assert (SAMPLE_DATA / "tiny-qwen" / "config.json").is_file()
