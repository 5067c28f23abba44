"""The README and docs stay true: the Python API block runs, CI installs and tests exactly as the README says,
and every CLI command is documented (the sqlite-utils pattern)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pgdiag.cli.app import build_app

ROOT = Path(__file__).resolve().parent.parent


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def test_readme_python_block_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (block,) = _blocks((ROOT / "README.md").read_text(), "python")
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(compile(block.replace("/tmp/parity-api", str(tmp_path / "parity")), "README.md", "exec"), namespace)
    report = namespace["report"]
    assert report.value("loss/pg") == report.value("loss/constant") is not None
    assert (tmp_path / "parity" / "compare.parquet").exists()


def test_ci_runs_the_readme_setup_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = _blocks(readme.split("## Set up", 1)[1], "bash")[0].strip().splitlines()
    assert len(setup) == 2, setup  # exactly two set-up commands: install; run the tests
    install, run_tests = setup
    # the install command creates and activates a virtual environment, then installs into it
    assert re.fullmatch(r"python3 -m venv (\S+) && source \1/bin/activate && pip install .+", install), (
        install
    )
    assert run_tests == "python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in setup:
        assert command in ci, command
    # and CI does exactly that: no environment or install of its own beside the README's (apt-get for system
    # packages aside), and the lint and tests run after the install, inside its environment
    own = [
        line
        for line in ci
        if not line.startswith("#") and re.search(r"\bvenv\b|activate|pip install", line) and line != install
    ]
    assert not own, own
    assert ci.index(install) < ci.index(run_tests)
    assert ci.index(install) < ci.index("ruff check .")


def test_every_command_is_documented() -> None:
    app = build_app()
    names = [c.name for c in app.registered_commands if not c.hidden]
    assert {"check", "metrics", "compare", "plot", "logprobs"} <= set(names)
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    for name in names:
        assert f"pgdiag {name}" in cli_doc, name
