"""`pgdiag.cli.bytecode_cache`: where PYTHONDONTWRITEBYTECODE is set and no cache is named, the CLI keeps the
bytecode it compiles under ~/.cache/pgdiag/pycache (for itself and its workers); otherwise it changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pgdiag.cli import bytecode_cache

REPO = Path(__file__).resolve().parents[2]


def test_cache_set_for_this_process_and_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    environ = {"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path)}
    root = bytecode_cache(environ)
    assert root == tmp_path / "pgdiag" / "pycache" and root.is_dir()
    assert sys.pycache_prefix == str(root) and sys.dont_write_bytecode is False
    assert environ == {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPYCACHEPREFIX": str(root)}


@pytest.mark.parametrize(
    ("flag", "environ"),
    [(False, {}), (True, {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/somewhere"})],
    ids=["bytecode_allowed", "cache_named_by_the_user"],
)
def test_nothing_changes_otherwise(flag: bool, environ: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", flag)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    before = dict(environ)
    assert bytecode_cache(environ) is None
    assert environ == before and sys.dont_write_bytecode is flag and sys.pycache_prefix is None


def test_a_process_under_the_flag_writes_its_bytecode_to_the_cache(tmp_path: Path) -> None:
    """The real thing: a fresh interpreter with PYTHONDONTWRITEBYTECODE=1 imports a module after the call; its
    .pyc lands under the cache (mirroring the source path), none beside the source."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "probe_module.py").write_text("VALUE = 41 + 1\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO)}  # fmt: skip
    env.pop("PYTHONPYCACHEPREFIX", None)
    code = (
        "import os, sys; from pgdiag.cli import bytecode_cache; bytecode_cache(os.environ); "
        f"sys.path.insert(0, {str(source)!r}); import probe_module; assert probe_module.VALUE == 42"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    cached = list((tmp_path / "cache" / "pgdiag" / "pycache").rglob("probe_module*.pyc"))
    assert len(cached) == 1
    assert not (source / "__pycache__").exists()
