"""`ModelConfig`: the decoder's shape and options, read from a Hugging Face ``config.json``.

What: one frozen dataclass for the four supported dense decoders (Llama 2/3, Qwen2/2.5, Qwen3, Mistral) and the
four mixture-of-experts ones (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss; their MoE fields in `MoeConfig`). The
architectures differ only in config fields (biases, q/k norm, head_dim, RoPE scaling, sliding windows, sinks,
routing), so one model implementation (`transformer.py`, `moe.py`) serves them all (docs/models.md).

Why strict: pgdiag exists to find small numerical mismatches, so a guessed field is a wrong number. Every value
comes from ``config.json`` or from the documented HF default for that architecture; anything else is a one-line
`UsageError` (docs/models.md): E601 unsupported architecture, E602 unsupported RoPE, E604 missing
file, E606 a needed field is missing or has an unsupported value. No code from the checkpoint ever runs
(``auto_map`` is ignored).

How: `read_model_config(path)` reads ``path/config.json``; `ModelConfig.from_hf_dict(d)` parses a dict. All sizes
are global; per-rank sizes live in `pgdiag.model.tp.TPLayout` with a ``local_`` prefix.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgdiag.errors import Code, UsageError

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies: the type and its scaling fields (unused fields keep their neutral value)."""

    rope_type: str  # one of ROPE_TYPES
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    attention_factor: float | None = None  # yarn: None = derived from factor / mscale
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts part of a config: routing rule, expert shapes and which layers are sparse.

    Routers (`router`): ``softmax_topk`` = softmax over all experts in fp32, keep the top-k probabilities,
    renormalize them when `norm_topk_prob` (Qwen2/3-MoE; Mixtral always renormalizes, which equals a softmax over
    the selected logits); ``topk_softmax`` = top-k of the raw logits (plus the router bias), softmax over those k
    (gpt-oss). Experts are SwiGLU (``silu``) or gpt-oss's clamped SwiGLU (``clamped_swiglu``:
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    router: str  # "softmax_topk" or "topk_softmax"
    norm_topk_prob: bool
    router_bias: bool  # the router linear has a bias (gpt-oss)
    expert_bias: bool  # gate/up and down of every expert have a bias (gpt-oss)
    activation: str  # "silu" or "clamped_swiglu"
    swiglu_alpha: float  # clamped_swiglu only
    swiglu_limit: float  # clamped_swiglu only
    shared_expert_intermediate_size: int  # Qwen2-MoE's sigmoid-gated shared expert; 0 = none
    sparse_layers: tuple[bool, ...]  # per layer: True = MoE block, False = dense MLP of intermediate_size
    weight_layout: (
        str  # "qwen" (mlp.experts.E.gate_proj), "mixtral" (block_sparse_moe.experts.E.w1), "gpt_oss"
    )
    mxfp4: bool  # gpt-oss expert weights stored as MXFP4 blocks and scales, dequantized at load

    @property
    def sparse_layer_indices(self) -> tuple[int, ...]:
        """Indices of the MoE layers, in order: the layer axis of recorded routes."""
        return tuple(i for i, sparse in enumerate(self.sparse_layers) if sparse)


@dataclass(frozen=True)
class ModelConfig:
    """Global sizes and options of a dense decoder, as `config.json` states them."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q_proj, k_proj, v_proj carry a bias
    o_bias: bool  # o_proj carries a bias
    mlp_bias: bool  # gate_proj, up_proj, down_proj carry a bias
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    rope: RopeConfig
    sliding_windows: tuple[int | None, ...]  # per layer: window width in tokens, None = full causal
    storage_dtype: str | None  # "fp32" / "bf16" / "fp16" as config.json declares it, None if absent
    config_sha256: str  # sha256 of the config.json bytes ("" when built from a dict)
    moe: MoeConfig | None = None  # None = dense
    attention_sinks: bool = False  # one learned sink logit per head (gpt-oss: self_attn.sinks)
    norm_weight_fp32: bool = False  # RMSNorm multiplies its weight before the cast back (gpt-oss)

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], *, source: str = "config.json", sha256: str = ""
    ) -> ModelConfig:
        """Parse a HF config dict; `source` names the file in error messages."""
        return _parse(raw, source, sha256)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def non_embedding_params(self) -> int:
        """Parameters excluding the input embedding (the lm_head counts: it is a matmul per token)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * d
        if self.attention_sinks:
            attn += self.num_attention_heads
        total = self.num_hidden_layers * (attn + 2 * h) + h + self.vocab_size * h
        for sparse in self.moe.sparse_layers if self.moe else (False,) * self.num_hidden_layers:
            total += self._mlp_params(sparse, active=False)
        return total

    def active_params(self) -> int:
        """Parameters a token multiplies by, excluding the input embedding: the attention, the router, the top-k
        experts and any shared expert (equal to `non_embedding_params` for a dense model). The FLOPs of a
        forward are 2 x this per token plus attention."""
        if self.moe is None:
            return self.non_embedding_params()
        dense = self.non_embedding_params() - sum(
            self._mlp_params(s, active=False) for s in self.moe.sparse_layers
        )
        return dense + sum(self._mlp_params(s, active=True) for s in self.moe.sparse_layers)

    def _mlp_params(self, sparse: bool, *, active: bool) -> int:
        h = self.hidden_size
        if not sparse or self.moe is None:
            return 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        moe = self.moe
        i = moe.expert_intermediate_size
        expert = 3 * h * i + (2 * i + h if moe.expert_bias else 0)
        router = moe.num_experts * h + (moe.num_experts if moe.router_bias else 0)
        shared = 3 * h * moe.shared_expert_intermediate_size + (
            h if moe.shared_expert_intermediate_size else 0
        )
        return router + shared + expert * (moe.top_k if active else moe.num_experts)


