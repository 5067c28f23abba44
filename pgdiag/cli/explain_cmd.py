"""`pgdiag explain RUN --model CKPT`: why two streams disagree, attributed to causes (docs/explain.md).

Thin shell over `pgdiag.explain.api.explain_run` (and `explain.layers.compare_layers` for ``--layers``):
parse -> settings -> one library call -> render (the cause table and the verdict on stdout, the cost and
progress on stderr, `--json` on stdout alone, `--out` report files, `--html` the one-file page).
Example::

    pgdiag explain runs/step_100 --model ckpt/ --tokens 200000 --out /tmp/explain --html /tmp/explain.html
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pgdiag.cli.common import Screen, execute, result_object
from pgdiag.cli.options import MODEL, PERFORMANCE, STREAMS, Fields, RunArg, option
from pgdiag.cli.outputs import OutputSettings, finish

HELP = """Attribute the mismatch of two streams to causes: logprobs_mode, temperature, sampling_truncation,
tokenization, staleness, weights, routing, batch_variance, precision, unexplained.

Runs a recompute matrix on a stratified token budget (the cost is printed first), removes the causes in a
fixed order and prints each one's share; the last line names the top cause, its share and its fix.
"""

ModelOpt = Annotated[Path, option("--model", "HF checkpoint directory.", MODEL)]
PairOpt = Annotated[str, option("--pair", "Streams A,B (A samples).", STREAMS)]
TokensOpt = Annotated[int, option("--tokens", "Loss-token budget, stratified by step.", PERFORMANCE)]
SeedOpt = Annotated[int, option("--seed", "Which samples the budget takes.", PERFORMANCE)]
TpOpt = Annotated[int, option("--tp", "Tensor-parallel degree of the matrix.", PERFORMANCE)]
DeviceOpt = Annotated[str | None, option("--device", "cuda or cpu.", PERFORMANCE)]
ResumeOpt = Annotated[
    bool,
    option(
        "--resume/--no-resume",
        "Continue an interrupted explain: same samples, complete configurations reused.",
        PERFORMANCE,
    ),
]
LayersOpt = Annotated[
    tuple[str, str] | None,
    option(
        "--layers",
        "Per-layer divergence of two configurations (e.g. ref bf16); B may be a layer dump: slime:DIR (Megatron) or sglang:DIR.",
        MODEL,
    ),
]


def explain(
    run: RunArg,
    *,
    model: ModelOpt,
    pair: PairOpt = "rollout,old",
    tokens: TokensOpt = 200_000,
    seed: SeedOpt = 0,
    tp: TpOpt = 1,
    device: DeviceOpt = None,
    layers: LayersOpt = None,
    resume: ResumeOpt = True,
    output: Annotated[OutputSettings, Fields("json_out", "out", "html", "overwrite", "quiet")],
) -> None:
    """The `explain` command (help: `HELP`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.cli.explain_render import render_explain
        from pgdiag.explain.settings import ExplainSettings

        output.refuse_existing("explain")
        settings = ExplainSettings(
            pair=tuple(p.strip() for p in pair.split(",")), tokens=tokens, seed=seed, tp=tp, device=device,
            resume=resume,
        )  # fmt: skip
        if layers is not None:
            return _layers(screen, run, model, layers, settings, output)
        from pgdiag.explain.api import explain_run
        from pgdiag.explain.report import explain_report, explain_verdict

        out = output.out
        work = None if out is None else (out if out.suffix != ".parquet" else out.parent)
        result = explain_run(
            run, model, settings, out=work, overwrite=output.overwrite,
            on_cost=lambda line: screen.notes.print(line, markup=False),
            progress=None if output.quiet else lambda line: screen.notes.print(line, markup=False, style="dim"),
        )  # fmt: skip
        report, verdict = explain_report(result), explain_verdict(result)
        if not output.quiet:
            render_explain(screen.results, result)
        outcome = result_object(
            "explain",
            inputs={"runs": [str(run)], "streams": list(result.pair), "n_tokens": result.n_tokens},
            pairs=report.meta["pairs"],
            causes=[c.as_dict() for c in result.causes],
            top_cause=result.top_cause,
            explain=result.to_json(),
            verdict=verdict.as_dict(),
        )
        return finish(screen, report.with_meta(verdict=verdict.as_dict()), output, outcome, verdict)

    execute("explain", body, json_out=output.json_out, quiet=output.quiet)


def _layers(
    screen: Screen, run: str, model: Path, layers: tuple[str, str], settings: Any, output: OutputSettings
) -> dict[str, Any]:
    """`--layers A B`: the per-layer divergence of two configurations."""
    from pgdiag.cli.explain_render import render_layers
    from pgdiag.explain.layers import compare_layers
    from pgdiag.explain.report import layers_report, layers_verdict

    found = compare_layers(run, model, layers[0], layers[1], settings)
    verdict = layers_verdict(found)
    if not output.quiet:
        render_layers(screen.results, found)
    outcome = result_object(
        "explain", inputs={"runs": [str(run)]}, layers=found.to_json(), verdict=verdict.as_dict()
    )
    report = layers_report(found).with_meta(verdict=verdict.as_dict())
    return finish(screen, report, output, outcome, verdict)
