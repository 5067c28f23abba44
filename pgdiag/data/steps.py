"""Step selection: the ``--steps`` value (`parse_steps`, `StepSpec`), the filter it becomes on a run's steps,
and the E503 that names the steps present when it matches none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from pgdiag.errors import Code, UsageError


@dataclass(frozen=True)
class StepSpec:
    """A parsed ``--steps`` value: inclusive ranges plus the ``last`` keyword."""

    ranges: tuple[tuple[int, int], ...] = ()
    last: bool = False


def parse_steps(spec: str | Sequence[int]) -> StepSpec:
    """Parse ``N``, ``A-B`` (inclusive), comma lists and ``last`` (``"0-3,7,last"``); bad specs: UsageError E112."""
    if not isinstance(spec, str):
        return StepSpec(tuple((int(s), int(s)) for s in spec))
    ranges: list[tuple[int, int]] = []
    last = False
    for part in (p.strip() for p in spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if part == "last":
            last = True
        elif match:
            lo = int(match.group(1))
            hi = int(match.group(2)) if match.group(2) is not None else lo
            if hi < lo:
                raise UsageError(
                    Code.UNPARSABLE_OPTION,
                    f"--steps {spec!r}: range {part} is empty",
                    "write ranges as A-B with A <= B",
                )
            ranges.append((lo, hi))
        else:
            raise UsageError(
                Code.UNPARSABLE_OPTION,
                f"--steps {spec!r}: cannot parse {part!r}",
                "use N, A-B, comma lists or last",
            )
    return StepSpec(tuple(ranges), last)


def step_list(steps: Sequence[int]) -> str:
    """Steps in short form, consecutive ones as ranges: ``0-3, 7, 9-10``."""
    parts: list[str] = []
    for step in sorted(steps):
        if parts and step == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{step}"
        else:
            parts.append(str(step))
    return ", ".join(parts)


def check_steps_present(spec: StepSpec, base: pl.LazyFrame, given: str | Sequence[int]) -> None:
    """E503 listing the steps present when a ``--steps`` value (a step, or a whole range) matches no step."""
    if not spec.ranges:
        return
    try:
        present = base.select(pl.col("step").cast(pl.Int64).unique()).collect()["step"].drop_nulls().to_list()
    except pl.exceptions.PolarsError:
        return  # a step column that is not integers: the reader refuses it (E103) where it reads the steps
    absent = [(lo, hi) for lo, hi in spec.ranges if not any(lo <= step <= hi for step in present)]
    if absent:
        shown = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in absent)
        text = given if isinstance(given, str) else ",".join(str(s) for s in given)
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"--steps {text}: {shown} matches no step of the run",
            f"steps present: {step_list(present)}" if present else "the run holds no step",
        )


def step_condition(spec: StepSpec, base: pl.LazyFrame) -> pl.Expr:
    ranges = list(spec.ranges)
    if spec.last:
        last = base.select(pl.col("step").max()).collect().item()
        if last is not None:
            ranges.append((int(last), int(last)))
    if not ranges:
        return pl.lit(False)
    return pl.any_horizontal([pl.col("step").is_between(lo, hi) for lo, hi in ranges])
