"""slime layer-wise alignment dumps written the way slime writes them, for the `explain --layers A slime:DIR` tests.

slime (THUDM/slime 624b824a) is not on PyPI and its dumper's package (``slime.backends.megatron_utils``)
imports Megatron on import, so the dumper cannot run here; the files are built field for field as
``_MegatronLayerwiseDumper`` (``slime/backends/megatron_utils/alignment/layerwise_alignment.py``) saves them:
``DIR/rank<RRRRR>/actor_Pass<PPPPP>.pt`` = ``torch.save({"store_prefix", "layers", "modules", "input_ids",
"cu_seqlens"})``, the micro-batch packed as slime's ``get_batch`` (``megatron_utils/data.py``) packs it
(samples end to end, padded with token 0 to a multiple of TP × 128 as one more ``cu_seqlens`` segment,
``input_ids`` (1, T), ``cu_seqlens`` int32), each layer's output in Megatron's (T, 1, H) layout.

The hidden states come from the other framework's own code: transformers' ``Qwen3ForCausalLM`` on the CPU, one
forward hook per decoder layer keeping the first tensor of its output (as the dumper's ``record_layer`` does).
"""

from __future__ import annotations

from pathlib import Path

import torch


def layer_outputs(model: torch.nn.Module, ids: list[int]) -> dict[int, torch.Tensor]:
    """{layer id: (n, H) fp32} outputs of every decoder layer of a transformers Qwen3 on one sequence."""
    kept: dict[int, torch.Tensor] = {}

    def keep(layer_id: int):
        def hook(module, args, output) -> None:
            first = output if isinstance(output, torch.Tensor) else output[0]
            kept[layer_id] = first[0].detach().clone()  # (1, n, H) -> (n, H)

        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    with torch.inference_mode():
        model(torch.tensor([ids], dtype=torch.int64))
    for handle in handles:
        handle.remove()
    return kept


def write_slime_layer_dump(
    directory: Path,
    checkpoint: Path,
    samples: list[list[int]],
    *,
    layers: list[int] | None = None,
    passes: int = 2,
    tp: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """The samples split over `passes` forward passes, each dumped by every one of `tp` TP ranks (TP ranks hold
    the same full sequences without sequence parallelism); `layers` the selected layer ids (default all)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").float().eval()
    per_pass = -(-len(samples) // passes)
    for p in range(passes):
        chunk = samples[p * per_pass : (p + 1) * per_pass]
        if not chunk:
            continue
        outputs = [layer_outputs(model, ids) for ids in chunk]
        selected = layers if layers is not None else sorted(outputs[0])
        tokens = [t for ids in chunk for t in ids]
        bounds = [0]
        for ids in chunk:
            bounds.append(bounds[-1] + len(ids))
        pad_size = tp * 128
        pad = (pad_size - len(tokens) % pad_size) % pad_size
        hidden = {i: torch.cat([o[i] for o in outputs]) for i in selected}  # (T, H)
        if pad:
            tokens += [0] * pad
            bounds.append(bounds[-1] + pad)
            width = next(iter(hidden.values())).shape[1]
            filler = torch.randn(pad, width)  # Megatron computes the padding's rows too; nothing reads them
            hidden = {i: torch.cat([h, filler]) for i, h in hidden.items()}
        record = {
            "store_prefix": "actor",
            "layers": {i: h.to(dtype).unsqueeze(1) for i, h in hidden.items()},  # (T, 1, H), sequence first
            "modules": {},
            "input_ids": torch.tensor([tokens], dtype=torch.int64),
            "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        }
        for rank in range(tp):
            folder = directory / f"rank{rank:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(record, folder / f"actor_Pass{p:05d}.pt")
    return directory


def sglang_layer_parts(
    model: torch.nn.Module, ids: list[int]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer id: (delta, residual)} of transformers' Qwen3 on one sequence, split as SGLang's decoder layers
    return it: delta = the MLP's output, residual = the stream after attention (their sum is the block's
    output; SGLang adds them in the next layer's norm)."""
    parts: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):

        def residual_hook(module, args, i=i) -> None:
            parts.setdefault(i, {})["residual"] = args[0][0].detach().clone()

        def delta_hook(module, args, output, i=i) -> None:
            parts.setdefault(i, {})["delta"] = output[0].detach().clone()

        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(residual_hook))
        handles.append(layer.mlp.register_forward_hook(delta_hook))
    with torch.inference_mode():
        model(torch.tensor([ids], dtype=torch.int64))
    for handle in handles:
        handle.remove()
    return {i: (p["delta"], p["residual"]) for i, p in parts.items()}


