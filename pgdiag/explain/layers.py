"""`explain --layers A B`: the first layer where two recompute configurations diverge, on the same tokens.

What: both configurations run pgdiag's own model on the same samples with a hook after each block
(`CausalLM.forward_packed(layer_hook=...)`). Per block i (and the embeddings, i = −1 … reported as layer
``embed``), with out_X(i) the block's output under configuration X:

* cumulative error: ‖out_B(i) − out_A(i)‖ / ‖out_A(i)‖ (root mean square over tokens and features), each
  configuration fed by its own previous block: it grows smoothly from layer 0 as errors accumulate;
* local error: the same with configuration B's block i fed A's input to block i (A's output of block i − 1),
  so it measures what block i alone adds; the **first divergent layer** is the first whose local error is
  above `DIVERGENCE_FACTOR` × the median local error of the blocks (None when no block stands out: the error
  is spread evenly, as precision noise is);
* MoE: route flips per sparse layer, the fraction of tokens whose router top-k *set* differs between A and B
  (in the cumulative run, where B routes its own hidden states).

A configuration is a matrix name (`explain.matrix.CONFIGS`: ref, bf16, bf16_head, fp16, b1), optionally with
another checkpoint: ``ref@/path/ckpt`` compares two checkpoints layer by layer at one precision. Up to
`settings.tokens` loss tokens' samples are read (whole samples, in stored order).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pgdiag.errors import Code, UsageError
from pgdiag.explain.settings import ExplainSettings

DIVERGENCE_FACTOR = 3.0  # bf16 or fp16 alone: max/median local error 1.04 on the tests' model


@dataclass(frozen=True)
class LayerRow:
    layer: int  # block index (-1: the embeddings)
    cumulative: float
    local: float
    route_flips: float | None  # MoE sparse layers: fraction of tokens whose top-k set differs


@dataclass(frozen=True)
class LayerComparison:
    config_a: str
    config_b: str
    n_tokens: int
    rows: list[LayerRow]
    first_divergent: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "config_a": self.config_a,
            "config_b": self.config_b,
            "n_tokens": self.n_tokens,
            "rows": [r.__dict__ for r in self.rows],
            "first_divergent": self.first_divergent,
            "rule": f"first block whose local error > {DIVERGENCE_FACTOR:g}x the median local error",
        }


def _config(spec: str, default_model: str | Path) -> tuple[str, str, Path]:
    """(body dtype, head dtype, checkpoint) of ``name[@ckpt]``."""
    from pgdiag.explain.matrix import CONFIGS

    name, _, other = spec.partition("@")
    found = next((c for c in CONFIGS if c.name == name and c.routing == "recompute"), None)
    if found is None:
        names = ", ".join(c.name for c in CONFIGS if c.routing == "recompute")
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"--layers {spec!r}: not a configuration",
            f"choose from {names}, optionally @CKPT",
        )
    return found.dtype, found.head_dtype, Path(other) if other else Path(default_model)


class _Recorder:
    """A layer hook that keeps each block's input and output in fp32 (N, H), and optionally replaces outputs."""

    def __init__(self, feed: dict[int, torch.Tensor] | None = None) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.feed = feed  # index -> the tensor to hand the next block (A's output of block index)

    def __call__(self, index: int, x_in: torch.Tensor, x_out: torch.Tensor) -> torch.Tensor | None:
        self.inputs[index] = x_in.float()
        self.outputs[index] = x_out.float()
        return None if self.feed is None else self.feed[index]


def compare_layers(
    run: Any,
    model: str | Path,
    config_a: str,
    config_b: str,
    settings: ExplainSettings | None = None,
    *,
    plot: Path | None = None,
) -> LayerComparison:
    """Cumulative and local error per block of configurations `config_a` and `config_b` (module docstring)."""
    from pgdiag.data.runs import read_run
    from pgdiag.model import load_model, read_model_config
    from pgdiag.recompute.inputs import read_inputs
    from pgdiag.recompute.packing import pack_samples, plan_batches

    settings = settings or ExplainSettings()
    source = read_run(run) if isinstance(run, (str, Path)) else run
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    specs = [_config(spec, model) for spec in (config_a, config_b)]
    config = read_model_config(specs[0][2])
    inputs = read_inputs(source, int(config.vocab_size))
    n_loss = (
        np.add.reduceat(inputs.loss_mask.astype(np.int64), inputs.offsets[:-1]) if len(inputs.step) else []
    )
    take = int(np.searchsorted(np.cumsum(n_loss), settings.tokens) + 1) if len(n_loss) else 0
    rows = list(range(min(take, len(inputs.step))))
    ids = [inputs.input_ids[inputs.offsets[r] : inputs.offsets[r + 1]] for r in rows]
    masks = [inputs.loss_mask[inputs.offsets[r] : inputs.offsets[r + 1]] for r in rows]
    models = [load_model(ckpt, dtype=dt, head_dtype=hd, device=device) for dt, hd, ckpt in specs]
    n_layers = config.num_hidden_layers
    sums = {key: np.zeros(n_layers + 1) for key in ("cum", "loc", "ref")}
    flips = np.zeros(len(config.moe.sparse_layer_indices) if config.moe else 0)
    n_tokens = 0
    with torch.inference_mode():
        for batch in plan_batches([len(x) for x in ids], settings.batch_tokens, order="source"):
            packed = pack_samples(ids, masks, batch)
            args = (packed.input_ids.to(device), packed.position_ids.to(device), packed.cu_seqlens.to(device))
            rec_a, rec_b = _Recorder(), _Recorder()
            trunk_a = models[0].forward_packed(*args, layer_hook=rec_a)
            trunk_b = models[1].forward_packed(*args, layer_hook=rec_b)
            rec_local = _Recorder(feed={i: rec_a.outputs[i] for i in range(-1, n_layers)})
            models[1].forward_packed(*args, layer_hook=rec_local)
            for i in range(-1, n_layers):
                target = rec_a.outputs[i]
                sums["ref"][i + 1] += float((target**2).sum())
                sums["cum"][i + 1] += float(((rec_b.outputs[i] - target) ** 2).sum())
                sums["loc"][i + 1] += float(((rec_local.outputs[i] - target) ** 2).sum())
            if trunk_a.router_topk is not None and trunk_b.router_topk is not None:
                a_sets = trunk_a.router_topk.sort(dim=-1).values  # (N, L_sparse, k)
                b_sets = trunk_b.router_topk.sort(dim=-1).values
                flips += (a_sets != b_sets).any(dim=-1).sum(dim=0).cpu().numpy()
            n_tokens += packed.n_tokens
    cumulative = np.sqrt(sums["cum"] / np.maximum(sums["ref"], 1e-300))
    local = np.sqrt(sums["loc"] / np.maximum(sums["ref"], 1e-300))
    sparse = list(config.moe.sparse_layer_indices) if config.moe else []
    found = [
        LayerRow(
            i - 1,
            float(cumulative[i]),
            float(local[i]),
            float(flips[sparse.index(i - 1)] / max(n_tokens, 1)) if (i - 1) in sparse else None,
        )
        for i in range(n_layers + 1)
    ]
    blocks = local[1:]
    median = float(np.median(blocks)) if blocks.size else 0.0
    first = next((i for i, v in enumerate(blocks) if v > DIVERGENCE_FACTOR * median and v > 0), None)
    result = LayerComparison(config_a, config_b, n_tokens, found, first)
    if plot is not None:
        from pgdiag.explain.report import layers_report
        from pgdiag.report.explain_plots import plot_layers
        from pgdiag.report.plots import save_figure

        save_figure(plot_layers(layers_report(result)), plot)
    return result
