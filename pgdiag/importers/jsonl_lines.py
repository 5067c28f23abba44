"""JSON-lines files that frameworks append to while training (PipelineRL streams, Fast-LLM captures).

A writer that appends in place can leave a last line without its newline: that file is torn (E703), never
read as if complete. Each line is parsed with the standard json module; a line that is not JSON is E703 naming
the file and the 1-based line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pgdiag.importers.base import bad_layout


def read_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed value) of every non-empty line of `path`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise bad_layout(path, "file", f"a readable file ({exc.strerror})") from exc
    if data and not data.endswith(b"\n"):
        n_lines = data.count(b"\n") + 1
        raise bad_layout(
            path, f"line {n_lines}", "a newline at the end of the last line (file torn while written?)"
        )
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_layout(path, f"line {number}", f"one JSON value ({exc})") from exc
