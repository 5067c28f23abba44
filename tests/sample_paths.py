"""`SAMPLE_DATA`: a clean copy of the repository's `sample_data/`, made once per test process.

The README's own loop writes recompute tags (`run_a/logprobs/`) and reports into the checkout's `sample_data/`
(ignored by git). A test that read the checkout would then see a state no fresh clone has, so every test reads
this copy instead: the tracked files only, `logprobs/` and `reports/` left out. The copy goes when the process
ends. `tests/test_layout.py` refuses a test that names the checkout's `sample_data/` directly.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

CHECKOUT_SAMPLE_DATA = Path(__file__).resolve().parents[1] / "sample_data"


def _clean_copy() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pgdiag-sample-data-"))
    root.chmod(0o755)  # readable by others, as the checkout is: the permission tests run commands as `nobody`
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    target = root / "sample_data"
    shutil.copytree(
        CHECKOUT_SAMPLE_DATA,
        target,
        ignore=shutil.ignore_patterns("logprobs", "reports", "__pycache__", ".*"),
    )
    return target


SAMPLE_DATA = _clean_copy()
SAMPLE_CWD = SAMPLE_DATA.parent  # a working directory whose `sample_data/` is the copy (for relative paths)
