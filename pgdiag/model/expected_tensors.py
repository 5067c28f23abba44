"""The tensors a checkpoint must hold: every HF name and shape its config implies, checked strictly.

What: `expected_shapes(config)` lists every tensor name with its global shape (the LM head only when untied; the
expert tensors of sparse layers from `pgdiag.model.hf_experts.moe_shapes`). `check_tensor_names(config, source,
where)` compares a `TensorSource` with it before any tensor data is read: E603 wrapper prefixes (``_orig_mod.``,
``module.``, FSDP), a missing or unexpected tensor, a wrong shape, an untied model without ``lm_head.weight``;
E608 embedding rows != ``vocab_size``; E611 weights stored as integers or quantized (MXFP4 codes excepted).

Why strict (docs/models.md): a silently missing or extra tensor is a wrong logprob. ``rotary_emb.inv_freq`` is the
only file tensor allowed to go unused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgdiag.errors import Code, UsageError
from pgdiag.model.hf_experts import moe_shapes

if TYPE_CHECKING:
    from pgdiag.model.config import ModelConfig
    from pgdiag.model.tensor_source import TensorSource

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_CONVERTER_HINT = (
    "export a plain HF checkpoint first (verl: python -m verl.model_merger; slime: "
    "tools/convert_torch_dist_to_hf.py; NeMo-RL: examples/converters/convert_dcp_to_hf.py)"
)
_FLOAT_STORAGE = ("BF16", "F16", "F32", "F64")  # weights stored otherwise are quantized or integer: E611
_MXFP4_SUFFIXES = ("_blocks", "_scales")  # MXFP4 experts: uint8 codes and exponents, dequantized on load


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its global shape (lm_head only when untied)."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, rows in (("q_proj", config.q_size), ("k_proj", config.kv_size), ("v_proj", config.kv_size)):
            shapes[f"{p}self_attn.{proj}.weight"] = (rows, h)
            if config.qkv_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
        if config.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if config.attention_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_attention_heads,)
        if config.moe is not None and config.moe.sparse_layers[i]:
            shapes.update(moe_shapes(config, p))
            continue
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[f"{p}mlp.{proj}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{proj}.bias"] = (shape[0],)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_tensor_names(config: ModelConfig, source: TensorSource, where: str) -> None:
    """Strict name and shape check of the file tensors against the config (no tensor data is read)."""
    names = source.names()
    prefixed = [n for n in names if n.startswith(_WRAPPER_PREFIXES) or "._fsdp_wrapped_module." in n]
    if prefixed:
        raise UsageError(
            Code.TENSORS_MISMATCH,
            f"{where}: tensor names carry a wrapper prefix ('{prefixed[0]}')",
            _CONVERTER_HINT,
        )
    expected = expected_shapes(config)
    present = set(names)
    if not config.tie_word_embeddings and "lm_head.weight" not in present:
        raise UsageError(
            Code.TENSORS_MISMATCH,
            f"{where}: tie_word_embeddings is false but 'lm_head.weight' is missing",
            _CONVERTER_HINT,
        )
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(
            Code.TENSORS_MISMATCH, f"{where}: tensor '{missing[0]}' is missing{more}", _CONVERTER_HINT
        )
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = [
        n for n in names if n not in expected and n not in allowed_extra and not n.endswith(_IGNORED_SUFFIXES)
    ]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UsageError(
            Code.TENSORS_MISMATCH,
            f"{where}: unexpected tensor '{unexpected[0]}'{more} for {config.architecture}",
            _CONVERTER_HINT,
        )
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in present and source.shape(name)[0] != config.vocab_size:
            raise UsageError(
                Code.EMBEDDING_ROWS,
                f"{where}: '{name}' has {source.shape(name)[0]} rows but vocab_size is {config.vocab_size}",
            )
    for name in expected:
        stored = source.stored_dtype(name)
        wanted = ("U8",) if name.endswith(_MXFP4_SUFFIXES) else _FLOAT_STORAGE
        if stored not in wanted:
            raise UsageError(
                Code.NON_FLOAT_WEIGHTS,
                f"{where}: tensor '{name}' is stored as {stored}; pgdiag reads {' or '.join(wanted)} weights",
                "a quantized or integer checkpoint cannot be recomputed: give the bf16/fp16/fp32 checkpoint "
                "it was made from",
            )
    for name, shape in expected.items():
        if source.shape(name) != shape:
            raise UsageError(
                Code.TENSORS_MISMATCH,
                f"{where}: tensor '{name}' has shape {list(source.shape(name))}, config implies {list(shape)}",
            )
