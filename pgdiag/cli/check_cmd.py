"""`pgdiag check RUN [RUN_B]`: schema validation and alignment checks, the gate before any number is printed.

Thin shell over `pgdiag.checks.run.check_run` (docs/cli.md): the findings on stderr, the verdict on stdout. Exit 0
when clean (warnings allowed), 1 for warnings under `--strict`, 3 for any error.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from pgdiag.cli.common import Screen, execute, result_object
from pgdiag.cli.options import STREAMS, CheckOptions, Fields, RunArg, RunInputs, StrictOpt, option
from pgdiag.cli.outputs import OutputSettings

HELP = """Validate rollouts against [bold]pgdiag.rollouts/v1[/] and check stream alignment.

Runs every schema rule (lengths, masks, nulls on loss positions, NaN/inf, positive or zero-filled
log-probs, duplicate ids, seq_hash, empty masks, ...) and the semantic checks on every stream pair that
includes rollout: off-by-one shifts (offsets 0 and +-1), zero fills, tempering and processed-logprob hints.
Each finding is one line on stderr naming file, step, sample and column; the verdict goes to stdout. Exit 0
clean, 1 warnings with --strict, 3 errors.
"""

StreamsOpt = Annotated[
    str | None,
    option("--streams", "Check this stream pair, 'A,B' (default: every pair with rollout).", STREAMS),
]
VocabSizeOpt = Annotated[
    int | None,
    option("--vocab-size", "Enable the token-id range check (E208).", STREAMS, min=1),
]


def check(
    run: RunArg,
    run_b: Annotated[str | None, typer.Argument(help="A second run to check alignment against.")] = None,
    *,
    inputs: RunInputs,
    streams: StreamsOpt = None,
    vocab_size: VocabSizeOpt = None,
    check: CheckOptions,
    strict: StrictOpt = False,
    output: Annotated[OutputSettings, Fields("json_out", "quiet", "verbose")],
) -> None:
    """The `check` command (help: `HELP`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.checks.run import check_run
        from pgdiag.cli.render import render_checks, render_verdict
        from pgdiag.errors import Code, UsageError
        from pgdiag.report.verdict import check_verdict

        pair = None
        if streams is not None:
            pair = [s.strip() for s in streams.split(",")]
            if len(pair) != 2 or not all(pair):
                raise UsageError(
                    Code.UNPARSABLE_OPTION, f"--streams {streams!r}: give two stream names, 'A,B'"
                )
        source = inputs.read(run)
        other = inputs.read(run_b, first=False) if run_b is not None else None
        settings = check.settings()
        result = check_run(
            source, other, streams=pair, ignore=settings.ignore, max_examples=settings.max_examples,
            vocab_size=vocab_size, strict=strict,
        )  # fmt: skip
        render_checks(screen.notes, result.issues, result.hints)
        verdict = check_verdict(result)
        render_verdict(screen.results, verdict)
        return result_object(
            "check",
            status="ok" if result.exit_code == 0 else ("fail" if result.exit_code == 1 else "error"),
            exit_code=result.exit_code,
            inputs={
                "runs": [source.label] + ([other.label] if other is not None else []),
                "streams": list(source.streams),
            },
            checks=result.issues.to_dicts(),
            verdict=verdict.as_dict(),
        )

    execute("check", body, json_out=output.json_out, quiet=output.quiet)
