"""pgdiag's native decoder for log-prob recompute: Llama 2/3, Qwen2/2.5, Qwen3, Mistral, and the MoE models
Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss (`forward_packed` also returns and replays the routing).

`load_model(path, dtype=, head_dtype=, device=, tp_group=, attention=)` reads a HF checkpoint strictly (no code
from the checkpoint ever runs) into a `CausalLM` holding this tensor-parallel rank's shard. Its
`hidden_states(input_ids, position_ids, cu_seqlens)` runs a packed batch of documents; the LM head weight
(`lm_head_weight`, this rank's vocab rows, from `vocab_start`) goes to `pgdiag.kernels.lm_head_logprobs`.
See docs/models.md.
"""

from pgdiag.model.checkpoint import load_from_source, load_model
from pgdiag.model.config import ModelConfig, RopeConfig, read_model_config
from pgdiag.model.tensor_source import TensorSource
from pgdiag.model.tp import SHARD_PLAN, TPLayout, tp_layout
from pgdiag.model.transformer import CausalLM

__all__ = [
    "SHARD_PLAN",
    "CausalLM",
    "ModelConfig",
    "RopeConfig",
    "TPLayout",
    "TensorSource",
    "load_from_source",
    "load_model",
    "read_model_config",
    "tp_layout",
]
