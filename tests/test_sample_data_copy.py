"""Tests read a clean copy of `sample_data/` (tests/sample_paths.py), never the checkout's, whose ignored
`logprobs/` and `reports/` the README's own loop fills."""

from __future__ import annotations

import re
from pathlib import Path

from sample_paths import CHECKOUT_SAMPLE_DATA, SAMPLE_DATA

TESTS = Path(__file__).resolve().parent
# a path into the checkout's sample_data: `ROOT / "sample_data"` (a test's own `tmp_path / "sample_data"` is its
# business), or relative "sample_data/..." paths read from the checkout as working directory
CHECKOUT_PATH = re.compile(r"""(?<!tmp_path )/\s*["']sample_data["']|Path\(["']sample_data""")
CHECKOUT_CWD = re.compile(r"chdir\((ROOT|REPO)\)|cwd=(ROOT|REPO)\b")
# make_golden copies only the tracked rollouts and footers of the checkout's runs (tests/golden/make_golden.py)
ALLOWED = {"sample_paths.py", "test_sample_data_copy.py", "make_golden.py"}


def test_no_test_names_the_checkouts_sample_data() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name in ALLOWED:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if CHECKOUT_PATH.search(line) or ("sample_data/" in text and CHECKOUT_CWD.search(line)):
                offenders.append(f"{path.relative_to(TESTS)}:{number}")
    assert offenders == [], "use sample_paths.SAMPLE_DATA or SAMPLE_CWD: " + ", ".join(offenders)


def test_the_copy_holds_the_tracked_runs_and_no_recompute_outputs() -> None:
    assert SAMPLE_DATA != CHECKOUT_SAMPLE_DATA
    assert not SAMPLE_DATA.is_relative_to(CHECKOUT_SAMPLE_DATA.parent)
    for run in ("run_a", "run_b", "synthetic_a", "synthetic_b"):
        assert (SAMPLE_DATA / run / "pgdiag.json").is_file()
        assert not (SAMPLE_DATA / run / "logprobs").exists()
        assert not (SAMPLE_DATA / run / "reports").exists()
    assert (SAMPLE_DATA / "tiny-qwen" / "config.json").is_file()