def read_model_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(
            Code.CHECKPOINT_FILE_MISSING,
            f"{file}: config.json not found",
            "point --model at a HF checkpoint directory",
        )
    data = file.read_bytes()
    try:
        raw = json.loads(data)
    except json.JSONDecodeError as exc:
        raise UsageError(
            Code.BAD_MODEL_CONFIG, f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})"
        ) from None
    if not isinstance(raw, dict):
        raise UsageError(Code.BAD_MODEL_CONFIG, f"{file}: expected a JSON object")
    return _parse(raw, str(file), hashlib.sha256(data).hexdigest())


def _field(raw: dict[str, Any], name: str, kind: type, source: str, default: Any = None) -> Any:
    """A typed field; missing without a default is E606."""
    value = raw.get(name)
    if value is None:
        if default is None:
            raise UsageError(
                Code.BAD_MODEL_CONFIG,
                f"{source}: field '{name}' is missing and has no default for this model",
            )
        return default
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise UsageError(
            Code.BAD_MODEL_CONFIG, f"{source}: field '{name}' must be {kind.__name__}, got {value!r}"
        )
    return value


def _parse(raw: dict[str, Any], source: str, sha256: str) -> ModelConfig:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise UsageError(
            Code.BAD_MODEL_CONFIG,
            f"{source}: field 'architectures' is missing; cannot tell which model this is",
        )
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UsageError(
            Code.UNSUPPORTED_ARCHITECTURE,
            f"unsupported architecture '{arch}'; supported: Llama, Mistral, Qwen2, Qwen3 (dense), "
            "Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss. pgdiag never runs checkpoint code.",
        )

    def req(name: str, kind: type = int) -> Any:
        return _field(raw, name, kind, source)

    hidden = req("hidden_size")
    heads = req("num_attention_heads")
    layers = req("num_hidden_layers")
    kv_heads = _field(raw, "num_key_value_heads", int, source, heads)
    for name, value in (
        ("hidden_size", hidden),
        ("num_attention_heads", heads),
        ("num_hidden_layers", layers),
    ):
        if value <= 0:
            raise UsageError(Code.BAD_MODEL_CONFIG, f"{source}: field '{name}' must be positive, got {value}")
    head_dim_default = hidden // heads if hidden % heads == 0 else None
    head_dim = _field(raw, "head_dim", int, source, head_dim_default)
    if head_dim <= 0 or req("vocab_size") <= 0:
        raise UsageError(Code.BAD_MODEL_CONFIG, f"{source}: head_dim and vocab_size must be positive")
    act = _field(raw, "hidden_act", str, source, "silu")
    if act != "silu":
        raise UsageError(
            Code.BAD_MODEL_CONFIG, f"{source}: hidden_act '{act}' is not supported (only 'silu')"
        )
    if kv_heads <= 0 or heads % kv_heads != 0:
        raise UsageError(
            Code.BAD_MODEL_CONFIG,
            f"{source}: num_attention_heads {heads} is not a multiple of kv heads {kv_heads}",
        )
    if head_dim % 2 != 0:
        raise UsageError(Code.BAD_MODEL_CONFIG, f"{source}: head_dim {head_dim} must be even for RoPE")

    attention_bias = _field(raw, "attention_bias", bool, source, False)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    no_bias = arch in ("MistralForCausalLM", "MixtralForCausalLM")
    # Qwen2: q/k/v bias always on, o_proj bias always off, whatever the config says (HF modular_qwen2.py).
    qkv_bias = True if is_qwen2 else (attention_bias and not no_bias)
    o_bias = False if is_qwen2 else (attention_bias and not no_bias)
    if arch == "Qwen2MoeForCausalLM":  # q/k/v bias from `qkv_bias` (default on), o_proj never
        qkv_bias, o_bias = _field(raw, "qkv_bias", bool, source, True), False
    mlp_bias = arch == "LlamaForCausalLM" and _field(raw, "mlp_bias", bool, source, False)
    max_pos = _field(raw, "max_position_embeddings", int, source, 0)
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    return ModelConfig(
        architecture=arch,
        vocab_size=req("vocab_size"),
        hidden_size=hidden,
        intermediate_size=req("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=req("rms_norm_eps", float),
        max_position_embeddings=max_pos,
        tie_word_embeddings=_field(raw, "tie_word_embeddings", bool, source, False),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        rope=_parse_rope(raw, source, max_pos),
        sliding_windows=_parse_sliding_windows(raw, arch, layers, source),
        storage_dtype=_DTYPE_NAMES.get(dtype_name, dtype_name) if isinstance(dtype_name, str) else None,
        config_sha256=sha256,
        moe=_parse_moe(raw, arch, layers, source) if arch in MOE_ARCHITECTURES else None,
        attention_sinks=arch == "GptOssForCausalLM",
        norm_weight_fp32=arch == "GptOssForCausalLM",
    )


def _parse_moe(raw: dict[str, Any], arch: str, layers: int, source: str) -> MoeConfig:
    """The MoE fields of the four supported MoE architectures (names and defaults as HF's config classes)."""

    def req(name: str, kind: type = int) -> Any:
        return _field(raw, name, kind, source)

    qwen = arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
    # transformers 5 writes Qwen3-MoE's count as num_local_experts; released checkpoints say num_experts
    experts = raw.get("num_experts") if qwen and "num_experts" in raw else req("num_local_experts")
    if not isinstance(experts, int) or isinstance(experts, bool):
        raise UsageError(Code.BAD_MODEL_CONFIG, f"{source}: field 'num_experts' must be int, got {experts!r}")
    top_k = req("num_experts_per_tok")
    if experts <= 0 or not 0 < top_k <= experts:
        raise UsageError(
            Code.BAD_MODEL_CONFIG, f"{source}: num_experts_per_tok {top_k} must be in 1..{experts} experts"
        )
    sparse = (True,) * layers
    if qwen:
        only_dense = raw.get("mlp_only_layers") or []
        step = _field(raw, "decoder_sparse_step", int, source, 1)
        if not isinstance(only_dense, list) or not all(isinstance(i, int) for i in only_dense) or step < 1:
            raise UsageError(
                Code.BAD_MODEL_CONFIG,
                f"{source}: 'mlp_only_layers' must list layer indices, decoder_sparse_step >= 1",
            )
        sparse = tuple(i not in only_dense and (i + 1) % step == 0 for i in range(layers))
    gpt_oss = arch == "GptOssForCausalLM"
    quant = raw.get("quantization_config")
    mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"
    if quant is not None and not (gpt_oss and mxfp4):
        raise UsageError(
            Code.BAD_MODEL_CONFIG,
            f"{source}: quantization_config {quant!r} is not supported (only gpt-oss MXFP4)",
        )
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=req("moe_intermediate_size") if qwen else req("intermediate_size"),
        router="topk_softmax" if gpt_oss else "softmax_topk",
        norm_topk_prob=_field(raw, "norm_topk_prob", bool, source, False) if qwen else not gpt_oss,
        router_bias=gpt_oss,
        expert_bias=gpt_oss,
        activation="clamped_swiglu" if gpt_oss else "silu",
        swiglu_alpha=_field(raw, "swiglu_alpha", float, source, 1.702) if gpt_oss else 0.0,
        swiglu_limit=_field(raw, "swiglu_limit", float, source, 7.0) if gpt_oss else 0.0,
        shared_expert_intermediate_size=(
            req("shared_expert_intermediate_size") if arch == "Qwen2MoeForCausalLM" else 0
        ),
        sparse_layers=sparse,
        weight_layout="qwen" if qwen else ("gpt_oss" if gpt_oss else "mixtral"),
        mxfp4=mxfp4,
    )


