"""The kept-set side of a recompute: which K scores the tokens (``--kept-set``), where K comes from, and the
per-batch `KeptSet` handed to the LM head (docs/recompute.md, "Kept sets"). Torch-free (the CLI imports it);
`recompute.kept_batch` builds the tensors.

What: `resolve_kept_set(run, requested)` turns ``--kept-set recorded|reconstruct[:vllm|:sglang]|off|auto`` into
a `KeptPlan`: the scoring mode (``kept_set``: recorded / reconstruct:<engine> score over K, off over the full
vocabulary) and the source of K for the kept mass (``kept_source``: the same, or under ``off`` the recorded K,
else a reconstruction when the metadata says truncation was on, else none). The default (``auto``) follows the
stream semantics table (`pgdiag.data.semantics`): ``recorded`` when the run records K and its sampling stream is
renormalised over K, else ``off``. `recompute.kept_batch.batch_kept` builds one batch's K: the recorded sets of the target positions
(`pgdiag.data.kept.position_sets`), or a reconstruction (`pgdiag.kernels.kept_reconstruct`) from the batch's own
hidden states with each sample's top-k / top-p / min-p.

Why apart: `recompute.logprobs` orchestrates; the rules for K live here. W412 (the formula is approximate:
penalties, logit bias, guided decoding, logits processors, or T < 1e-5, which vLLM treats as greedy) is decided
here from the metadata; W413 (truncation without a recorded K: the hidden bias, its size) after the recompute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pgdiag.data.kept import KEPT_IDS, KEPT_OFFSETS
from pgdiag.data.semantics import (
    KEPT_SET_MODES,
    default_kept_set,
    footer_semantics,
    reconstruct_engine,
    truncation_on,
)
from pgdiag.errors import Code, UsageError

if TYPE_CHECKING:
    from pgdiag.data.runs import Run

SAMPLING_COLUMNS = ("top_k", "top_p", "min_p")
# sampling settings whose non-default value changes finite logits before truncation (W412)
_LOGIT_CHANGERS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "guided_decoding": None,
    "logits_processors": None,
    "bad_words": None,
}
GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a smaller T is greedy (sampled at T = 1)


@dataclass(frozen=True)
class KeptPlan:
    """How a recompute uses kept sets: the scoring mode, the source of K for the kept mass, the warnings."""

    kept_set: str  # recorded | reconstruct:vllm | reconstruct:sglang | off
    kept_source: str  # recorded | reconstruct:vllm | reconstruct:sglang | none
    warnings: tuple[str, ...] = ()

    @property
    def needs_recorded(self) -> bool:
        return self.kept_source == "recorded"

    @property
    def reconstructs(self) -> str | None:
        """The engine whose order K is rebuilt in, or None."""
        return self.kept_source.split(":", 1)[1] if self.kept_source.startswith("reconstruct:") else None


def run_records_kept(run: Run) -> bool:
    """Whether the run's files have the kept-set columns (ids and offsets)."""
    schema = run.lazy.collect_schema()
    return KEPT_IDS in schema and KEPT_OFFSETS in schema


def _sampling(run: Run) -> Mapping[str, Any]:
    sampling = (run.meta or {}).get("sampling") or {}
    return sampling if isinstance(sampling, Mapping) else {}


def _truncated(run: Run) -> bool:
    """Truncation on per the run's sampling defaults or its per-row top_k / top_p / min_p columns."""
    if truncation_on(_sampling(run)):
        return True
    schema = run.lazy.collect_schema()
    present = [c for c in SAMPLING_COLUMNS if c in schema]
    if not present:
        return False
    import polars as pl

    row = run.lazy.select(
        (pl.col("top_k").cast(pl.Float64).fill_null(0) > 0).any() if "top_k" in present else pl.lit(False),
        ((pl.col("top_p").cast(pl.Float64).fill_null(1) < 1).any()) if "top_p" in present else pl.lit(False),
        ((pl.col("min_p").cast(pl.Float64).fill_null(0) > 0).any()) if "min_p" in present else pl.lit(False),
    ).collect()
    return bool(any(row.row(0)))


