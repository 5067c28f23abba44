"""`explain_run(run, model)`: why two log-prob streams of a run disagree (the library call behind `pgdiag explain`).

What it does, in order (docs/explain.md):
1. the token budget: whole samples, stratified by step, copied to ``OUT/tokens`` (`explain.tokens`);
2. the sampling grid: one reference forward giving every token's log-prob at each candidate temperature and
   kept set (`explain.grid`); fold 1 (`causes.SamplingFit`) finds the grid point each side fits;
3. the cost of the recompute matrix is announced (`on_cost`), then the matrix runs at side a's temperature,
   each configuration a recompute tag of the token run (`explain.matrix`);
4. fold 2 (`causes.Evidence`) gathers what the signature rules read; `attribution.decide` applies them;
5. fold 3 (`causes.Chain`) removes the causes in order; `attribution.shares` turns that into shares per cause,
   overall, per response-position bucket and per step.
Nothing here prints; the CLI renders `ExplainResult`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pgdiag.errors import Code, UsageError
from pgdiag.explain.attribution import CauseShare, shares, verdict_line
from pgdiag.explain.settings import ExplainSettings


@dataclass(frozen=True)
class ExplainResult:
    """What `explain_run` found: causes with shares (sorted), the verdict, and where each number came from."""

    pair: tuple[str, str]
    n_tokens: int
    k3: float  # the pair's mean k3 on the budget's tokens
    abs_mean: float
    causes: list[CauseShare]
    top_cause: str | None
    verdict: str
    nothing_to_explain: bool
    by_position: dict[str, list[CauseShare]]
    by_step: dict[str, list[CauseShare]]
    signatures: list[dict[str, Any]]
    configs: list[str]  # recompute tags written under `token_run`
    skipped: dict[str, str]
    cost: str
    fits: dict[str, Any]
    token_run: Path
    seconds: dict[str, float] = field(default_factory=dict)
    n_forwarded: int = 0  # prompt + response tokens of the budget's samples (what each forward processes)
    reused: list[str] = field(
        default_factory=list
    )  # tags complete from an earlier call (resume), not recomputed

    def to_json(self) -> dict[str, Any]:
        """The ``explain`` block of the `--json` object (docs/explain.md, "JSON")."""

        def rows(causes: list[CauseShare]) -> list[dict[str, Any]]:
            return [c.as_dict() for c in causes]

        return {
            "pair": list(self.pair),
            "n_tokens": self.n_tokens,
            "k3": self.k3,
            "abs_mean": self.abs_mean,
            "causes": rows(self.causes),
            "top_cause": self.top_cause,
            "verdict": self.verdict,
            "nothing_to_explain": self.nothing_to_explain,
            "by_position": {k: rows(v) for k, v in self.by_position.items()},
            "by_step": {k: rows(v) for k, v in self.by_step.items()},
            "signatures": self.signatures,
            "configs": self.configs,
            "skipped": self.skipped,
            "cost": self.cost,
            "fits": self.fits,
            "token_run": str(self.token_run),
            "seconds": self.seconds,
            "n_forwarded": self.n_forwarded,
            "reused": self.reused,
        }


def explain_run(
    run: Any,
    model: str | Path,
    settings: ExplainSettings | None = None,
    *,
    out: str | Path | None = None,
    overwrite: bool = False,
    on_cost: Callable[[str], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ExplainResult:
    """Attribute the mismatch between the two streams of `settings.pair` of `run` to causes (module docstring).

    `run`: a `Run` or a run path; `model`: an HF checkpoint directory. `out` (default ``RUN/explain``) receives
    the token run ``OUT/tokens`` with the matrix's recompute tags. `on_cost` receives the cost line before the
    matrix runs. Raises UsageError (E111 a stream missing, E502 output exists, E503 options, E506 no home for
    the output, E60x the checkpoint) and InvalidInputError (the row rules of every command).
    """
    from pgdiag.data.fold import fold
    from pgdiag.data.runs import read_run
    from pgdiag.explain import matrix
    from pgdiag.explain.causes import SamplingFit
    from pgdiag.explain.settings import PER_TOKEN
    from pgdiag.explain.table import token_pieces

    settings = settings or ExplainSettings()
    started = time.perf_counter()
    source = read_run(run) if isinstance(run, (str, Path)) else run
    plan = _prepare(source, model, settings, out, overwrite, on_cost)
    token_run = read_run(plan.token_dir)
    seconds: dict[str, float] = {"select": time.perf_counter() - started}
    grid, keys, grid_dtype = _grid(token_run, model, plan.model_config, plan.device, plan.memory, settings)
    if grid_dtype != "fp32":
        plan.skipped["grid_body"] = f"{grid_dtype} body (fp32 did not fit)"
    seconds["grid"] = time.perf_counter() - started - seconds["select"]
    fits, _ = fold(
        SamplingFit(grid.temperatures.index(1.0)), token_pieces(token_run, settings.pair, (), grid, keys)
    )
    t_a = grid.temperatures[fits["a"].temperature_index]  # PER_TOKEN: the matrix reads each token's own
    recomputed, reused = matrix.run_matrix(
        plan.token_dir, model, plan.configs, prefix=settings.tag_prefix,
        temperature="auto" if t_a == PER_TOKEN else t_a, tp=settings.tp, device=settings.device,
        batch_tokens=settings.batch_tokens, resume=settings.resume, progress=progress,
    )  # fmt: skip
    seconds.update(recomputed)
    result = _attribute(read_run(plan.token_dir), settings, plan, fits, grid, keys)
    seconds["total"] = time.perf_counter() - started
    return replace(result, seconds=seconds, reused=reused)


@dataclass
class _Plan:
    """What explain decided before any heavy work: where, which configurations, what they cost."""

    token_dir: Path
    model_config: Any
    device: str
    memory: int
    configs: list[Any]
    skipped: dict[str, str]
    cost: Any


def _prepare(
    source: Any,
    model: str | Path,
    settings: ExplainSettings,
    out: str | Path | None,
    overwrite: bool,
    on_cost: Callable[[str], None] | None,
) -> _Plan:
    """Check the pair and the output, plan the matrix, announce its cost, write the budget's token run."""
    from pgdiag.explain import matrix
    from pgdiag.explain.grid import temperatures
    from pgdiag.explain.tokens import check_pair, same_selection, select_samples, write_token_run
    from pgdiag.model import read_model_config
    from pgdiag.recompute.kept_rules import run_records_kept

    check_pair(source, settings.pair)
    if out is None:
        if source.root is None:
            raise UsageError(
                Code.MISSING_SETTING,
                "RUN is not a run directory, so explain's output has no home",
                "pass --out DIR",
            )
        out = Path(source.root) / "explain"
    token_dir = Path(out) / "tokens"
    if token_dir.exists() and not overwrite and not settings.resume:
        raise UsageError(
            Code.OUTPUT_EXISTS,
            f"{token_dir} exists",
            "pass --overwrite to replace it, --resume to continue it, or another --out",
        )
    model_config = read_model_config(model)
    device = settings.device or _default_device()
    memory = settings.memory_bytes or matrix.device_memory(device)
    configs, skipped = matrix.plan_matrix(
        model_config,
        moe_routes="routed_experts" in source.lazy.collect_schema(),
        records_kept=run_records_kept(source),
        tp=settings.tp,
        memory=memory,
        names=settings.configs,
    )
    selection = select_samples(source, settings.tokens, settings.seed)
    recorded_t = ((source.meta or {}).get("sampling") or {}).get("temperature")
    cost = matrix.estimate_cost(
        model_config, configs, selection.n_tokens, device, forwarded=selection.forwarded, tp=settings.tp,
        grid_dtype=matrix.grid_dtype(model_config, memory),
        temperatures=len(temperatures([recorded_t] if isinstance(recorded_t, (int, float)) else [])),
    )  # fmt: skip
    if on_cost is not None:
        on_cost(cost.line())
    resumed = token_dir.exists() and not overwrite
    if resumed:  # same run, budget and seed: the same samples, else E502
        same_selection(source, selection, token_dir, settings.pair)
    else:
        if token_dir.exists():
            shutil.rmtree(token_dir)
        write_token_run(source, selection, token_dir)
    return _Plan(token_dir, model_config, device, memory, configs, skipped, cost)


