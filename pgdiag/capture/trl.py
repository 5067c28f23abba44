"""TRL hook: `install(trainer, out_dir, every=1)` records what a `GRPOTrainer` generated and scored.

Add to the training script, after building the trainer and before ``trainer.train()``::

    import pgdiag.capture.trl
    pgdiag.capture.trl.install(trainer, "dumps/trl")

It wraps three methods of that trainer object (checked against TRL 1.16.0, `trl/trainer/grpo_trainer.py`):

* `_generate(prompts)`: keeps each row's prompt and completion lengths from the returned id lists and whether
  the completion ends in an EOS or pad token (TRL's own `is_truncated` test);
* `_calculate_rewards(inputs, prompts, completions, completion_ids_list)`: keeps this process's slice of the
  gathered `rewards_per_func` (B, F);
* `_generate_and_score_completions(inputs)`: records its output dict (prompt/completion ids and masks, the
  sampling/old/ref per-token log-probs when present, advantages) with the two above, in training mode only,
  into ``step_<global_step>.pt`` (``.rank<R>`` with several processes). Rows are in generation order:
  `_prepare_inputs` shuffles and splits the output only afterwards.
* colocate mode (``use_vllm``, ``vllm_mode="colocate"``): also the engine's ``trainer.vllm_generation.llm.generate``,
  whose `CompletionOutput`s carry the kept sets when vLLM runs with ``return_sampling_mask=True`` (vLLM PR
  #49577, `pgdiag.capture.kept`); they are matched to this process's rows by token ids (a TP rank keeps one
  slice) and recorded as the lists ``sampling_kept_ids`` / ``sampling_kept_counts`` (/ ``_logprobs``). Server
  mode: TRL's ``/generate/`` reply carries no kept sets (TRL 1.16 `vllm_client.py`), so none are recorded.

Light and inert: the standard library and torch only; the originals are called with the same arguments and
their results returned unchanged; values are copied to the CPU; an error disables the hook (logged once).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from pgdiag.capture.dump import HookRecorder, cpu_copy, framework_version, plain, write_hookdump
from pgdiag.capture.kept import completion_sets, kept_lists, match_rows

_STREAMS = ("sampling_per_token_logps", "old_per_token_logps", "ref_per_token_logps")


class _TrlRecorder(HookRecorder):
    """Per-trainer state: the pending lengths and rewards of the generation in flight."""

    def __init__(self, trainer: Any, out_dir: Path, every: int) -> None:
        super().__init__(trainer, out_dir, every, "trl")
        self.pending: dict[str, Any] = {}
        self.pending_lists: dict[str, list[Any]] = {}
        self.engine_outputs: list[tuple[list[int], Any]] = []  # (token ids, CompletionOutput) of this step
        self.recording = False

    def begin(self) -> None:
        self.pending = {}
        self.pending_lists = {}
        self.engine_outputs = []
        step = int(self.trainer.state.global_step)
        self.recording = bool(self.trainer.model.training) and step % self.every == 0

    def after_generate(self, result: tuple[Any, ...]) -> None:
        if not self.recording:
            return
        prompt_ids, completion_ids = result[0], result[1]
        tokenizer = self.trainer._tokenizer
        stop_ids = {*self.trainer.eos_token_ids, tokenizer.pad_token_id}
        self.pending["prompt_lengths"] = torch.tensor([len(ids) for ids in prompt_ids], dtype=torch.int64)
        self.pending["completion_lengths"] = torch.tensor(
            [len(ids) for ids in completion_ids], dtype=torch.int64
        )
        self.pending["truncated"] = torch.tensor(
            [len(ids) == 0 or int(ids[-1]) not in stop_ids for ids in completion_ids], dtype=torch.bool
        )
        matched = match_rows(self.engine_outputs, completion_ids) if self.engine_outputs else None
        if matched is not None:  # the colocated engine returned kept sets (vLLM sampling_mask)
            sets = [completion_sets(out, ids) for out, ids in zip(matched, completion_ids, strict=True)]
            self.pending_lists = kept_lists(sets)
        self.engine_outputs = []

    def after_engine(self, request_outputs: Any) -> None:
        if not self.recording:
            return
        for request in request_outputs:
            for out in getattr(request, "outputs", None) or []:
                self.engine_outputs.append(([int(t) for t in out.token_ids], out))

    def after_rewards(self, prompts: list[Any], rewards_per_func: torch.Tensor) -> None:
        if not self.recording:
            return
        rank = int(self.trainer.accelerator.process_index)
        local = rewards_per_func[rank * len(prompts) : (rank + 1) * len(prompts)]  # (B, F)
        self.pending["rewards_per_func"] = cpu_copy(local)

    def after_score(self, output: dict[str, Any]) -> None:
        if not self.recording:
            return
        trainer = self.trainer
        tensors: dict[str, torch.Tensor] = {
            "prompt_ids": cpu_copy(output["prompt_ids"]),  # (B, P) left-padded
            "completion_ids": cpu_copy(output["completion_ids"]),  # (B, C) right-padded
            "completion_mask": cpu_copy(output["completion_mask"]),  # (B, C)
            "advantages": cpu_copy(output["advantages"]),  # (B,)
        }
        completion_shape = output["completion_ids"].shape
        tool_mask = output.get("tool_mask")
        tensors["tool_mask"] = (
            cpu_copy(tool_mask) if tool_mask is not None else torch.ones(completion_shape, dtype=torch.int64)
        )
        for name in _STREAMS:
            if output.get(name) is not None:
                tensors[name] = cpu_copy(output[name])  # (B, C)
        tensors.update(self.pending)  # prompt_lengths, completion_lengths, truncated, rewards_per_func
        if "rewards_per_func" in tensors:
            per_func = tensors["rewards_per_func"]  # (B, F)
            weights = cpu_copy(trainer.reward_weights)  # (F,)
            rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)  # (B,) as TRL logs it
            rewards[torch.isnan(per_func).all(dim=1)] = math.nan
            tensors["rewards"] = rewards
        args = trainer.args
        meta = {
            "reward_func_names": [str(name) for name in trainer.reward_func_names],
            "n_samples_per_prompt": int(trainer.num_generations),
            "temperature": plain(getattr(args, "temperature", "unknown")),
            "top_p": plain(getattr(args, "top_p", "unknown")),
            "top_k": plain(getattr(args, "top_k", "unknown")),
            "min_p": plain(getattr(args, "min_p", "unknown")),
            "logprobs_mode": "processed",  # vLLM runs with processed_logprobs under TRL
            "tempered": True,  # TRL divides the logits by the temperature before log-softmax
            "use_vllm": bool(getattr(trainer, "use_vllm", False)),
            "vllm_importance_sampling_correction": bool(
                getattr(trainer, "vllm_importance_sampling_correction", False)
            ),
        }
        world_size = int(trainer.accelerator.num_processes)
        write_hookdump(
            self.out_dir,
            framework="trl",
            version=framework_version("trl"),
            step=int(trainer.state.global_step),
            rank=int(trainer.accelerator.process_index),
            world_size=world_size,
            tensors=tensors,
            lists=self.pending_lists,
            meta=meta,
        )
        self.pending = {}
        self.pending_lists = {}


def install(trainer: Any, out_dir: str | Path, *, every: int = 1) -> None:
    """Record every `every`-th generation of TRL `GRPOTrainer` `trainer` into `out_dir` (created if absent)."""
    recorder = _TrlRecorder.for_install(trainer, out_dir, every)
    guard = recorder.guard
    calculate_rewards = trainer._calculate_rewards
    generate_and_score = trainer._generate_and_score_completions

    def _calculate_rewards(inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        result = calculate_rewards(inputs, prompts, completions, completion_ids_list)
        guard.record(recorder.after_rewards, prompts, result)
        return result

    def _generate_and_score_completions(inputs: Any) -> Any:
        guard.record(recorder.begin)
        result = generate_and_score(inputs)
        guard.record(recorder.after_score, result)
        return result

    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)  # colocate mode only
    if llm is not None:
        llm.generate = guard.after(llm.generate, recorder.after_engine)
    trainer._generate = guard.after(trainer._generate, recorder.after_generate)
    trainer._calculate_rewards = _calculate_rewards
    trainer._generate_and_score_completions = _generate_and_score_completions
    trainer._pgdiag_hook = recorder