def write_sglang_layer_dump(
    directory: Path,
    checkpoint: Path,
    samples: list[list[int]],
    prompt_lens: list[int],
    *,
    chunk: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """The samples as SGLang would have run them, dumped by its tensor dumper with slime's patch (module
    docstring of pgdiag/explain/sglang_layers.py): one prefill pass of every prompt (plus a HEALTH_CHECK_
    request, skipped by readers), then one decode pass per response position, one token per running request;
    odd requests never feed their last token. `chunk` > 1: records saved `chunk` to a ``Chunk*.pt`` list."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").float().eval()
    parts = [sglang_layer_parts(model, ids) for ids in samples]
    n_layers = len(parts[0])
    folder = directory / "TP0_PP0_Rank0_pid4242"
    folder.mkdir(parents=True, exist_ok=True)

    def record(entries: list[tuple[str, int, list[int]]], prefill: bool) -> dict:
        """entries: (request id, sample index or -1 for the health check, positions)."""
        ids, positions, layer_rows = [], [], {i: ([], []) for i in range(n_layers)}
        for _, k, where in entries:
            for p in where:
                ids.append(samples[k][p] if k >= 0 else 7)
                positions.append(p)
                for i in range(n_layers):
                    delta, residual = parts[max(k, 0)][i]
                    layer_rows[i][0].append(delta[p])
                    layer_rows[i][1].append(residual[p])
        out = {
            f"model.layers.{i}": [torch.stack(d).to(dtype), torch.stack(r).to(dtype)]
            for i, (d, r) in layer_rows.items()
        }
        out["model.layers.0.mlp.down_proj"] = out["model.layers.0"][0]  # a sub-module: not a layer output
        prefix = "model.forward_batch_info."
        out[prefix + "input_ids"] = torch.tensor(ids, dtype=torch.int64)
        out[prefix + "positions"] = torch.tensor(positions, dtype=torch.int64)
        out[prefix + "seq_lens"] = torch.tensor([max(w) + 1 for _, _, w in entries], dtype=torch.int64)
        out[prefix + "rids"] = [rid for rid, _, _ in entries]
        out[prefix + "forward_mode"] = "ForwardMode.EXTEND" if prefill else "ForwardMode.DECODE"
        if prefill:
            out[prefix + "extend_seq_lens"] = torch.tensor([len(w) for _, _, w in entries], dtype=torch.int64)
        return out

    records = [
        record(
            [(f"req-{k}", k, list(range(n))) for k, n in enumerate(prompt_lens)]
            + [("HEALTH_CHECK_0", -1, [0, 1])],
            prefill=True,
        )
    ]
    step = 0
    while True:
        running = []
        for k, (ids, n) in enumerate(zip(samples, prompt_lens, strict=True)):
            p = n + step
            last = len(ids) - 1 if k % 2 == 0 else len(ids) - 2
            if p <= last:
                running.append((f"req-{k}", k, [p]))
        if not running:
            break
        records.append(record(running, prefill=False))
        step += 1
    if chunk <= 1:
        for index, value in enumerate(records):
            torch.save(value, folder / f"Pass{index:05d}.pt")
    else:
        for index in range(0, len(records), chunk):
            torch.save(records[index : index + chunk], folder / f"Chunk{index // chunk:05d}.pt")
    return directory
