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

Experts (MoE): HF layouts load as they are and are converted to the model's canonical per-layer stacks
(`pgdiag.model.moe.ExpertWeights`: ``gate_up`` (E_local, 2I, H) gate rows first, ``down`` (E_local, H, I)) while
loading: Qwen2/3-MoE ``mlp.experts.<e>.{gate,up,down}_proj.weight``, Mixtral ``block_sparse_moe.experts.<e>.
{w1,w3,w2}.weight``, gpt-oss fused ``mlp.experts.gate_up_proj`` (E, H, 2I, gate and up interleaved) and
``down_proj`` (E, I, H) with their biases, or their MXFP4 form (``*_blocks`` uint8 (E, R, C/32, 16) two FP4
values per byte, low nibble first, and ``*_scales`` uint8 (E, R, C/32) biased-127 powers of two), dequantized
with `dequantize_mxfp4`. Each rank reads only the experts it owns.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import Tensor

from pgdiag.errors import Code, UsageError
from pgdiag.model.attention import resolve_attention_backend
from pgdiag.model.config import ModelConfig, read_model_config
from pgdiag.model.moe import resolve_expert_impl
from pgdiag.model.tp import TensorSlice, TPLayout, group_rank_size, shard_slice, tp_layout
from pgdiag.model.transformer import CausalLM, rope_inv_freq

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_CONVERTER_HINT = (
    "export a plain HF checkpoint first (verl: python -m verl.model_merger; slime: "
    "tools/convert_torch_dist_to_hf.py; NeMo-RL: examples/converters/convert_dcp_to_hf.py)"
)


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_FLOAT_STORAGE = ("BF16", "F16", "F32", "F64")  # weights stored otherwise are quantized or integer: E611
_MXFP4_SUFFIXES = ("_blocks", "_scales")  # MXFP4 experts: uint8 codes and exponents, dequantized on load
_TORCH_STORAGE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


