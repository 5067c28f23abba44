"""The layout rules as code: which stage of pgdiag/ may import which, and what the top of pgdiag/ holds.

Every ``import``/``from ... import`` in pgdiag/ (also those inside functions) is parsed. Arrows point down only:
`cli` -> every stage; `compare` -> checks, metrics, report, data (and recompute, whose `loss_logits` gives the exact
temperature fit its logits); `explain` -> recompute, model, kernels, compare, checks, metrics, report, data; `recompute` -> model, kernels, data; `metrics`, `checks`, `importers` -> report, data; `model`, `kernels`
-> errors only (never polars); `data` -> errors only (never torch). Only `cli/` imports typer and rich; only
`report/plots.py`, `report/explain_plots.py` and `report/html.py` import matplotlib. ``import pgdiag`` (the version) is allowed everywhere,
and so are `pgdiag.errors` and `pgdiag.atomic_files` (atomic file writes: `data` and the in-trainer `capture` hooks
share them, and `capture` must not pull polars in through `data`).

Who may import `checks`: `compare`, `analysis`, `explain` and `cli`, never `metrics` or `data`. So the issue model
(`data/issues.py`: `Issue`, `CheckSettings`, `CheckResult` and their merge over pieces) and every rule the reader
applies to each piece it reads (`data/validate.py` over `row_rules`, `token_rules` and `stream_rules`,
`data/run_rules.py` run-level zero fills, `data/token_issues.py` E206 against the paired stream) live in `data`,
the one stage every other may import; `checks` holds the cross-stream and cross-run rules (shifts, signatures,
matching of two runs) on top of it.

Within a stage no module imports another that imports it back, counting imports inside functions (not
``if TYPE_CHECKING:`` blocks, which never run); command bodies in `cli/` stay under 80 lines, functions in
``*/api.py`` too, and modules under 500 lines (tables excepted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pgdiag"

# stage -> the pgdiag stages it may import (besides itself); `errors` and `atomic_files` are importable by everyone
EVERYONE = {"errors", "atomic_files"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "atomic_files": set(),
    "data": set(),
    "model": set(),
    "kernels": set(),
    "report": {"data"},
    "checks": {"report", "data"},
    "metrics": {"report", "data"},
    "importers": {"report", "data"},
    "analysis": {"report", "data", "metrics", "checks"},
    "recompute": {"model", "kernels", "data"},
    "compare": {"checks", "metrics", "report", "data", "recompute"},  # recompute: logits for `compare/tau.py`
    "explain": {"recompute", "model", "kernels", "compare", "checks", "metrics", "report", "data"},
    "capture": {"data", "importers"},  # the in-trainer hooks and the Fast-LLM stream capture
    "cli": {"*"},
    "__init__": {"*"},
    "__main__": {"cli"},
}
THIRD_PARTY_ONLY_IN = {
    "typer": {"cli"},
    "rich": {"cli"},
    "matplotlib": {"report/plots.py", "report/html.py", "report/explain_plots.py"},
}
NEVER_IN = {"model": {"polars"}, "kernels": {"polars"}, "data": {"torch"}}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _stage(root: Path, path: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def violations(root: Path) -> list[str]:
    """Every import under `root` (a pgdiag/ tree) that breaks a rule, as ``"file imports name"``."""
    wrong = []
    for path in sorted(root.rglob("*.py")):
        stage, rel = _stage(root, path), path.relative_to(root).as_posix()
        if stage not in ALLOWED:
            wrong.append(f"{rel}: stage {stage!r} has no import rule")
            continue
        allowed = ALLOWED[stage]
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "pgdiag":
                target = name.split(".")[1] if "." in name else "__init__"
                if (
                    target not in (stage, "__init__", *EVERYONE)
                    and "*" not in allowed
                    and target not in allowed
                ):
                    wrong.append(f"{rel} imports {name}")
            for package, where in THIRD_PARTY_ONLY_IN.items():
                if top == package and stage not in where and rel not in where:
                    wrong.append(f"{rel} imports {name}")
            if top in NEVER_IN.get(stage, set()):
                wrong.append(f"{rel} imports {name}")
    return wrong


def test_no_stage_imports_one_above_it() -> None:
    assert violations(PKG) == []


def test_the_rules_catch_upward_and_forbidden_imports(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.py").write_text(
        "import numpy\nfrom pgdiag.data import batch\n\ndef f():\n    from pgdiag.compare.api import compare_runs\n"
    )
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "y.py").write_text("import rich\nfrom pgdiag.report import report\n")
    assert violations(tmp_path) == ["data/x.py imports pgdiag.compare.api", "metrics/y.py imports rich"]


def test_top_of_pgdiag_holds_at_most_four_files() -> None:
    files = sorted(p.name for p in PKG.iterdir() if p.is_file() and p.suffix == ".py")
    assert len(files) <= 4, files


API_FUNCTION_LINES = 80  # a library entry point is a short loop over the reader and a fold
# api functions over the limit, at their size when the rule came: each may only shrink (a fold of its own to come)
API_TO_SPLIT: dict[str, int] = {}
MODULE_LINES = 500
TABLES = {"metrics/catalog.py", "errors.py", "report/plots.py"}  # tables of entries, one job each
# Modules over MODULE_LINES that issue 21 still has to split, at their size when the rule came: each may only
# shrink, and leaves this list once it is under the limit.
TO_SPLIT: dict[str, int] = {}


def long_api_functions(root: Path) -> list[str]:
    """Every function of a ``*/api.py`` under `root` longer than `API_FUNCTION_LINES` lines (with its
    signature; one of `API_TO_SPLIT` only once it grew), as ``"file:function N lines"``."""
    long = []
    for path in sorted(root.rglob("api.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                where = f"{path.relative_to(root).as_posix()}:{node.name}"
                if lines > max(API_FUNCTION_LINES, API_TO_SPLIT.get(where, 0)):
                    long.append(f"{where} {lines} lines")
    return long


def long_modules(root: Path) -> list[str]:
    """Every module under `root` over `MODULE_LINES` lines, save the tables, and every module of `TO_SPLIT` that
    grew, as ``"file N lines"``."""
    long = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        lines = len(path.read_text().splitlines())
        if rel not in TABLES and lines > max(MODULE_LINES, TO_SPLIT.get(rel, 0)):
            long.append(f"{rel} {lines} lines")
    return long


def test_no_api_function_is_over_80_lines() -> None:
    assert long_api_functions(PKG) == []


def test_no_module_is_over_500_lines() -> None:
    assert long_modules(PKG) == []
    # a module of the list that got under the limit leaves it
    assert [rel for rel in TO_SPLIT if len((PKG / rel).read_text().splitlines()) <= MODULE_LINES] == []


def test_the_size_rules_catch_long_functions_and_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "metrics").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "metrics" / "api.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    (tmp_path / "metrics" / "big.py").write_text("x = 1\n" * 501)
    (tmp_path / "errors.py").write_text("x = 1\n" * 600)
    (tmp_path / "report").mkdir()
    monkeypatch.setitem(TO_SPLIT, "report/html.py", 600)  # a module of the list (whatever it holds today)
    (tmp_path / "report" / "html.py").write_text("x = 1\n" * 601)  # that grew
    (tmp_path / "report" / "plots.py").write_text("x = 1\n" * 550)  # a table
    assert long_api_functions(tmp_path) == ["metrics/api.py:long 81 lines"]
    assert long_modules(tmp_path) == ["metrics/big.py 501 lines", "report/html.py 601 lines"]


COMMAND_BODY_LINES = 80  # parse, settings, one library call, outcome, render


def long_command_bodies(root: Path) -> list[str]:
    """Every command body in `root`/cli (a top-level function that runs `execute(...)`, with its signature)
    longer than `COMMAND_BODY_LINES` lines, as ``"file:function N lines"``."""
    long = []
    for path in sorted((root / "cli").glob("*.py")):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            calls = {
                c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
            }
            lines = node.end_lineno - node.lineno + 1 + len(node.decorator_list)
            if "execute" in calls and lines > COMMAND_BODY_LINES:
                long.append(f"cli/{path.name}:{node.name} {lines} lines")
    return long


def test_no_command_body_is_over_80_lines() -> None:
    assert long_command_bodies(PKG) == []


def test_the_body_rule_catches_a_long_command(tmp_path: Path) -> None:
    (tmp_path / "cli").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "cli" / "x_cmd.py").write_text(
        f"def short():\n    execute()\n\n\ndef long():\n{body}\n    execute()\n"
    )
    assert long_command_bodies(tmp_path) == ["cli/x_cmd.py:long 82 lines"]


def _runtime_imports(path: Path) -> list[str]:
    """The pgdiag modules `path` imports when it runs: top level and inside functions (``if TYPE_CHECKING:``
    blocks, which never run, left out); a relative import is not used in pgdiag."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]  # `from pkg import module`
    return [n for n in names if n.startswith("pgdiag.")]


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("pgdiag", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_cycles(root: Path) -> list[list[str]]:
    """Import cycles among the modules of one stage (a module importing a package's submodule also runs the
    package's ``__init__``), each as the list of modules around it, smallest first; imports inside functions count."""
    modules = {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        stage = name.split(".")[1] if "." in name else ""
        targets: set[str] = set()
        for imported in _runtime_imports(path):
            parts = imported.split(".")
            for i in range(2, len(parts) + 1):  # pgdiag.a.b.c runs pgdiag.a, pgdiag.a.b, pgdiag.a.b.c
                module = ".".join(parts[:i])
                if module in modules and module != name and module.split(".")[1] == stage:
                    targets.add(module)
        # a submodule's own package __init__ runs first, not as an import of the submodule
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycle_within_a_stage() -> None:
    assert import_cycles(PKG) == []


def test_the_cycle_rule_counts_imports_inside_functions(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "a.py").write_text("from pgdiag.metrics.b import x\n")
    (tmp_path / "metrics" / "b.py").write_text("def f():\n    from pgdiag.metrics import a\n")
    (tmp_path / "metrics" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pgdiag.metrics.a import y\n"
    )
    assert import_cycles(tmp_path) == [["pgdiag.metrics.a", "pgdiag.metrics.b"]]
