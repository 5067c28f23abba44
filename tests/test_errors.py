"""The code catalogue (`pgdiag.errors.Code`): every code written in pgdiag is catalogued with one meaning and is
raised with the class of its exit code, docs/cli.md's table repeats the catalogue, and every command, option and
`--by` value a hint names exists in the CLI."""

from __future__ import annotations

import ast
import re
import typing
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import pytest
import typer.main

from pgdiag.cli.app import build_app
from pgdiag.errors import EXIT_INVALID, EXIT_OK, EXIT_USAGE, Code, InvalidInputError, PgdiagError, UsageError

ROOT = Path(__file__).resolve().parent.parent
CODE = re.compile(r"\b[EW]\d{3}\b")
CODE_MEMBER = re.compile(r"\bCode\.([A-Z][A-Z0-9_]*)\b")
ERROR_CLASSES = {"UsageError": UsageError, "InvalidInputError": InvalidInputError, "PgdiagError": PgdiagError}


def _sources() -> Iterator[tuple[Path, str]]:
    for path in sorted((ROOT / "pgdiag").rglob("*.py")):
        yield path, path.read_text(encoding="utf-8")


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _text(node: ast.expr | None) -> str | None:
    """A string constant, an f-string with ``{}`` for its fields, or a concatenation of those; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return None


def _hints() -> Iterator[tuple[str, str]]:
    """(where, hint text) of every hint given to an error or an `Issue`, and of the hint tables."""
    for path, source in _sources():
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and _name(node.func) in (*ERROR_CLASSES, "Issue"):
                position = 2 if _name(node.func) in ERROR_CLASSES else 7
                args = [
                    *node.args[position : position + 1],
                    *(k.value for k in node.keywords if k.arg == "hint"),
                ]
                for arg in args:
                    if (text := _text(arg)) is not None:
                        yield f"{where}:{node.lineno}", text
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id.endswith("HINTS") for t in node.targets
            ):
                for value in node.value.values if isinstance(node.value, ast.Dict) else ():
                    if (text := _text(value)) is not None:
                        yield f"{where}:{value.lineno}", text


def _cli() -> dict:
    """Command name -> the registered command, as Typer builds it."""
    return dict(typer.main.get_command(build_app()).commands)


def _options(command: typing.Any) -> dict:
    return {opt: p for p in command.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")}


def _choices(param: typing.Any) -> set[str] | None:
    """The values an option accepts when its annotation is an Enum (or a list/optional of one), else None."""
    stack = [param.type_descriptor.annotation]
    while stack:
        annotation = stack.pop()
        if isinstance(annotation, type) and issubclass(annotation, Enum):
            return {str(member.value) for member in annotation}
        stack.extend(typing.get_args(annotation))
    return None


def test_every_code_written_in_pgdiag_is_catalogued() -> None:
    written = {code for _, source in _sources() for code in CODE.findall(source)}
    assert written, "the scan found no codes"
    assert written - {c.value for c in Code} == set()
    # and nothing in the catalogue is dead: every code is written somewhere outside errors.py
    outside = {
        code for path, source in _sources() if path.name != "errors.py" for code in CODE.findall(source)
    }
    members = {
        Code[name].value
        for path, source in _sources()
        if path.name != "errors.py"
        for name in CODE_MEMBER.findall(source)
        if name in Code.__members__
    }  # a raise site that names its code as a `Code` member writes it too
    outside |= members
    assert {c.value for c in Code} - outside == set()


def test_catalogue_has_one_meaning_per_code_and_the_exit_code_of_its_kind() -> None:
    assert len(Code.__members__) == len(Code)  # no aliases: two names never share a code
    assert len({c.meaning for c in Code}) == len(Code)
    for code in Code:
        if code.startswith("W"):
            assert code.exit_code == EXIT_OK, code
        elif (code[1] in "123" and not code.startswith("E11")) or code == "E703":
            assert code.exit_code == EXIT_INVALID, code  # the data is invalid (a rollout or a dump file)
        else:
            assert code.exit_code == EXIT_USAGE, (
                code
            )  # options, files, checkpoints, unsafe or text-only dumps


def test_every_raise_site_uses_the_class_of_its_codes_exit_code() -> None:
    sites = 0
    for path, source in _sources():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and _name(node.func) in ERROR_CLASSES and node.args:
                first = node.args[0]
                code = _text(first)
                if isinstance(first, ast.Attribute) and _name(first.value) == "Code":
                    code = Code[first.attr].value  # raised with a `Code` member
                if code is None:
                    continue  # re-raised issue codes, checked when the Issue was built
                sites += 1
                cls = ERROR_CLASSES[_name(node.func)]
                assert Code(code).exit_code == cls.exit_code, f"{path.relative_to(ROOT)}:{node.lineno} {code}"
    assert sites > 150


def test_errors_refuse_codes_outside_the_catalogue_and_the_wrong_class() -> None:
    assert UsageError(Code.BAD_OPTION_VALUE, "x").code == "E503"
    assert InvalidInputError("E201", "x").exit_code == EXIT_INVALID
    with pytest.raises(ValueError, match="not a pgdiag error"):
        UsageError("bad-flag", "x")
    with pytest.raises(ValueError, match="E201 exits 3"):
        UsageError("E201", "x")
    from pgdiag.data.validate import Issue

    with pytest.raises(ValueError, match="E999"):
        Issue("E999", "error", 1, "x")


def test_docs_cli_table_repeats_the_catalogue() -> None:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| ([EW]\d{3}) \| (\d+) \| (.+?) \|$", text, flags=re.MULTILINE)
    documented = {code: (int(exit_code), meaning) for code, exit_code, meaning in rows}
    assert len(documented) == len(rows)
    expected = {c.value: (c.exit_code, c.meaning.replace("|", "\\|")) for c in Code}
    assert documented == expected


def test_every_command_option_and_breakdown_named_in_a_hint_exists() -> None:
    commands = _cli()
    every_option = {opt: p for command in commands.values() for opt, p in _options(command).items()}
    hints = list(_hints())
    assert len(hints) > 40
    checked = 0
    for where, hint in hints:
        for clause in re.split(
            r"[,;]", hint
        ):  # an option belongs to the command named before it in its clause
            named = re.findall(r"\bpgdiag ([a-z][a-z-]*)", clause)
            for name in named:
                assert name in commands, f"{where}: hint names `pgdiag {name}`: {hint!r}"
            options = _options(commands[named[-1]]) if named else every_option
            for option, value in re.findall(r"(--[a-z][a-z0-9-]*)(?:[ =]([A-Za-z_][\w-]*))?", clause):
                assert option in options, (
                    f"{where}: hint names {option}, not an option of {named or 'any command'}"
                )
                choices = _choices(options[option])
                if value and choices is not None:
                    assert value in choices, f"{where}: {option} does not accept {value!r}: {hint!r}"
                checked += 1
    assert checked > 10


def test_by_choices_are_the_breakdowns() -> None:
    """The `--by` value check above relies on `--by` being a choice of the breakdown names."""
    from pgdiag.compare.breakdowns import BREAKDOWNS

    assert _choices(_options(_cli()["compare"])["--by"]) == set(BREAKDOWNS)
    assert _choices(_options(_cli()["compare"])["--stream-a"]) is None
