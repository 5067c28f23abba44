"""Tiny random HF checkpoints built locally (no hub access) for the model tests.

`save_hf_model(path, arch, **config)` builds a random transformers model of the architecture from a config dict,
saves it with `save_pretrained` as safetensors and returns the (eval, fp32) HF model. Sizes are tiny so the whole
tests/model run stays well under a minute on two CPU cores.
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


def build_hf_model(arch: str, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random-init HF model; weights get std 0.2 noise so logits spread (realistic, not near-uniform)."""
    config_cls, model_cls = hf_classes(arch)
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def save_hf_model(path: Path, arch: str, *, seed: int = 0, shard_kb: int | None = None, **overrides: Any):
    model = build_hf_model(arch, seed=seed, **overrides)
    kwargs = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
    model.save_pretrained(path, **kwargs)
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
