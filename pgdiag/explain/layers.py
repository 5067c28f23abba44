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

Side B may be an imported layer dump of slime's layer-wise alignment: ``slime:DIR`` (the Megatron trainer,
`explain.slime_layers`) or ``sglang:DIR`` (the SGLang engine's tensor dump, `explain.sglang_layers`: only the
positions the engine ran), on the run's samples the dump holds. There is no model for the dump's side, so only what needs none is given:

* cumulative error: ‖dump(i) − out_A(i)‖ / ‖out_A(i)‖, for every dumped block;
* local error: A's block i run by pgdiag on the dump's input to block i (the dump's output of block i − 1; for
  block 0, A's embeddings, a table lookup) against the dump's output of block i, over ‖out_A(i)‖: what the
  dumped framework's block i adds beyond pgdiag's. None (n/a) for a block whose previous block is not dumped;
* no embeddings row (not dumped) and no route flips (the dump holds no routes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
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
    local: float | None  # None: not available (a dump without block i - 1)
    route_flips: float | None  # MoE sparse layers: fraction of tokens whose top-k set differs


@dataclass(frozen=True)
class LayerComparison:
    config_a: str
    config_b: str
    n_tokens: int
    rows: list[LayerRow]
    first_divergent: int | None
    skipped: dict[str, str] = field(default_factory=dict)  # {"blocks": why}: the layer-subset fallback

    def to_json(self) -> dict[str, Any]:
        return {
            "config_a": self.config_a,
            "config_b": self.config_b,
            "n_tokens": self.n_tokens,
            "rows": [r.__dict__ for r in self.rows],
            "first_divergent": self.first_divergent,
            "rule": f"first block whose local error > {DIVERGENCE_FACTOR:g}x the median local error",
            "skipped": self.skipped,
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
            f"choose from {names}, optionally @CKPT; side B may be a layer dump, slime:DIR or sglang:DIR",
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
        return None if self.feed is None else self.feed.get(index)


def compare_layers(
    run: Any,
    model: str | Path,
    config_a: str,
    config_b: str,
    settings: ExplainSettings | None = None,
    *,
    plot: Path | None = None,
) -> LayerComparison:
    """Cumulative and local error per block of configurations `config_a` and `config_b` (module docstring);
    `config_b` may be an imported layer dump, ``slime:DIR`` or ``sglang:DIR`` (module docstring)."""
    from pgdiag.data.runs import read_run
    from pgdiag.explain.matrix import device_memory
    from pgdiag.model import read_model_config

    settings = settings or ExplainSettings()
    source = read_run(run) if isinstance(run, (str, Path)) else run
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dump = _dump_dir(config_b)
    specs = [_config(spec, model) for spec in ((config_a,) if dump else (config_a, config_b))]
    full = read_model_config(specs[0][2])
    ids, masks = _budget_samples(source, full, settings.tokens)
    memory = settings.memory_bytes or device_memory(str(device))
    blocks, skipped = fitting_blocks(full, [(dt, hd) for dt, hd, _ in specs], memory)
    models = [load_blocks(ckpt, dt, hd, blocks, device) for dt, hd, ckpt in specs]
    config = models[0].config  # cut to `blocks` blocks when the whole models do not fit
    if dump is not None:
        sums, flips, n_tokens, layers = _dump_sums(
            models[0], dump, ids, masks, settings.batch_tokens, device, full.num_hidden_layers
        )
    else:
        sums, flips, n_tokens = _model_sums(models, config, ids, masks, settings.batch_tokens, device)
        layers = list(range(-1, config.num_hidden_layers))
    cumulative = np.sqrt(sums["cum"] / np.maximum(sums["ref"], 1e-300))
    local = np.sqrt(
        sums["loc"] / np.maximum(sums["ref"], 1e-300)
    )  # NaN: no local error (dump: input missing)
    sparse = list(config.moe.sparse_layer_indices) if config.moe else []
    found = [
        LayerRow(
            layer,
            float(cumulative[layer + 1]),
            None if np.isnan(local[layer + 1]) else float(local[layer + 1]),
            float(flips[sparse.index(layer)] / max(n_tokens, 1))
            if layer in sparse and dump is None
            else None,
        )
        for layer in layers
    ]
    blocks = [(r.layer, r.local) for r in found if r.layer >= 0 and r.local is not None]
    median = float(np.median([v for _, v in blocks])) if blocks else 0.0
    first = next((i for i, v in blocks if v > DIVERGENCE_FACTOR * median and v > 0), None)
    result = LayerComparison(config_a, config_b, n_tokens, found, first, skipped)
    if plot is not None:
        from pgdiag.explain.report import layers_report
        from pgdiag.report.explain_plots import plot_layers
        from pgdiag.report.plots import save_figure

        save_figure(plot_layers(layers_report(result)), plot)
    return result


def fitting_blocks(config: Any, dtypes: list[tuple[str, str]], memory: int) -> tuple[int, dict[str, str]]:
    """(how many leading blocks to compare, {"blocks": what was skipped and why} or {}): every block when the
    models of `dtypes` ((body, head) each) fit in 80 % of `memory` together, else the longest prefix that fits
    (exact: a block's output depends only on the blocks before it). E508 when not even one block fits."""
    from pgdiag.explain.matrix import prefix_bytes

    n = config.num_hidden_layers
    budget = 0.8 * memory

    def need(blocks: int) -> int:
        return sum(prefix_bytes(config, body, head, blocks) for body, head in dtypes)

    if need(n) <= budget:
        return n, {}
    blocks = max((k for k in range(n) if need(k) <= budget), default=0)
    if blocks == 0:
        raise UsageError(
            Code.DEVICE_UNAVAILABLE,
            f"--layers: not even one block of the configurations fits ({need(1) / 2**30:.2f} GiB needed, 80 % "
            f"of {memory / 2**30:.2f} GiB available)",
            "run on a device with more memory, or compare lower-precision configurations",
        )
    why = (
        f"blocks {blocks}-{n - 1} not compared: the {n}-block models need {need(n) / 2**30:.3g} GiB, more than "
        f"80 % of {memory / 2**30:.3g} GiB; blocks 0-{blocks - 1} fit ({need(blocks) / 2**30:.3g} GiB) and are "
        "exact (a block's output depends only on the blocks before it)"
    )
    return blocks, {"blocks": why}


_BLOCK_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def load_blocks(checkpoint: Path, dtype: str, head_dtype: str, blocks: int, device: Any) -> Any:
    """pgdiag's model of `checkpoint`, cut to its first `blocks` blocks when that is fewer than it has (the
    tensors of later blocks are never read; the final norm and head stay, unused by the layer comparison)."""
    from pgdiag.model import TensorSource, load_from_source, load_model, read_model_config
    from pgdiag.model.checkpoint import open_tensor_source

    full = read_model_config(checkpoint)
    if blocks >= full.num_hidden_layers:
        return load_model(checkpoint, dtype=dtype, head_dtype=head_dtype, device=device)
    cut = replace(
        full,
        num_hidden_layers=blocks,
        sliding_windows=full.sliding_windows[:blocks],
        moe=None if full.moe is None else replace(full.moe, sparse_layers=full.moe.sparse_layers[:blocks]),
    )
    with open_tensor_source(Path(checkpoint)) as source:
        files = {}
        for name in source.names():
            match = _BLOCK_NAME.match(name)
            if match is None or int(match.group(1)) < blocks:
                files[name] = source.file_of(name)
        with TensorSource(files=files) as prefix:
            return load_from_source(
                cut, prefix, where=f"{checkpoint} (blocks 0-{blocks - 1})", dtype=dtype, head_dtype=head_dtype,
                device=device,
            )  # fmt: skip


def _dump_dir(spec: str) -> tuple[str, Path] | None:
    """(format, directory) of a ``slime:DIR`` or ``sglang:DIR`` side, else None."""
    for kind in ("slime", "sglang"):
        if spec.startswith(f"{kind}:"):
            return kind, Path(spec[len(kind) + 1 :])
    return None


def _budget_samples(source: Any, config: Any, tokens: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(ids, loss masks) of the run's first samples, whole, up to `tokens` loss tokens (stored order)."""
    from pgdiag.recompute.inputs import read_inputs

    inputs = read_inputs(source, int(config.vocab_size))
    n_loss = (
        np.add.reduceat(inputs.loss_mask.astype(np.int64), inputs.offsets[:-1]) if len(inputs.step) else []
    )
    take = int(np.searchsorted(np.cumsum(n_loss), tokens) + 1) if len(n_loss) else 0
    rows = list(range(min(take, len(inputs.step))))
    ids = [inputs.input_ids[inputs.offsets[r] : inputs.offsets[r + 1]] for r in rows]
    masks = [inputs.loss_mask[inputs.offsets[r] : inputs.offsets[r + 1]] for r in rows]
    return ids, masks


def _batches(ids: list[np.ndarray], masks: list[np.ndarray], batch_tokens: int, device: torch.device) -> Any:
    """(packed batch, forward arguments) per batch of the samples, in stored order."""
    from pgdiag.recompute.packing import pack_samples, plan_batches

    for batch in plan_batches([len(x) for x in ids], batch_tokens, order="source"):
        packed = pack_samples(ids, masks, batch)
        yield (
            packed,
            (packed.input_ids.to(device), packed.position_ids.to(device), packed.cu_seqlens.to(device)),
        )


def _model_sums(
    models: list[Any],
    config: Any,
    ids: list[np.ndarray],
    masks: list[np.ndarray],
    batch_tokens: int,
    device: Any,
) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """Squared errors per block (index i + 1 for block i) of two pgdiag configurations, route flips, tokens."""
    n_layers = config.num_hidden_layers
    sums = {key: np.zeros(n_layers + 1) for key in ("cum", "loc", "ref")}
    flips = np.zeros(len(config.moe.sparse_layer_indices) if config.moe else 0)
    n_tokens = 0
    with torch.inference_mode():
        for packed, args in _batches(ids, masks, batch_tokens, device):
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
    return sums, flips, n_tokens


def _dump_sums(
    model: Any,
    dump: tuple[str, Path],
    ids: list[np.ndarray],
    masks: list[np.ndarray],
    batch_tokens: int,
    device: Any,
    full_blocks: int,
) -> tuple[dict[str, np.ndarray], np.ndarray, int, list[int]]:
    """Squared errors per dumped block between configuration A (`model`) and a slime layer dump, on the run's
    samples the dump holds: cumulative = dump(i) against A's own out(i); local = dump(i) against A's block i
    fed the dump's input to it (dump(i − 1); A's embeddings for block 0), NaN where layer i − 1 is not dumped.
    Only the positions the dump holds count (an SGLang dump: the positions the engine ran); a position it does
    not hold feeds A's own row. Returns (sums, no route flips, tokens compared, the dumped layers)."""
    from pgdiag.explain import sglang_layers, slime_layers

    kind, directory = dump
    hidden_size = int(model.config.hidden_size)
    reader = slime_layers if kind == "slime" else sglang_layers
    found = reader.match_samples(directory, ids, hidden_size)
    order = sorted(found)
    layers = sorted(found[order[0]].hidden)
    if layers[-1] >= full_blocks:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"{directory}: the dump has layer {layers[-1]}, the checkpoint {full_blocks} blocks",
            "pass the checkpoint the dumped model was trained from",
        )
    n_layers = model.config.num_hidden_layers  # fewer than full_blocks under the layer-subset fallback
    layers = [i for i in layers if i < n_layers]
    sums = {key: np.zeros(n_layers + 1) for key in ("cum", "loc", "ref")}
    sums["loc"][:] = np.nan
    for i in layers:
        if i == 0 or i - 1 in layers:
            sums["loc"][i + 1] = 0.0
    n_tokens = 0
    with torch.inference_mode():
        for packed, args in _batches(
            [ids[k] for k in order], [masks[k] for k in order], batch_tokens, device
        ):
            samples = [found[order[k]] for k in packed.sample_index.tolist()]
            held = np.concatenate(
                [s.observed if s.observed is not None else np.ones(len(s.ids), dtype=bool) for s in samples]
            )
            mask = torch.from_numpy(held).to(device)[:, None]  # (N, 1) rows the dump holds
            rec_a = _Recorder()
            model.forward_packed(*args, layer_hook=rec_a)
            dumped = {
                i: torch.where(
                    mask, torch.cat([s.hidden[i] for s in samples]).to(device).float(), rec_a.outputs[i]
                )
                for i in layers
            }  # (N, H): the dump's rows, A's own where the dump has none
            rec_fed = _Recorder(feed=dumped)
            model.forward_packed(*args, layer_hook=rec_fed)
            rows = mask[:, 0]
            for i in layers:
                target = rec_a.outputs[i][rows]
                sums["ref"][i + 1] += float((target**2).sum())
                sums["cum"][i + 1] += float(((dumped[i][rows] - target) ** 2).sum())
                if not np.isnan(sums["loc"][i + 1]):
                    sums["loc"][i + 1] += float(((dumped[i][rows] - rec_fed.outputs[i][rows]) ** 2).sum())
            n_tokens += int(held.sum())
    return sums, np.zeros(0), n_tokens, layers