class TensorSource:
    """Named tensors readable one slice at a time: safetensors files (lazy) or in-memory tensors.

    The loader only calls `names`, `shape`, `is_fp32`, `dtype` and `read`; a subclass overriding those can feed
    weights from anywhere (benchmarks/bench_recompute_tp.py generates each rank's slice on the fly).
    """

    def __init__(
        self, files: Mapping[str, Path] | None = None, tensors: Mapping[str, Tensor] | None = None
    ) -> None:
        self._files = dict(files or {})  # tensor name -> safetensors file
        self._tensors = dict(tensors or {})  # tensor name -> tensor (mmap'd .bin or already in memory)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return sorted({*self._files, *self._tensors})

    def file_of(self, name: str) -> Path | None:
        """The safetensors file holding tensor `name` (None for an in-memory tensor or an unknown name)."""
        return self._files.get(name)

    def _slice(self, name: str):  # safetensors PySafeSlice
        file = self._files[name]
        try:
            if file not in self._handles:
                self._handles[file] = self._stack.enter_context(
                    safe_open(str(file), framework="pt", device="cpu")
                )
            return self._handles[file].get_slice(name)
        except (SafetensorError, OSError) as error:
            raise UsageError(
                Code.DAMAGED_SAFETENSORS, f"{file}: not a readable safetensors file ({one_line_text(error)})"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        return tuple(self._slice(name).get_shape())

    def is_fp32(self, name: str) -> bool:
        if name in self._tensors:
            return self._tensors[name].dtype == torch.float32
        return self._slice(name).get_dtype() == "F32"

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of `name` (safetensors names mapped to torch dtypes; float32 when unknown)."""
        if name in self._tensors:
            return self._tensors[name].dtype
        return _SAFETENSORS_DTYPES.get(self._slice(name).get_dtype(), torch.float32)

    def stored_dtype(self, name: str) -> str:
        """The dtype as stored, in safetensors' spelling (``BF16``, ``F32``, ``I8``, ``U8``, ...)."""
        if name in self._tensors:
            return _TORCH_STORAGE_NAMES.get(self._tensors[name].dtype, str(self._tensors[name].dtype))
        return str(self._slice(name).get_dtype())

    def read(self, name: str, part: TensorSlice | None) -> Tensor:
        """The whole tensor, or rows/columns `part.start:part.stop` along `part.dim`, without reading the rest."""
        if name in self._tensors:
            t = self._tensors[name]
            if part is None or part.stop - part.start == t.shape[part.dim]:
                return t  # shared, not copied: the caller's tensor becomes the parameter
            # a copy, so that the full tensor can be freed once every rank has its slice
            return t.narrow(part.dim, part.start, part.stop - part.start).clone()
        sl = self._slice(name)
        if part is None:
            return sl[:]
        return sl[part.start : part.stop] if part.dim == 0 else sl[:, part.start : part.stop]


def open_tensor_source(path: Path) -> TensorSource:
    """Find the weight files of a checkpoint directory; E604 when none or a shard is missing."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_index(index)
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise UsageError(
                    Code.CHECKPOINT_FILE_MISSING,
                    f"{index}: shard {shard.name} listed in weight_map is missing",
                )
        return TensorSource(files=files)
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt", device="cpu") as f:
                return TensorSource(files=dict.fromkeys(f.keys(), single))
        except (SafetensorError, OSError) as error:
            raise UsageError(
                Code.DAMAGED_SAFETENSORS,
                f"{single}: not a readable safetensors file ({one_line_text(error)})",
            ) from None
    pickles = sorted(p.name for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth") and p.is_file())
    if pickles:
        raise UsageError(
            Code.PICKLE_CHECKPOINT,
            f"{path}: {pickles[0]} is a pickle checkpoint; pgdiag loads weights only from safetensors",
            'convert it once, where you trust the file: python -c "import torch; from safetensors.torch '
            f"import save_file; save_file(torch.load('{pickles[0]}', weights_only=True), 'model.safetensors')\"",
        )
    raise UsageError(
        Code.CHECKPOINT_FILE_MISSING, f"{path}: no model.safetensors or model.safetensors.index.json"
    )


def one_line_text(error: BaseException) -> str:
    """An exception's text on one line."""
    return " ".join(str(error).split())


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UsageError(
            Code.CHECKPOINT_FILE_MISSING, f"{index}: not a valid index (needs a 'weight_map' object)"
        ) from None
    if not isinstance(weight_map, dict):
        raise UsageError(
            Code.CHECKPOINT_FILE_MISSING, f"{index}: 'weight_map' must map tensor names to shard files"
        )
    return weight_map


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
            shapes.update(_moe_shapes(config, p))
            continue
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[f"{p}mlp.{proj}.weight"] = shape
            if config.mlp_bias:
                shapes[f"{p}mlp.{proj}.bias"] = (shape[0],)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


_QWEN_EXPERT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _moe_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of one sparse layer with prefix `p` (``model.layers.3.``)."""
    moe = config.moe
    assert moe is not None
    h, e, i = config.hidden_size, moe.num_experts, moe.expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    if moe.weight_layout == "gpt_oss":
        shapes[p + "mlp.router.weight"] = (e, h)
        shapes[p + "mlp.router.bias"] = (e,)
        x = p + "mlp.experts."
        if moe.mxfp4:
            for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                shapes[f"{x}{proj}_blocks"] = (e, rows, cols // 32, 16)
                shapes[f"{x}{proj}_scales"] = (e, rows, cols // 32)
        else:
            shapes[x + "gate_up_proj"] = (e, h, 2 * i)
            shapes[x + "down_proj"] = (e, i, h)
        shapes[x + "gate_up_proj_bias"] = (e, 2 * i)
        shapes[x + "down_proj_bias"] = (e, h)
        return shapes
    block, names = (
        ("mlp.", _QWEN_EXPERT) if moe.weight_layout == "qwen" else ("block_sparse_moe.", _MIXTRAL_EXPERT)
    )
    shapes[p + block + "gate.weight"] = (e, h)
    for expert in range(e):
        for role, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            shapes[f"{p}{block}experts.{expert}.{names[role]}.weight"] = shape
    s = moe.shared_expert_intermediate_size
    if s:
        for proj, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
            shapes[f"{p}mlp.shared_expert.{proj}.weight"] = shape
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """MXFP4 -> floats: blocks uint8 (..., G, 16) hold 32 FP4 (e2m1) codes per group, low nibble first; scales
    uint8 (..., G) are the group's power of two plus 127. Returns (..., G * 32) in `dtype` (exact in bf16/fp32)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (..., G, 16, 2)
    values = lut[codes].flatten(-2)  # (..., G, 32)
    exponents = scales.to(torch.int32) - 127  # (..., G)
    return torch.ldexp(values, exponents[..., None].float()).flatten(-2).to(dtype)


def _read_experts(
    source: TensorSource, config: ModelConfig, layout: TPLayout, prefix: str, param: str
) -> tuple[Tensor, bool]:
    """One canonical expert parameter of this rank (`param` in gate_up, down, gate_up_bias, down_bias) of the
    sparse layer `prefix` (``model.layers.3.``) from the HF tensors; and whether any source tensor was fp32."""
    moe = config.moe
    assert moe is not None
    first, count = layout.expert_start, layout.local_num_experts
    experts = TensorSlice(0, first, first + count)
    if moe.weight_layout == "gpt_oss":
        x = prefix + "mlp.experts."
        if param.endswith("_bias"):
            name = x + ("gate_up_proj_bias" if param == "gate_up_bias" else "down_proj_bias")
            value = source.read(name, experts)  # (e, 2I) interleaved or (e, H)
            if param == "gate_up_bias":
                value = torch.cat((value[:, 0::2], value[:, 1::2]), dim=1)
            return value, source.is_fp32(name)
        proj = "gate_up_proj" if param == "gate_up" else "down_proj"
        if moe.mxfp4:
            blocks = source.read(f"{x}{proj}_blocks", experts)
            rows_by_cols = dequantize_mxfp4(blocks, source.read(f"{x}{proj}_scales", experts))  # (e, R, C)
            weight, fp32 = rows_by_cols, False
        else:
            weight, fp32 = source.read(x + proj, experts).transpose(1, 2), source.is_fp32(x + proj)
        if param == "gate_up":  # (e, 2I, H) rows interleaved gate, up, gate, ... -> gate rows then up rows
            weight = torch.cat((weight[:, 0::2], weight[:, 1::2]), dim=1)
        return weight.contiguous(), fp32
    block, names = (
        ("mlp.", _QWEN_EXPERT) if moe.weight_layout == "qwen" else ("block_sparse_moe.", _MIXTRAL_EXPERT)
    )
    roles = ("gate", "up") if param == "gate_up" else ("down",)
    per_expert, fp32 = [], False
    for expert in range(first, first + count):
        parts = []
        for role in roles:
            name = f"{prefix}{block}experts.{expert}.{names[role]}.weight"
            parts.append(source.read(name, None))
            fp32 = fp32 or source.is_fp32(name)
        per_expert.append(torch.cat(parts, dim=0))  # (2I, H) or (H, I)
    return torch.stack(per_expert), fp32


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


def parse_dtype(name: str, option: str) -> torch.dtype:
    if name not in DTYPES:
        raise UsageError(Code.UNKNOWN_DTYPE, f"{option} {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(
    path: str | Path,
    *,
    dtype: str = "bf16",
    head_dtype: str = "fp32",
    device: str | torch.device = "cpu",
    tp_group: dist.ProcessGroup | None = None,
    attention: str = "auto",
    fuse_pointwise: bool = False,
    experts: str = "auto",
) -> CausalLM:
    """Load a HF checkpoint directory as this rank's `CausalLM` (see the module docstring for the checks).

    `attention`: "auto", "sdpa" or "varlen" (`pgdiag.model.attention`); `fuse_pointwise`: fuse RMSNorm, RoPE
    and SwiGLU with `torch.compile` (a one-time compile; worth it on a GPU); `experts`: "auto", "loop" or
    "grouped", the expert compute of MoE layers (`pgdiag.model.moe`).
    """
    path = Path(path)
    config = read_model_config(path)
    with open_tensor_source(path) as source:
        return load_from_source(
            config, source, where=str(path), dtype=dtype, head_dtype=head_dtype, device=device,
            tp_group=tp_group, attention=attention, fuse_pointwise=fuse_pointwise, experts=experts,
        )  # fmt: skip


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
) -> CausalLM:
    """Build and fill a `CausalLM` from any `TensorSource` (files, or tensors already on the device)."""
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
    rounded = 0
    for name, _ in _body_parameters(model):
        prefix, expert_param = _expert_param(name)
        if expert_param:
            value, fp32 = _read_experts(source, config, layout, prefix, expert_param)
        else:
            value, fp32 = (
                source.read(name, shard_slice(name, source.shape(name), layout)),
                source.is_fp32(name),
            )
        rounded += int(fp32 and body != torch.float32)
        _assign(model, name, value.to(device=device, dtype=body))
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    head_part = TensorSlice(0, layout.vocab_start, layout.vocab_end)
    head_store = _head_storage_dtype(head, source.is_fp32(head_name), source.dtype(head_name))
    if config.tie_word_embeddings and layout.tp_size == 1 and head_store == body:
        head_weight = model.model.embed_tokens.weight.data  # the same rows in the same dtype: share, not copy
    else:
        head_weight = source.read(head_name, head_part).to(device=device, dtype=head_store)
    _assign(model, "lm_head.weight", head_weight)
    inv_freq, _ = rope_inv_freq(config.rope, config.head_dim)
    model.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
    model.load_warnings = tuple(_warnings(config, source, layout, where, rounded, dtype))
    return model.eval()


def _head_storage_dtype(head: torch.dtype, stored_fp32: bool, stored: torch.dtype) -> torch.dtype:
    """The dtype the LM head is kept in: `head`, except that an fp32 head of a 16-bit checkpoint keeps its
    16-bit values (exact; the kernel's fp32 head upcasts them, `kernels.lm_head_logprobs_triton.head_mode_for`),
    which halves its memory and lets the kernel multiply 16-bit W tiles instead of tf32x3 on an fp32 copy."""
    if head == torch.float32 and not stored_fp32 and stored in (torch.bfloat16, torch.float16):
        return stored
    return head


def _expert_param(name: str) -> tuple[str, str]:
    """(``model.layers.3.``, ``gate_up``) for a canonical expert parameter name, else ("", "")."""
    for block in (".mlp.experts.", ".block_sparse_moe.experts."):
        layer, sep, param = name.partition(block)
        if sep and param in ("gate_up", "down", "gate_up_bias", "down_bias"):
            return layer + ".", param
    return "", ""


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