def _attribute(
    token_run: Any, settings: ExplainSettings, plan: _Plan, fits: dict[str, Any], grid: Any, keys: Any
) -> ExplainResult:
    """Folds 2 and 3 over the token run with the matrix's tags, the decisions between them, the shares."""
    from pgdiag.data.fold import fold
    from pgdiag.explain import matrix
    from pgdiag.explain.attribution import decide
    from pgdiag.explain.causes import Chain, Evidence
    from pgdiag.explain.settings import temperature_label
    from pgdiag.explain.table import token_pieces

    tags = tuple(c.tag(settings.tag_prefix) for c in plan.configs)
    roles = matrix.roles(plan.configs, settings.tag_prefix)
    evidence = Evidence(fits, tags, (roles.kept, roles.reference) if roles.kept and roles.reference else None)
    fold(evidence, token_pieces(token_run, settings.pair, tags, grid, keys))
    modes = _declared_modes(token_run, settings.pair)
    decisions, signatures, details = decide(evidence, fits, grid.temperatures, roles, modes)
    chain = fold(Chain(decisions, fits), token_pieces(token_run, settings.pair, tags, grid, keys))
    nothing = evidence.sums.get("abs_0", 0.0) == 0.0
    overall = shares(chain, ("all", "all"), details)
    if nothing:
        overall = [
            replace(c, share=0.0, k3_before=0.0, k3_after=0.0, abs_mean_before=0.0, abs_mean_after=0.0)
            for c in overall
        ]
    top, verdict = verdict_line(overall, nothing)
    groups = {
        kind: {label: shares(chain, (k, label), details) for k, label in chain.stages if k == kind}
        for kind in ("position", "step")
    }
    return ExplainResult(
        pair=settings.pair,
        n_tokens=evidence.n,
        k3=evidence.mean("k3_0"),
        abs_mean=evidence.mean("abs_0"),
        causes=overall,
        top_cause=top,
        verdict=verdict,
        nothing_to_explain=nothing,
        by_position=groups["position"],
        by_step=groups["step"],
        signatures=[s.as_dict() for s in signatures],
        configs=list(tags),
        skipped=plan.skipped,
        cost=plan.cost.line(),
        fits={
            side: {
                "temperature": temperature_label(grid.temperatures[f.temperature_index]),
                "kept_set": grid.variants[f.variant_index].label,
                "k3": f.k3,
                "k3_at_t1_full": f.k3_full_at_t1,
            }
            for side, f in fits.items()
        },
        token_run=plan.token_dir,
        n_forwarded=plan.cost.forwarded,
    )


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _declared_modes(run: Any, pair: tuple[str, str]) -> tuple[str, str]:
    """The logprobs mode of each stream (``raw``, ``processed`` or ``unknown``) from the stream semantics table
    (`pgdiag.data.semantics`): the rollout stream's footer entry, then ``pgdiag.sampling`` (the engine's
    settings); any other stream's own footer entry only (the sampling settings are not the trainer's)."""
    from pgdiag.data.semantics import footer_semantics, stream_semantics

    meta = run.meta or {}
    entries = meta.get("streams") or {}
    modes = []
    for stream in pair:
        if stream == "rollout":
            modes.append(footer_semantics(meta, stream).logprobs_mode)
            continue
        entry = entries.get(stream) or entries.get(f"{stream}_logprobs") or {}
        entry = entry if isinstance(entry, dict) else {}
        modes.append(stream_semantics(entry.get("engine"), entry.get("logprobs_mode")).logprobs_mode)
    return modes[0], modes[1]


