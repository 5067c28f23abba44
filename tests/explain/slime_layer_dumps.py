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
