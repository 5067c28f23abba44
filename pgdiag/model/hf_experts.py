"""HF expert tensors of mixture-of-experts checkpoints: their names and shapes, and how they become the model's stacks.

What: `moe_shapes(config, prefix)` lists the HF tensors of one sparse layer; `read_experts(source, config, layout,
prefix, param)` reads this rank's experts of one canonical parameter (`pgdiag.model.moe.ExpertWeights`: ``gate_up``
(E_local, 2I, H) gate rows first, ``down`` (E_local, H, I), and the gpt-oss biases) from Qwen2/3-MoE
``mlp.experts.<e>.{gate,up,down}_proj.weight``, Mixtral ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight``, or
gpt-oss fused ``mlp.experts.gate_up_proj`` (E, H, 2I, gate and up interleaved) and ``down_proj`` (E, I, H) with
their biases, or their MXFP4 form (``*_blocks`` uint8 (E, R, C/32, 16) two FP4 values per byte, low nibble first,
and ``*_scales`` uint8 (E, R, C/32) biased-127 powers of two), dequantized with `dequantize_mxfp4`.
`expert_role(name)` tells which model parameters are expert stacks.

Why apart: three weight layouts and a 4-bit format, one job (HF expert layout -> canonical stacks); the loader
(`pgdiag.model.checkpoint`) and the strict name check (`pgdiag.model.expected_tensors`) use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pgdiag.model.tp import TensorSlice

if TYPE_CHECKING:
    from pgdiag.model.config import ModelConfig
    from pgdiag.model.tensor_source import TensorSource
    from pgdiag.model.tp import TPLayout

_QWEN_EXPERT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def moe_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
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


def read_experts(
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


def expert_role(name: str) -> tuple[str, str]:
    """(``model.layers.3.``, ``gate_up``) for a canonical expert parameter name, else ("", "")."""
    for block in (".mlp.experts.", ".block_sparse_moe.experts."):
        layer, sep, param = name.partition(block)
        if sep and param in ("gate_up", "down", "gate_up_bias", "down_bias"):
            return layer + ".", param
    return "", ""