def _grid(
    token_run: Any, model: str | Path, model_config: Any, device: str, memory: int, settings: ExplainSettings
) -> tuple[Any, Any, str]:
    """(GridValues, grid keys, body dtype): the sampling grid on one device, fp32 when it fits, else bf16."""
    import numpy as np
    import torch

    from pgdiag.explain import grid as sampling
    from pgdiag.explain.matrix import grid_dtype
    from pgdiag.explain.table import grid_keys
    from pgdiag.model import load_model
    from pgdiag.recompute.inputs import read_inputs

    dtype = grid_dtype(model_config, memory)
    inputs = read_inputs(token_run, int(model_config.vocab_size))
    ids = [inputs.input_ids[inputs.offsets[r] : inputs.offsets[r + 1]] for r in range(len(inputs.step))]
    masks = [inputs.loss_mask[inputs.offsets[r] : inputs.offsets[r + 1]] for r in range(len(inputs.step))]
    sampling_meta = (token_run.meta or {}).get("sampling") or {}
    recorded_t = (
        [sampling_meta["temperature"]] if isinstance(sampling_meta.get("temperature"), (int, float)) else []
    )
    per_token = None
    if inputs.temperature is not None:  # the run's temperature / temperature_tok columns (recompute's rule)
        distinct = np.unique(inputs.temperature[inputs.loss_mask])
        if distinct.size == 1:
            recorded_t.append(float(distinct[0]))
        elif distinct.size > 1:
            per_token = [
                inputs.temperature[inputs.offsets[r] : inputs.offsets[r + 1]] for r in range(len(ids))
            ]
    top_p = [sampling_meta["top_p"]] if isinstance(sampling_meta.get("top_p"), (int, float)) else []
    top_k = sampling_meta.get("top_k") if isinstance(sampling_meta.get("top_k"), int) else None
    lm = load_model(model, dtype=dtype, head_dtype="fp32", device=torch.device(device))
    temps = sampling.temperatures(recorded_t)
    values = sampling.sampling_grid(
        lm, ids, masks, temps if per_token is None else (*temps, sampling.PER_TOKEN),
        sampling.variants(top_k, top_p), batch_tokens=settings.batch_tokens, token_temperatures=per_token,
    )  # fmt: skip
    del lm
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the matrix loads its own models next
    return values, grid_keys(inputs.step, inputs.sample_id, inputs.segment_idx, masks), dtype