def _parse_sliding_windows(
    raw: dict[str, Any], arch: str, layers: int, source: str
) -> tuple[int | None, ...]:
    """Per-layer window widths. Mistral: one width for every layer. Qwen2/3: `layer_types`, else
    `use_sliding_window` + `max_window_layers` (layers at index >= max_window_layers slide)."""
    if arch == "LlamaForCausalLM":
        return (None,) * layers
    if (
        arch == "Qwen3MoeForCausalLM"
    ):  # one width for every layer, only when use_sliding_window (HF config class)
        used = _field(raw, "use_sliding_window", bool, source, False)
        return ((_field(raw, "sliding_window", int, source, 0) or None) if used else None,) * layers
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (_field(raw, "sliding_window", int, source, 0) or None,) * layers
    use = _field(raw, "use_sliding_window", bool, source, False)
    window = raw.get("sliding_window") if use else None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise UsageError(
                Code.BAD_MODEL_CONFIG, f"{source}: 'layer_types' must list one type per layer ({layers})"
            )
        unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise UsageError(
                Code.BAD_MODEL_CONFIG, f"{source}: unsupported layer type {unknown[0]!r} in 'layer_types'"
            )
        if "sliding_attention" in layer_types:
            window = _field(raw, "sliding_window", int, source)
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if window is None:
        return (None,) * layers
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise UsageError(
            Code.BAD_MODEL_CONFIG, f"{source}: field 'sliding_window' must be a positive int, got {window!r}"
        )
    first = _field(raw, "max_window_layers", int, source, layers)
    return tuple(window if i >= first else None for i in range(layers))


