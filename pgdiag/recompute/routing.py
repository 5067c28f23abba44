"""MoE routing during a recompute: which tokens the model's router would send elsewhere than the engine did.

What: `routing_counts` compares, per MoE layer, the router's own top-k of each token with the experts the engine
recorded (the run's ``routed_experts`` column) and counts the tokens whose expert *sets* differ (order within the
top-k ignored; tokens with no recorded route are not counted). Each part file carries its counts in its
``pgdiag.recompute`` footer (key ``routing``), so data-parallel replicas and resumed jobs need no reduction;
`write_routing_summary` adds them up per step and layer into ``_routing.parquet`` beside the stream, with
``routing/disagree_frac`` = disagreeing tokens / recorded tokens. `read_routing` loads that file.

Why: under ``--routing recompute`` the fraction says how often the trainer-side router disagrees with the engine
on its own; under ``--routing replay`` the recorded experts are used and the fraction says how often the router,
seeing the replayed hidden states, would have chosen otherwise. Recomputing the same run both ways and comparing
the two streams to the rollout log-probs attributes the mismatch to routing (docs/metrics.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import torch

from pgdiag.data.schema import RECOMPUTE_FOOTER_KEY, ROUTING_FILE, read_footer
from pgdiag.data.writing import write_parquet
from pgdiag.model.moe import different_sets

ROUTING_METRIC = "routing/disagree_frac"
ROUTING_SCHEMA = "pgdiag.routing/v1"


def routing_counts(recorded: torch.Tensor, chosen: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(recorded tokens (L,), disagreeing tokens (L,)) int64 for recorded (N, L, k) (-1 = not recorded) and the
    router's own chosen (N, L, k) expert ids."""
    recorded = recorded.to(chosen.device, torch.int64)
    valid = (recorded >= 0).all(dim=-1)  # (N, L)
    n, layers, k = chosen.shape
    differ = different_sets(recorded.reshape(n * layers, k), chosen.reshape(n * layers, k)).view(n, layers)
    tokens = valid.sum(dim=0)
    disagree = (differ & valid).sum(dim=0)
    return tokens.cpu().numpy().astype(np.int64), disagree.cpu().numpy().astype(np.int64)


def footer_entry(layers: tuple[int, ...], tokens: np.ndarray, disagree: np.ndarray) -> dict[str, Any]:
    """The ``routing`` footer value of one part: model layer indices and per-layer counts."""
    return {"layers": list(layers), "tokens": tokens.tolist(), "disagree": disagree.tolist()}


def write_routing_summary(out_dir: Path, part_paths: list[str]) -> float | None:
    """Sum the parts' routing counts per (step, layer) into ``_routing.parquet``; the overall disagreeing fraction,
    or None when no part recorded routes (the file is then not written)."""
    rows: dict[tuple[int, int], list[int]] = {}
    for relpath in part_paths:
        footer = read_footer(out_dir / relpath).get(RECOMPUTE_FOOTER_KEY) or {}
        entry = footer.get("routing")
        if not entry:
            continue
        step = int(footer["part"]["step"])
        for layer, tokens, disagree in zip(entry["layers"], entry["tokens"], entry["disagree"], strict=True):
            counts = rows.setdefault((step, int(layer)), [0, 0])
            counts[0] += int(tokens)
            counts[1] += int(disagree)
    if not rows or sum(t for t, _ in rows.values()) == 0:
        return None
    keys = sorted(rows)
    tokens = np.array([rows[k][0] for k in keys], dtype=np.int64)
    disagree = np.array([rows[k][1] for k in keys], dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(tokens > 0, disagree / np.maximum(tokens, 1), np.nan)
    table = pa.table({
        "step": pa.array([k[0] for k in keys], type=pa.int64()),
        "layer": pa.array([k[1] for k in keys], type=pa.int32()),
        "tokens": pa.array(tokens, type=pa.int64()),
        "disagree": pa.array(disagree, type=pa.int64()),
        ROUTING_METRIC: pa.array(frac, type=pa.float64(), mask=tokens == 0),
    })  # fmt: skip
    write_parquet(table, out_dir / ROUTING_FILE, metadata={"schema": ROUTING_SCHEMA})
    return float(disagree.sum() / tokens.sum())


def read_routing(stream_dir: str | Path) -> pl.DataFrame:
    """``_routing.parquet`` of a recompute stream: step, layer, tokens, disagree, routing/disagree_frac."""
    return pl.read_parquet(Path(stream_dir) / ROUTING_FILE)
