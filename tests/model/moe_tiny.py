"""Tiny MoE configurations of the four supported architectures, shared by the MoE tests.

Each entry is (HF architecture, config overrides on top of `hf_tiny.TINY`). Sizes are tiny; the choices make the
features bind: Qwen3-MoE renormalizes the top-k and keeps layer 1 dense (`mlp_only_layers`), Qwen2-MoE has a
shared expert and three experts per token, Mixtral a sliding window, gpt-oss alternating sliding/full layers
with sinks, biases and the clamped SwiGLU (small window so it binds on the test documents).
"""

from __future__ import annotations

from typing import Any

MOE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "head_dim": 16,
        },
    ),
    "qwen3-moe-sparse-step": (
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
            "num_hidden_layers": 4,
        },
    ),
    "qwen2-moe-shared": (
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
        },
    ),
    "mixtral-sliding": (
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5},
    ),
    "gpt-oss": (
        "GptOssForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 8,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "swiglu_limit": 0.5,  # small, so the clamp binds on these weights
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            "max_position_embeddings": 131072,
        },
    ),
}
