"""A real TRL `GRPOTrainer` run on the CPU: a tiny random Qwen3 and a word-level tokenizer, both made here.

`save_tiny_qwen3(path)` writes the model and tokenizer (no download). `run_grpo(model_dir, work_dir, ...)` trains
for `max_steps` optimizer steps (default 2) with `num_iterations` 2 (so TRL computes old log-probs), β = 0.1
(so it logs KL), two toy reward functions, and returns the trainer, whose `state.log_history` holds what TRL
logged. `hook_dir` installs `pgdiag.capture.trl` before training. Seeds are fixed: two runs with the same
arguments train identically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hf_tiny import build_hf_model

VOCAB = 48
EOS_ID, PAD_ID = 1, 0


def save_tiny_qwen3(path: Path, *, seed: int = 0) -> Path:
    """A random 2-layer Qwen3 (vocab 48) and its tokenizer, saved with `save_pretrained` into `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")
    model = build_hf_model(
        "Qwen3ForCausalLM", seed=seed, scale=0.3, vocab_size=VOCAB, intermediate_size=64, head_dim=8,
        max_position_embeddings=64, eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None,
        tie_word_embeddings=True,
    )  # fmt: skip
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # (V, H), tied with the LM head
        embed[EOS_ID] *= 2.5  # EOS is sampled often enough that some completions stop, some are truncated
    model.save_pretrained(path)
    hf_tokenizer.save_pretrained(path)
    return path


def prompts_dataset(n_prompts: int = 4) -> Any:
    from datasets import Dataset

    prompts = [
        " ".join(f"w{(5 * i + 3 * j) % (VOCAB - 4) + 2}" for j in range(3 + i % 3)) for i in range(n_prompts)
    ]
    return Dataset.from_dict({"prompt": prompts})


def reward_length(completions: list[str], **_: Any) -> list[float]:
    return [len(c.split()) / 10.0 for c in completions]


def reward_w7(completions: list[str], **_: Any) -> list[float]:
    return [float(c.split().count("w7")) for c in completions]


def run_grpo(model_dir: Path, work_dir: Path, *, hook_dir: Path | None = None, **overrides: Any) -> Any:
    """Train TRL GRPOTrainer on the CPU and return it (its `state.log_history` is what TRL logged)."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    settings: dict[str, Any] = {
        "output_dir": str(work_dir),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 10,
        "num_iterations": 2,
        "beta": 0.1,
        "learning_rate": 0.02,
        "lr_scheduler_type": "constant",
        "max_steps": 2,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "bf16": False,
        "disable_tqdm": True,
    }
    settings.update(overrides)
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[reward_length, reward_w7],
        args=GRPOConfig(**settings),
        train_dataset=prompts_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    if hook_dir is not None:
        import pgdiag.capture.trl

        pgdiag.capture.trl.install(trainer, hook_dir)
    trainer.train()
    return trainer
