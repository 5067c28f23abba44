"""Tiny random HF checkpoints built locally (no hub access), for every test that needs a real transformers model.

`save_hf_model(path, arch, **config)` builds a random transformers model of the architecture from a config dict
(on top of `TINY`), its weights drawn anew (norms 1 + 0.1·N(0, 1), the rest `scale`·N(0, 1)), saves it with
`save_pretrained` as safetensors and returns the (eval, fp32) HF model. `save_scaled_qwen3(path, seed=...,
head_scale=...)` keeps transformers' own init of a tiny Qwen3 (`QWEN3`: GQA, qk-norm, head_dim != hidden/heads)
and scales its LM head so entropies are well below log V, as a trained LM's are. Both are deterministic in their
seed and sizes, which the values pinned by the tests depend on. Sizes are tiny so the whole tests/model run stays
well under a minute on two CPU cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY: dict[str, Any] = {
    "vocab_size": 251,  # odd: the last vocab tile and uneven TP splits are exercised
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}


def hf_classes(arch: str) -> tuple[type, type]:
    import transformers

    family = arch.removesuffix("ForCausalLM")
    return getattr(transformers, f"{family}Config"), getattr(transformers, arch)


def build_hf_model(arch: str, *, seed: int = 0, scale: float = 0.2, **overrides: Any) -> torch.nn.Module:
    """A random-init HF model; weights get std `scale` noise so logits spread (realistic, not near-uniform)."""
    config_cls, model_cls = hf_classes(arch)
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
    return model


def save_hf_model(
    path: Path, arch: str, *, seed: int = 0, scale: float = 0.2, shard_kb: int | None = None, **overrides: Any
):
    model = build_hf_model(arch, seed=seed, scale=scale, **overrides)
    kwargs = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
    model.save_pretrained(path, **kwargs)
    return model


def save_tiny_llama(
    path: Path, *, seed: int, vocab_size: int, max_position_embeddings: int
) -> torch.nn.Module:
    """A tiny Llama with an untied head and weights of std 0.3 (`save_hf_model`), for the loss-logits and tau tests."""
    return save_hf_model(
        path, "LlamaForCausalLM", seed=seed, scale=0.3, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
    )  # fmt: skip


QWEN3: dict[str, Any] = {
    "vocab_size": 97,  # odd, so a TP split is uneven
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attn_implementation": "eager",
}


def save_scaled_qwen3(
    path: Path, *, seed: int, head_scale: float, embed_scale: float = 1.0, **overrides: Any
) -> torch.nn.Module:
    """A tiny Qwen3 (`QWEN3` with `overrides`) with transformers' own init under `seed`, its LM head multiplied by
    `head_scale` (and its embedding by `embed_scale`), saved as safetensors at `path`; returns the fp32 HF model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**QWEN3, **overrides})).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        if embed_scale != 1.0:
            model.model.embed_tokens.weight.mul_(embed_scale)
    model.save_pretrained(path, safe_serialization=True)
    return model


def packed_inputs(
    lengths: list[int], vocab: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random token ids for documents of `lengths`, packed: input_ids (N,), position_ids (N,), cu_seqlens (D+1,)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu
