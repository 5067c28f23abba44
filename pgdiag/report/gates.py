"""CI gates on report values: `--fail-on EXPR`, `--warn-on EXPR`, `--profile NAME` (docs/cli.md).

Grammar (whitespace ignored; quote it in the shell, `>` is a redirect)::

    gate   := [scope "."] [family "/"] stat op number
    scope  := token | tok | sequence | seq          (default token)
    op     := > | >= | < | <=
    number := decimal or exponent literal, or inf

A gate is evaluated on the ``breakdown = all`` rows of every pair of a report; any pair that triggers it triggers
it. A null value fails a `--fail-on` gate as ``missing``. Aliases: ``k1`` = ``kl_k1``, ``k3`` = ``kl_k3``,
``tau`` = ``tau_fit``, ``tau_dev`` = |tau_fit - 1|. A stat without a family is accepted when exactly one family has
it (in `compare` the default family is ``mismatch``). Profiles add gates; an explicit flag on the same name and
scope wins, and a profile gate whose metric the report lacks or could not compute is reported as ``skipped``
(the same in `metrics` and `compare`).
"""

from __future__ import annotations

import difflib
import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import polars as pl

from pgdiag.errors import EXIT_GATE, EXIT_OK, Code, UsageError
from pgdiag.report.report import Report

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_SCOPES = {"token": "token", "tok": "token", "sequence": "sequence", "seq": "sequence"}
_STAT_ALIASES = {"k1": "kl_k1", "k3": "kl_k3", "tau": "tau_fit"}
_GATE_RE = re.compile(
    r"^(?:(?P<scope>token|tok|sequence|seq)\.)?(?P<name>[A-Za-z0-9_./:-]+?)\s*(?P<op>>=|<=|>|<)\s*(?P<num>\S+)$"
)

# Profiles, with the sources their thresholds come from (docs/cli.md repeats them for users).
PROFILES: dict[str, tuple[tuple[str, str], ...]] = {
    # pgdiag's own recommendation
    "recommended": (
        ("fail", "mismatch/abs_mean>0.02"),
        ("fail", "mismatch/kl_k3>1e-2"),
        ("fail", "mismatch/tmpe>1.05"),
        ("fail", "mismatch/frac_out_2x>1e-3"),
        ("fail", "tau_dev>0.02"),
        ("warn", "mismatch/abs_mean>0.01"),
        ("warn", "mismatch/kl_k3>1e-3"),
    ),
    # NVIDIA-NeMo/RL docs/guides/grpo.md
    "nemo": (("fail", "mismatch/tmpe>1.05"), ("fail", "mismatch/kl_k3>1e-3")),
    # verl-project/verl docs/faq/faq.rst
    "verl": (("warn", "mismatch/abs_dprob_mean>0.005"), ("fail", "mismatch/abs_dprob_mean>0.01")),
    # THUDM/slime slime/utils/arguments.py
    "slime": (("fail", "mismatch/abs_mean>0.1"),),
    # slime's true-on-policy CI
    "deterministic": (("fail", "mismatch/abs_mean>1e-6"), ("fail", "policy/kl_k1>1e-8")),
    # bitwise agreement (`compare --exact`, verl-project/verl#7688: "not an epsilon threshold")
    "exact": (("fail", "exact/n_nonzero>0"), ("fail", "exact/mask_mismatch>0")),
}


@dataclass(frozen=True)
class Gate:
    """A parsed gate expression."""

    expr: str
    kind: str  # "fail" | "warn"
    scope: str  # "token" | "sequence"
    name: str  # as written, aliases resolved ("mismatch/kl_k3", "kl_k3", "tau_dev")
    op: str
    threshold: float
    from_profile: str | None = None


@dataclass(frozen=True)
class GateOutcome:
    """One gate evaluated on one pair (or on the report when no row matched)."""

    expr: str
    kind: str
    pair: str | None
    metric: str | None
    value: float | None
    status: (
        str  # "pass" | "fail" | "warn" | "missing" (explicit fail gate, no value) | "skipped" (profile gate)
    )


@dataclass(frozen=True)
class GateResult:
    """All gates of a command: overall status and exit code (0 pass, 1 a fail gate triggered or missing)."""

    status: str  # "pass" | "warn" | "fail"
    gates: tuple[GateOutcome, ...]
    exit_code: int


def parse_gate(expr: str, *, kind: str = "fail") -> Gate:
    """Parse one gate expression; UsageError on a malformed one."""
    text = "".join(expr.split())
    match = _GATE_RE.match(text)
    if not match:
        raise UsageError(
            Code.BAD_GATE,
            f"cannot parse gate {expr!r}",
            "write [scope.][family/]stat OP number, e.g. 'mismatch/kl_k3>1e-3' (quote it in the shell)",
        )
    try:
        threshold = float(match["num"])
    except ValueError:
        raise UsageError(Code.BAD_GATE, f"gate {expr!r}: {match['num']!r} is not a number") from None
    if math.isnan(threshold):
        raise UsageError(Code.BAD_GATE, f"gate {expr!r}: the threshold cannot be NaN")
    name = match["name"]
    family, _, stat = name.rpartition("/")
    stat = _STAT_ALIASES.get(stat, stat)
    name = f"{family}/{stat}" if family else stat
    return Gate(expr, kind, _SCOPES[match["scope"] or "token"], name, match["op"], threshold)


def _resolve(gate: Gate, known: Sequence[str], default_family: str | None) -> list[str] | None:
    """Metric keys the gate refers to; None when the name is unknown everywhere."""
    gate_name = "tau_fit" if gate.name == "tau_dev" else gate.name
    if "/" in gate_name:
        return [gate_name] if gate_name in known else None
    hits = [k for k in known if k.rpartition("/")[2] == gate_name]
    if default_family is not None and f"{default_family}/{gate_name}" in hits:
        return [f"{default_family}/{gate_name}"]
    if len(hits) > 1:
        raise UsageError(
            Code.BAD_GATE,
            f"gate {gate.expr!r}: {gate_name!r} is in several families ({', '.join(sorted(hits))})",
            "qualify it, e.g. " + sorted(hits)[0],
        )
    return hits or None


def _closest_by_stat(name: str, known: Sequence[str]) -> list[str]:
    """The known key whose stat (the part after ``/``) is closest to `name`'s, as a whole key
    (``policy/kl_k33`` on a compare report: ``mismatch/kl_k3``); empty when none is close."""
    by_stat: dict[str, str] = {}
    for key in known:
        by_stat.setdefault(key.rpartition("/")[2], key)
    close = difflib.get_close_matches(name.rpartition("/")[2], list(by_stat), n=1)
    return [by_stat[close[0]]] if close else []


def evaluate_gates(
    report: Report,
    *,
    fail_on: Iterable[str] = (),
    warn_on: Iterable[str] = (),
    profile: str | None = None,
    default_family: str | None = None,
    known_metrics: Iterable[str] = (),
    profile_kinds: tuple[str, ...] = ("fail", "warn"),
) -> GateResult:
    """Evaluate gates on the ``breakdown = all`` rows of `report` (of `profile`, the gates of `profile_kinds`).

    `known_metrics` adds names that are valid but may be absent from this report (they evaluate as missing);
    anything else unknown is a UsageError with a suggestion.
    """
    explicit = [parse_gate(e, kind="fail") for e in fail_on] + [parse_gate(e, kind="warn") for e in warn_on]
    rows = report.summary.filter(pl.col("breakdown") == "all")
    present = rows["metric"].unique(maintain_order=True).to_list()
    known = list(dict.fromkeys([*present, *known_metrics]))

    gates: list[tuple[Gate, list[str] | None]] = []
    for gate in explicit:
        keys = _resolve(gate, known, default_family)
        if keys is None:
            close = difflib.get_close_matches(gate.name, known, n=1) or _closest_by_stat(gate.name, known)
            hint = f"did you mean {close[0]!r}?" if close else "see `pgdiag metrics --help` for metric names"
            raise UsageError(Code.BAD_GATE, f"gate {gate.expr!r}: unknown metric {gate.name!r}", hint)
        gates.append((gate, keys))
    if profile is not None:
        if profile not in PROFILES:
            raise UsageError(
                Code.BAD_GATE, f"unknown profile {profile!r}", f"choose one of {', '.join(PROFILES)}"
            )
        taken = {(g.name, g.scope, g.kind) for g in explicit}
        for kind, expr in PROFILES[profile]:
            if kind not in profile_kinds:
                continue
            gate = parse_gate(expr, kind=kind)
            gate = Gate(gate.expr, kind, gate.scope, gate.name, gate.op, gate.threshold, profile)
            if (gate.name, gate.scope, gate.kind) in taken:
                continue
            at_scope = rows.filter(pl.col("scope") == gate.scope)["metric"].unique().to_list()
            gates.append((gate, _resolve(gate, at_scope, default_family)))

    outcomes: list[GateOutcome] = []
    for gate, keys in gates:
        compare = _OPS[gate.op]
        # a value the report lacks: an explicit fail gate fails as `missing`; a profile gate is `skipped`
        absent = "skipped" if gate.from_profile else ("missing" if gate.kind == "fail" else "pass")
        cells = rows.filter(pl.col("metric").is_in(keys or []) & (pl.col("scope") == gate.scope))
        if cells.height == 0:
            outcomes.append(GateOutcome(gate.expr, gate.kind, None, (keys or [None])[0], None, absent))
            continue
        for pair, metric, value in cells.select("pair", "metric", "value").iter_rows():
            if value is not None and gate.name == "tau_dev":
                value = abs(value - 1.0)
            if value is None:
                status = absent
            elif compare(value, gate.threshold):
                status = gate.kind
            else:
                status = "pass"
            outcomes.append(GateOutcome(gate.expr, gate.kind, pair, metric, value, status))

    failed = any(o.status in ("fail", "missing") for o in outcomes)
    warned = any(o.status == "warn" for o in outcomes)
    status = "fail" if failed else ("warn" if warned else "pass")
    return GateResult(status, tuple(outcomes), EXIT_GATE if failed else EXIT_OK)


@dataclass(frozen=True)
class GateSettings:
    """The user's gates and exit rule: `--fail-on`, `--warn-on`, `--profile`, `--strict`, `--exit-zero`."""

    fail_on: tuple[str, ...] = ()
    warn_on: tuple[str, ...] = ()
    profile: str | None = None
    strict: bool = False  # a check warning exits 1
    exit_zero: bool = False  # a triggered gate exits 0 (the status stays "fail")

    def __post_init__(self) -> None:
        object.__setattr__(self, "fail_on", tuple(self.fail_on))
        object.__setattr__(self, "warn_on", tuple(self.warn_on))
        for expr in (*self.fail_on, *self.warn_on):
            parse_gate(expr)
        if self.profile is not None and self.profile not in PROFILES:
            raise UsageError(
                Code.BAD_GATE, f"unknown profile {self.profile!r}", f"choose one of {', '.join(PROFILES)}"
            )

    @property
    def given(self) -> bool:
        """Whether the user gave any gate or profile."""
        return bool(self.fail_on or self.warn_on or self.profile)


def gate_policy(
    *,
    fail_on: Sequence[str] = (),
    default_family: str | None = None,
    known_metrics: Sequence[str] = (),
    default_profile: str | None = None,
) -> dict[str, object]:
    """The gates a command always applies, kept in `Report.meta["gate_policy"]` so `outcome` (and a saved
    report loaded later) applies them too: default fail gates, the family of a bare stat name, metric names
    that are valid although this report may lack them, and the profile whose fail gates apply when the user
    gives no gate (compare: ``recommended``)."""
    return {
        "fail_on": list(fail_on),
        "default_family": default_family,
        "known_metrics": list(known_metrics),
        "default_profile": default_profile,
    }


@dataclass(frozen=True)
class Outcome:
    """The verdict of one command: status, exit code and every gate outcome."""

    status: str  # "ok" | "fail"
    exit_code: int  # 0 ok, 1 a fail gate triggered (or a check warning under strict), unless exit_zero
    gates: GateResult


def outcome(report: Report, settings: GateSettings | None = None) -> Outcome:
    """Gates of `settings` plus the report's own default gates, and the status and exit-code rule of the CLI.

    Without any gate or profile, the fail gates of the report's default profile apply (compare: ``recommended``).
    Exit 1 when a fail gate triggers (or a gate on a metric that could not be computed, `missing`) or, under
    `strict`, when the checks found a warning; `exit_zero` turns that 1 into 0 and leaves the status "fail".
    """
    settings = settings or GateSettings()
    policy = report.meta.get("gate_policy") or gate_policy()
    fallback = None if settings.given else policy.get("default_profile")
    gates = evaluate_gates(
        report,
        fail_on=[*settings.fail_on, *policy["fail_on"]],
        warn_on=settings.warn_on,
        profile=fallback or settings.profile,
        default_family=policy["default_family"],
        known_metrics=policy["known_metrics"],
        profile_kinds=("fail",) if fallback else ("fail", "warn"),
    )
    exit_code = gates.exit_code
    if settings.strict and report.checks.filter(pl.col("severity") == "warning").height:
        exit_code = EXIT_GATE
    status = "ok" if exit_code == EXIT_OK else "fail"
    if settings.exit_zero and exit_code == EXIT_GATE:
        exit_code = EXIT_OK
    return Outcome(status, exit_code, gates)
