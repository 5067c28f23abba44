"""docs/notebook.md: every ```python block runs, in order, in one namespace, against the sample runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import polars as pl
from sample_paths import SAMPLE_DATA

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "notebook.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_notebook_doc_runs(tmp_path) -> None:
    blocks = python_blocks(DOC.read_text(encoding="utf-8"))
    assert len(blocks) >= 10
    (tmp_path / "sample_data").symlink_to(SAMPLE_DATA)
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"{DOC.name}[block {i}]", "exec"), namespace)
    finally:
        os.chdir(cwd)
    # the walk-through produced what it describes
    assert (tmp_path / "reports" / "ab" / "compare.parquet").exists()
    assert (tmp_path / "reports" / "ab" / "worst-trace.png").stat().st_size > 1000
    by_position = namespace["by_position"]
    assert isinstance(by_position, pl.DataFrame) and by_position["bucket"][0] == "0"
    assert namespace["k3"] > 0
    assert namespace["verdict"].status in ("ok", "fail") and namespace["verdict"].exit_code in (0, 1)
