"""docs/import.md and docs/schema.md stay true: their Python blocks run, every preset has a section."""

from __future__ import annotations

import re

import pytest

from pgdiag.importers.base import PRESET_MODULES
from tests.importers.conftest import REPO

HEADINGS = {
    "verl": "## verl\n",
    "trl": "## TRL\n",
    "nemo-rl": "## NeMo-RL\n",
    "slime": "## slime\n",
    "miles": "## miles\n",
    "skyrl": "## SkyRL\n",
    "prime-rl": "## prime-rl\n",
    "openrlhf": "## OpenRLHF\n",
    "pipelinerl": "## PipelineRL\n",
    "fast-llm": "## Fast-LLM\n",
    "verl-jsonl": "## verl rollout JSONL (`verl-jsonl`)\n",
    "canonical": "## Your own format (`canonical`, `pgdiag.write_run`)\n",
}


def _python_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "docs" / name).read_text(), flags=re.DOTALL)


def test_every_preset_has_a_section():
    text = (REPO / "docs" / "import.md").read_text()
    assert set(HEADINGS) == set(PRESET_MODULES)
    for preset, heading in HEADINGS.items():
        assert heading in text, preset


@pytest.mark.parametrize("doc", ["import.md", "schema.md"])
def test_python_blocks_run(doc, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    blocks = _python_blocks(doc)
    assert blocks
    for block in blocks:
        exec(compile(block.replace("/tmp/pgdiag-mine", str(tmp_path / "mine")), doc, "exec"), {})
    out = capsys.readouterr().out
    if doc == "import.md":
        assert "2 5" in out and (tmp_path / "mine" / "pgdiag.json").exists()
    else:
        assert "abs_dlogp_mean" in out