def _rope_from_dict(d: dict[str, Any], theta: Any, source: str, max_pos: int) -> RopeConfig:
    """One RoPE dict (v4 `rope_scaling` or v5 `rope_parameters`) -> RopeConfig."""
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UsageError(
            Code.UNSUPPORTED_ROPE,
            f"{source}: RoPE type {rope_type!r} is not supported; supported: {ROPE_TYPES}",
        )
    partial = d.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise UsageError(
            Code.UNSUPPORTED_ROPE, f"{source}: partial_rotary_factor {partial} is not supported (only 1.0)"
        )
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise UsageError(
            Code.BAD_MODEL_CONFIG, f"{source}: field 'rope_theta' is missing or not a positive number"
        )

    def num(name: str, default: float | None) -> float | None:
        value = d.get(name, default)
        if value is None:
            if default is None and rope_type in ("linear", "llama3", "yarn") and name == "factor":
                raise UsageError(
                    Code.BAD_MODEL_CONFIG, f"{source}: RoPE type '{rope_type}' needs field 'factor'"
                )
            return None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise UsageError(
                Code.BAD_MODEL_CONFIG, f"{source}: RoPE field '{name}' must be a number, got {value!r}"
            )
        return float(value)

    factor = num("factor", None if rope_type != "default" else 1.0)
    original = d.get("original_max_position_embeddings", max_pos)
    if rope_type in ("llama3", "yarn") and not (isinstance(original, int) and original > 0):
        raise UsageError(
            Code.BAD_MODEL_CONFIG,
            f"{source}: RoPE type '{rope_type}' needs 'original_max_position_embeddings'",
        )
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=factor if factor is not None else 1.0,
        low_freq_factor=num("low_freq_factor", 1.0) or 1.0,
        high_freq_factor=num("high_freq_factor", 4.0) or 4.0,
        original_max_position_embeddings=int(original) if rope_type in ("llama3", "yarn") else 0,
        attention_factor=num("attention_factor", None) if rope_type == "yarn" else None,
        beta_fast=num("beta_fast", 32.0) or 32.0,
        beta_slow=num("beta_slow", 1.0) or 1.0,
        mscale=num("mscale", None) if rope_type == "yarn" else None,
        mscale_all_dim=num("mscale_all_dim", None) if rope_type == "yarn" else None,
        truncate=bool(d.get("truncate", True)),
    )


def _parse_rope(raw: dict[str, Any], source: str, max_pos: int) -> RopeConfig:
    """Both layouts: v4 top-level `rope_theta` + `rope_scaling`, v5 `rope_parameters`; E602 if they disagree."""
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UsageError(
            Code.UNSUPPORTED_ROPE,
            f"{source}: partial_rotary_factor {raw['partial_rotary_factor']} is not supported",
        )
    v4_scaling = raw.get("rope_scaling") or {}
    v4_theta = raw.get("rope_theta")
    v5 = raw.get("rope_parameters")
    if not isinstance(v4_scaling, dict) or (v5 is not None and not isinstance(v5, dict)):
        raise UsageError(
            Code.UNSUPPORTED_ROPE, f"{source}: 'rope_scaling' / 'rope_parameters' must be JSON objects"
        )
    if v5 and any(isinstance(v, dict) for v in v5.values()):
        raise UsageError(
            Code.UNSUPPORTED_ROPE, f"{source}: per-layer nested 'rope_parameters' are not supported"
        )
    v4 = _rope_from_dict(v4_scaling, v4_theta, source, max_pos) if v4_theta is not None else None
    if not v5:
        if v4 is None:
            raise UsageError(
                Code.BAD_MODEL_CONFIG,
                f"{source}: field 'rope_theta' is missing (neither v4 nor v5 RoPE layout)",
            )
        return v4
    parsed = _rope_from_dict(v5, v5.get("rope_theta", v4_theta), source, max_pos)
    if v4 is not None and v4 != parsed and (v4_scaling or not math.isclose(v4.theta, parsed.theta)):
        raise UsageError(
            Code.UNSUPPORTED_ROPE, f"{source}: 'rope_theta'/'rope_scaling' and 'rope_parameters' disagree"
        )
    return parsed
