"""`ModelConfig` from config.json: both RoPE layouts, per-architecture defaults, refusals (E601, E602, E606)."""

from __future__ import annotations

import math

import pytest
import torch

from pgdiag.errors import UsageError
from pgdiag.model import ModelConfig
from pgdiag.model.rope import rope_inv_freq

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 251,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 2048,
}


def parse(**fields) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, **fields})


def code_of(**fields) -> tuple[str, str]:
    with pytest.raises(UsageError) as info:
        parse(**fields)
    return info.value.code, info.value.message


def test_v4_and_v5_rope_layouts_agree() -> None:
    v4 = parse(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3})
    v4_legacy_key = parse(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3})
    v5 = parse(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    assert v4.rope == v4_legacy_key.rope == v5.rope
    assert v5.rope.rope_type == "llama3" and v5.rope.original_max_position_embeddings == 2048


def test_defaults_and_head_dim() -> None:
    c = parse(rope_theta=10000.0)
    assert (c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (4, 16, False)
    assert c.sliding_windows == (None, None) and not c.qkv_bias and not c.qk_norm
    q3 = parse(architectures=["Qwen3ForCausalLM"], head_dim=32, rope_theta=1e6, attention_bias=False)
    assert q3.head_dim == 32 and q3.q_size == 128 and q3.qk_norm


def test_qwen2_bias_is_forced_whatever_the_config_says() -> None:
    c = parse(architectures=["Qwen2ForCausalLM"], rope_theta=1e6, attention_bias=False)
    assert c.qkv_bias and not c.o_bias


def test_qwen_sliding_window_layers() -> None:
    c = parse(architectures=["Qwen2ForCausalLM"], rope_theta=1e6, use_sliding_window=True, sliding_window=8,
              max_window_layers=1)  # fmt: skip
    assert c.sliding_windows == (None, 8)
    off = parse(architectures=["Qwen2ForCausalLM"], rope_theta=1e6, sliding_window=8, max_window_layers=0)
    assert off.sliding_windows == (None, None)  # use_sliding_window false: no window
    typed = parse(architectures=["Qwen3ForCausalLM"], rope_theta=1e6, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    assert typed.sliding_windows == (8, None)
    mistral = parse(architectures=["MistralForCausalLM"], rope_theta=1e6, sliding_window=16)
    assert mistral.sliding_windows == (16, 16)


@pytest.mark.parametrize(
    ("fields", "code", "text"),
    [
        ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "E602", "'longrope'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "E602",
         "partial_rotary_factor"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "E602", "nested"),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "E602", "disagree"),
        ({}, "E606", "rope_theta"),
        ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "linear"}}, "E606", "needs field 'factor'"),
        ({"rope_theta": 1e4, "hidden_size": "64"}, "E606", "'hidden_size' must be int"),
        ({"rope_theta": 1e4, "num_key_value_heads": 3}, "E606", "not a multiple"),
        ({"rope_theta": 1e4, "num_attention_heads": 0}, "E606", "'num_attention_heads' must be positive"),
        ({"rope_theta": 1e4, "head_dim": 0}, "E606", "head_dim and vocab_size must be positive"),
        ({"rope_theta": 1e4, "vocab_size": 0}, "E606", "head_dim and vocab_size must be positive"),
        ({"rope_theta": 1e4, "architectures": ["GemmaForCausalLM"]}, "E601", "'GemmaForCausalLM'"),
    ],
)  # fmt: skip
def test_refusals(fields: dict, code: str, text: str) -> None:
    got_code, message = code_of(**fields)
    assert got_code == code and text in message, message


def test_rope_frequencies_worked_examples() -> None:
    # default: theta^(-2i/D); D=4, theta=100 -> [1, 0.1]
    inv, scale = rope_inv_freq(parse(rope_theta=100.0).rope, 4)
    assert torch.allclose(inv, torch.tensor([1.0, 0.1])) and scale == 1.0
    # linear factor 2 halves every frequency
    inv, _ = rope_inv_freq(
        parse(rope_theta=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0}).rope, 4
    )
    assert torch.allclose(inv, torch.tensor([0.5, 0.05]))
    # llama3 with original length 2048, low/high factors 1/4: wavelength 2*pi (< 512) kept, wavelength
    # 2*pi*1e4^(3/4)... D=8, theta=1e4 -> inv = [1, 0.1, 0.01, 0.001]; wavelengths 6.3, 62.8, 628, 6283:
    # 6283 > 2048 -> /8; 628 in [512, 2048] -> blend with smooth = (2048/628.3 - 1)/3
    inv, _ = rope_inv_freq(parse(rope_theta=1e4, rope_scaling={"rope_type": "llama3", **LLAMA3}).rope, 8)
    smooth = (2048 / (2 * math.pi / 0.01) - 1) / 3
    expected = torch.tensor([1.0, 0.1, (1 - smooth) * 0.01 / 8 + smooth * 0.01, 0.001 / 8])
    assert torch.allclose(inv, expected, rtol=1e-6)
    # yarn: cos/sin scaled by 0.1 ln(factor) + 1
    yarn = parse(
        rope_theta=1e4,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    _, scale = rope_inv_freq(yarn.rope, 8)
    assert scale == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_rope_inv_freq_is_computed_on_the_cpu_inside_a_meta_build() -> None:
    """The model is built under ``torch.device("meta")``; the frequencies are still real CPU values (meta
    arithmetic would run PyTorch's Python references, which import torch._dynamo)."""
    rope = parse(rope_theta=10000.0).rope
    plain, scale = rope_inv_freq(rope, 8)
    with torch.device("meta"):
        inside, inside_scale = rope_inv_freq(rope, 8)
    assert inside.device.type == "cpu" and torch.equal(inside, plain) and inside_scale == scale == 1.0
    assert torch.allclose(plain, torch.tensor([1.0, 0.1, 0.01, 0.001]))  # theta ** -(2i / 8)
