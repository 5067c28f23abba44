"""Strict checkpoint loading: HF safetensors (single file or sharded index) -> a `CausalLM` on one TP rank.

What: `load_model(path, dtype=, head_dtype=, device=, tp_group=)` reads ``config.json``, checks every tensor
name and shape against what the config implies, builds the model on the meta device and fills each parameter
with this rank's slice only (`safe_open(...).get_slice`, plan in `tp.py`), cast to the body dtype; the LM head
(``lm_head.weight``, or the embedding when tied) is read separately in the head dtype.

Why strict (docs/models.md): a silently missing or extra tensor is a wrong logprob. Every expected
tensor must be present with its shape, every file tensor must be used (``rotary_emb.inv_freq`` excepted). Errors
(`UsageError`, exit 2): E603 tensor names or shapes (missing, unexpected, wrong shape, prefixed names such as
``_orig_mod.``, untied without ``lm_head.weight``), E604 missing file or shard, E607 unknown dtype name,
E608 embedding rows != ``vocab_size``. Warnings on `CausalLM.load_warnings`: W606 (tied, but the file's
``lm_head.weight`` differs from the embedding: the embedding is used, as HF does) and W607 (fp32 weights
rounded to a 16-bit body dtype). A pickle checkpoint (``pytorch_model*.bin``, ``*.pt``) is refused (E609, the hint
says how to convert it), a damaged safetensors file is E610: weights load only from safetensors.

How, apart: the weight files and slices in `pgdiag.model.tensor_source` (E604, E609, E610), the strict name, shape
and storage check in `pgdiag.model.expected_tensors` (E603, E608, E611), MoE expert layouts (Qwen, Mixtral, gpt-oss,
MXFP4) converted to the model's stacks in `pgdiag.model.hf_experts`; each rank reads only the experts it owns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict, Unpack

import torch
import torch.distributed as dist
from torch import Tensor

from pgdiag.errors import Code, UsageError
from pgdiag.model.attention import resolve_attention_backend
from pgdiag.model.config import ModelConfig, read_model_config
from pgdiag.model.expected_tensors import check_tensor_names
from pgdiag.model.hf_experts import expert_role, read_experts
from pgdiag.model.moe import resolve_expert_impl
from pgdiag.model.rope import rope_inv_freq
from pgdiag.model.tensor_source import TensorSource, head_storage_dtype, open_tensor_source
from pgdiag.model.tp import TensorSlice, TPLayout, group_rank_size, shard_slice, tp_layout
from pgdiag.model.transformer import CausalLM, warm_pointwise_ops
from pgdiag.model.warmup import warm_library_kernels
from pgdiag.model.weight_stream import WeightStream

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str, option: str) -> torch.dtype:
    if name not in DTYPES:
        raise UsageError(Code.UNKNOWN_DTYPE, f"{option} {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


class LoadOptions(TypedDict, total=False):
    """The keyword options of `load_model` and `load_from_source` (defaults: `load_from_source`'s signature).

    `attention`: "auto", "sdpa" or "varlen" (`pgdiag.model.attention`); `fuse_pointwise`: RMSNorm, RoPE
    and SwiGLU one kernel each (Triton on CUDA, `torch.compile` elsewhere: `pgdiag.model.fused_ops`; worth it on
    a GPU); `experts`: "auto", "loop" or
    "grouped", the expert compute of MoE layers (`pgdiag.model.moe`); `stream`: the same checkpoint's tensors
    already being read onto `device` (`pgdiag.model.weight_stream.start_weight_stream`), taken from it where it
    holds them."""

    dtype: str
    head_dtype: str
    device: str | torch.device
    tp_group: dist.ProcessGroup | None
    attention: str
    fuse_pointwise: bool
    experts: str
    stream: WeightStream | None


def load_model(path: str | Path, **options: Unpack[LoadOptions]) -> CausalLM:
    """Load a HF checkpoint directory as this rank's `CausalLM` (see the module docstring for the checks;
    `LoadOptions` for the options)."""
    path = Path(path)
    config = read_model_config(path)
    with open_tensor_source(path) as source:
        return load_from_source(config, source, where=str(path), **options)


def load_from_source(
    config: ModelConfig,
    source: TensorSource,
    *,
    where: str,
    dtype: str = "bf16",
    head_dtype: str = "fp32",
    device: str | torch.device = "cpu",
    tp_group: dist.ProcessGroup | None = None,
    attention: str = "auto",
    fuse_pointwise: bool = False,
    experts: str = "auto",
    stream: WeightStream | None = None,
) -> CausalLM:
    """Build and fill a `CausalLM` from any `TensorSource` (files, or tensors already on the device); a tensor that
    `stream` holds (same name and slice) is taken from it instead of read from `source`."""
    body, head = parse_dtype(dtype, "--dtype"), parse_dtype(head_dtype, "--head-dtype")
    device = torch.device(device)
    rank, size = group_rank_size(tp_group)
    layout = tp_layout(config, size, rank)
    backend = resolve_attention_backend(attention, device, body)
    expert_impl = resolve_expert_impl(experts, device, body)
    check_tensor_names(config, source, where)
    with torch.device("meta"):
        model = CausalLM(
            config, layout, tp_group=tp_group, attention=backend, fuse_pointwise=fuse_pointwise,
            expert_impl=expert_impl,
        )  # fmt: skip
    if stream is not None:  # while the stream's threads copy the weights: Triton's kernels, cuBLAS, attention
        if fuse_pointwise:
            warm_pointwise_ops(model, device, body)
        warm_library_kernels(model, device, body)
    rounded = 0
    for name, _ in _body_parameters(model):
        prefix, expert_param = expert_role(name)
        if expert_param:
            value, fp32 = read_experts(source, config, layout, prefix, expert_param)
        else:
            part = shard_slice(name, source.shape(name), layout)
            value, fp32 = _read(source, stream, name, part), source.is_fp32(name)
        rounded += int(fp32 and body != torch.float32)
        _assign(model, name, value.to(device=device, dtype=body))
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    head_part = TensorSlice(0, layout.vocab_start, layout.vocab_end)
    head_store = head_storage_dtype(head, source.is_fp32(head_name), source.dtype(head_name))
    if config.tie_word_embeddings and layout.tp_size == 1 and head_store == body:
        head_weight = model.model.embed_tokens.weight.data  # the same rows in the same dtype: share, not copy
    else:
        head_weight = _read(source, stream, head_name, head_part).to(device=device, dtype=head_store)
    _assign(model, "lm_head.weight", head_weight)
    inv_freq, _ = rope_inv_freq(config.rope, config.head_dim)
    model.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
    model.load_warnings = tuple(_warnings(config, source, layout, where, rounded, dtype))
    return model.eval()


def _read(source: TensorSource, stream: WeightStream | None, name: str, part: TensorSlice | None) -> Tensor:
    """Tensor `name` (`part` of it): from the stream when it holds it, else read from the source."""
    value = stream.take(name, part) if stream is not None else None
    return source.read(name, part) if value is None else value


def _body_parameters(model: CausalLM) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if not n.startswith("lm_head.")]


def _assign(model: CausalLM, name: str, value: Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, attr)
    if tuple(current.shape) != tuple(value.shape):
        raise UsageError(
            Code.TENSORS_MISMATCH,
            f"tensor '{name}' slice has shape {list(value.shape)}, model expects {list(current.shape)}",
        )
    setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


def _warnings(
    config: ModelConfig, source: TensorSource, layout: TPLayout, where: str, rounded: int, dtype: str
) -> Iterator[tuple[str, str]]:
    if config.tie_word_embeddings and "lm_head.weight" in source.names():
        part = TensorSlice(0, layout.vocab_start, layout.vocab_end)
        if not torch.equal(
            source.read("lm_head.weight", part), source.read("model.embed_tokens.weight", part)
        ):
            yield (
                Code.TIED_HEAD_DIFFERS,
                f"{where}: tied embeddings but 'lm_head.weight' differs from the embedding; the embedding is used",
            )
    if rounded:
        yield (
            Code.FP32_ROUNDED,
            f"{where}: {rounded} fp32 tensors rounded to {dtype} for the body (--dtype fp32 keeps them)",
        )