def inexact_warnings(run: Run, temperature: float | None) -> tuple[str, ...]:
    """W412 when the metadata shows a logit change the kept-set formula ignores, or T < 1e-5."""
    sampling = _sampling(run)
    changed = [
        key
        for key, neutral in _LOGIT_CHANGERS.items()
        if key in sampling and sampling[key] not in (None, neutral, {}, [], "", False)
    ]
    warnings = []
    if changed:
        warnings.append(
            f"W412: the sampler's logits were changed by {', '.join(changed)}: the kept-set log-probs are "
            "computed without it and are approximate"
        )
    sampled_t = sampling.get("temperature")
    low = [t for t in (temperature, sampled_t) if isinstance(t, int | float) and not isinstance(t, bool)]
    if any(t < GREEDY_TEMPERATURE for t in low):
        warnings.append(
            f"W412: temperature below {GREEDY_TEMPERATURE:g}: vLLM samples greedily there (T treated as 1)"
        )
    return tuple(warnings)


def resolve_kept_set(run: Run, requested: str) -> KeptPlan:
    """The `KeptPlan` of ``--kept-set requested`` (``auto``: the default of the stream semantics table).

    UsageError E503 for an unknown mode, E506 for ``recorded`` on a run without K and for ``reconstruct`` on a
    run whose metadata names no top-k / top-p / min-p."""
    if requested != "auto" and requested not in KEPT_SET_MODES:
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"--kept-set {requested!r} is not one of auto, {', '.join(KEPT_SET_MODES)}"
        )
    semantics = footer_semantics(run.meta or {}, "rollout")
    has_kept = run_records_kept(run)
    mode = default_kept_set(semantics, has_kept_columns=has_kept) if requested == "auto" else requested
    truncated = _truncated(run)
    if mode == "recorded" and not has_kept:
        raise UsageError(
            Code.MISSING_SETTING,
            f"--kept-set recorded: {run.label} records no kept sets ({KEPT_IDS}, {KEPT_OFFSETS})",
            "import them (docs/import.md), or use --kept-set reconstruct",
        )
    if mode.startswith("reconstruct"):
        mode = f"reconstruct:{reconstruct_engine(mode, semantics)}"
        if not truncated:
            raise UsageError(
                Code.MISSING_SETTING,
                f"--kept-set {mode}: {run.label} names no top_k, top_p or min_p (columns or pgdiag.sampling)",
                "import the sampling settings (pgdiag import --top-p ...), or use --kept-set off",
            )
    if mode != "off":
        source = mode
    elif has_kept:
        source = "recorded"
    elif truncated:
        source = f"reconstruct:{reconstruct_engine('reconstruct', semantics)}"
    else:
        source = "none"
    return KeptPlan(mode, source)


def hidden_bias_warning(plan: KeptPlan, bias: float | None) -> tuple[str, ...]:
    """W413 when truncation was on but no K was recorded: the size of the bias the reconstruction estimates
    (mean -log kept mass over the loss tokens)."""
    if plan.reconstructs is None or bias is None:
        return ()
    return (
        f"W413: truncated sampling without a recorded kept set: the kept mass is a hidden bias of "
        f"{bias:.4g} nats a token (mean -log kept mass, K reconstructed in {plan.reconstructs}'s order)",
    )


def sample_sampling(run: Run, frame_columns: Mapping[str, np.ndarray], n_rows: int) -> dict[str, np.ndarray]:
    """(S,) top_k (int64, 0 = off), top_p (fp64, 1 = off), min_p (fp64, 0 = off) per sample: the row
    columns where set, else the run's sampling defaults."""
    sampling = _sampling(run)
    off = {"top_k": 0.0, "top_p": 1.0, "min_p": 0.0}
    out = {}
    for name in SAMPLING_COLUMNS:
        default = sampling.get(name)
        default = (
            float(default)
            if isinstance(default, int | float) and not isinstance(default, bool)
            else off[name]
        )
        values = frame_columns.get(name)
        column = np.full(n_rows, default) if values is None else np.where(np.isnan(values), default, values)
        out[name] = column
    out["top_k"] = np.where(out["top_k"] < 0, 0, out["top_k"]).astype(np.int64)  # -1: off (vLLM)
    return out
