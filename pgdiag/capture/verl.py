"""verl hook: `install(trainer, out_dir, every=1)` records each PPO step's batch after the advantages.

Install in the process that runs ``fit()`` (the ``TaskRunnerV1`` Ray actor for the v1 trainer, e.g. from a
subclass registered with ``register_trainer`` and chosen by ``trainer.v1.trainer_mode``)::

    import pgdiag.capture.verl
    pgdiag.capture.verl.install(trainer, "dumps/verl")

Checked against verl 0.9.1 (`verl/trainer/ppo/v1/trainer_base.py`, `verl/trainer/ppo/ray_trainer.py`):

* v1 trainer (``trainer.use_v1=true``, the default): wraps ``_compute_metrics(batch, metrics, timing_raw,
  global_steps, epoch)``, which ``fit()`` calls once per step after ``step()`` and before ``tq.kv_clear``; the
  hook reads the fields from the already loaded ``transfer_queue`` with ``kv_batch_get`` (jagged rows, so
  lengths are the rows' own) and drops rows tagged ``is_padding``.
* legacy ``RayPPOTrainer``: wraps ``_update_actor(batch)``, called after ``compute_advantage``; lengths are the
  ``attention_mask`` sums over the prompt and the response columns.

Recorded: tensors `prompts` (left-padded), `responses`, `response_mask`, `rollout_log_probs`, `old_log_probs`,
`ref_log_prob`, `advantages`, `token_level_scores` (v1 `rm_scores`), `prompt_lengths`, `response_lengths`; lists
`uid`, `key` (v1), `request_id`, `min_global_steps` (v1), `data_source` and numeric reward-extra keys as
``extra.<key>`` (each when present); meta sampling and `n_samples_per_prompt` from
``actor_rollout_ref.rollout``, `bypass_mode`; step `global_steps`. Light and inert: the standard library and
torch only; results returned unchanged; an error disables the hook (logged once).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import torch

from pgdiag.capture.dump import (
    HookRecorder,
    check_install,
    cpu_copy,
    framework_version,
    plain,
    write_hookdump,
)

_RESPONSE_FIELDS = ("response_mask", "rollout_log_probs", "old_log_probs", "ref_log_prob", "advantages")
_ID_LISTS = ("uid", "request_id", "data_source")
# numeric non-tensor keys that are not rewards
_NOT_REWARD = frozenset({"index", "num_turns", "__num_turns__"})


def _config_value(config: Any, path: str) -> Any:
    """`config.a.b.c` for OmegaConf/dict/attribute configs, or "unknown" when any part is missing."""
    node = config
    for part in path.split("."):
        if node is None:
            return "unknown"
        if isinstance(node, dict) or hasattr(node, "get"):
            try:
                node = node.get(part)
                continue
            except Exception:  # an OmegaConf node without the key in struct mode
                return "unknown"
        node = getattr(node, part, None)
    return "unknown" if node is None else node


def _meta(trainer: Any) -> dict[str, Any]:
    config = getattr(trainer, "config", None)
    rollout = "actor_rollout_ref.rollout"
    bypass = _config_value(config, "algorithm.rollout_correction.bypass_mode")
    return {
        "temperature": plain(_config_value(config, f"{rollout}.temperature")),
        "top_p": plain(_config_value(config, f"{rollout}.top_p")),
        "top_k": plain(_config_value(config, f"{rollout}.top_k")),
        "n_samples_per_prompt": plain(_config_value(config, f"{rollout}.n")),
        "logprobs_mode": "unknown",
        "tempered": "unknown",
        "bypass_mode": bool(bypass) if bypass != "unknown" else False,
    }


def _pad(rows: list[torch.Tensor], *, left: bool) -> torch.Tensor:
    """(B, W) block of 1-D rows, padded with zeros on the left or the right to the widest."""
    width = max((row.shape[0] for row in rows), default=0)
    dtype = rows[0].dtype if rows else torch.float32
    out = torch.zeros((len(rows), width), dtype=dtype)
    for r, row in enumerate(rows):
        if row.shape[0]:
            if left:
                out[r, width - row.shape[0] :] = row
            else:
                out[r, : row.shape[0]] = row
    return out


def _numeric_list(values: Any) -> list[Any] | None:
    """`values` (numpy array or list) as plain numbers, or None when not all numeric."""
    items = values.tolist() if hasattr(values, "tolist") else list(values)
    if all(isinstance(v, bool | int | float) for v in items):
        return [plain(v) for v in items]
    return None


class _VerlRecorder(HookRecorder):
    def __init__(self, trainer: Any, out_dir: Path, every: int) -> None:
        super().__init__(trainer, out_dir, every, "verl")

    def _write(self, step: int, tensors: dict[str, torch.Tensor], lists: dict[str, list[Any]]) -> None:
        write_hookdump(
            self.out_dir,
            framework="verl",
            version=framework_version("verl"),
            step=step,
            rank=0,
            world_size=1,
            tensors=tensors,
            lists=lists,
            meta=_meta(self.trainer),
        )

    def legacy(self, batch: Any) -> None:
        """Record a legacy `DataProto` batch (padded blocks) at ``trainer.global_steps``."""
        step = int(self.trainer.global_steps)
        if step % self.every:
            return
        td = batch.batch
        keys = set(td.keys())
        prompts, responses = td["prompts"], td["responses"]  # (B, P) left-padded, (B, R) right-padded
        width_p = prompts.shape[1]
        attention = td["attention_mask"]  # (B, P + R)
        tensors = {
            "prompts": cpu_copy(prompts),
            "responses": cpu_copy(responses),
            "prompt_lengths": cpu_copy(attention[:, :width_p].sum(dim=1)),
            "response_lengths": cpu_copy(attention[:, width_p:].sum(dim=1)),
        }
        for name in (*_RESPONSE_FIELDS, "token_level_scores"):
            if name in keys:
                tensors[name] = cpu_copy(td[name])
        lists: dict[str, list[Any]] = {}
        for name, values in batch.non_tensor_batch.items():
            if name in _ID_LISTS:
                lists[name] = [plain(v) for v in values.tolist()]
            elif name in _NOT_REWARD:
                continue
            elif (numeric := _numeric_list(values)) is not None and len(numeric) == prompts.shape[0]:
                lists[f"extra.{name}"] = numeric
        self._write(step, tensors, lists)

    def v1(self, batch: Any, global_steps: int) -> None:
        """Record a v1 `KVBatchMeta` batch from the transfer queue, padding rows dropped."""
        step = int(global_steps)
        if step % self.every:
            return
        tq = sys.modules["transfer_queue"]  # loaded by the v1 trainer itself
        keep = [not tag.get("is_padding", False) for tag in batch.tags]

        def get(fields: list[str]) -> Any:
            return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)

        data = get(["prompts", "responses", "response_mask", "rm_scores"])
        fields: dict[str, Any] = {name: data[name] for name in ("prompts", "responses", "response_mask")}
        fields["token_level_scores"] = data["rm_scores"]
        for name in (
            "rollout_log_probs",
            "old_log_probs",
            "ref_log_prob",
            "advantages",
            "uid",
            "data_source",
        ):
            try:
                fields[name] = get([name])[name]
            except Exception:  # the field is not in the store for this configuration
                continue
        tensors: dict[str, torch.Tensor] = {}
        lists: dict[str, list[Any]] = {}
        for name, value in fields.items():
            if isinstance(value, torch.Tensor):
                rows = list(value.unbind(0)) if value.is_nested else list(value)
                rows = [cpu_copy(row) for row, kept in zip(rows, keep, strict=True) if kept]
                if name == "prompts":
                    tensors["prompt_lengths"] = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
                if name == "responses":
                    tensors["response_lengths"] = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
                tensors[name] = _pad(rows, left=name == "prompts")
            else:
                items = value.tolist() if hasattr(value, "tolist") else list(value)
                lists[name] = [plain(v) for v, kept in zip(items, keep, strict=True) if kept]
        lists["key"] = [plain(k) for k, kept in zip(batch.keys, keep, strict=True) if kept]
        lists["min_global_steps"] = [
            plain(tag.get("min_global_steps")) for tag, kept in zip(batch.tags, keep, strict=True) if kept
        ]
        self._write(step, tensors, lists)


def install(trainer: Any, out_dir: str | Path, *, every: int = 1) -> None:
    """Record every `every`-th step of verl trainer `trainer` (v1 `PPOTrainer` or legacy `RayPPOTrainer`)."""
    check_install(trainer, every)
    recorder = _VerlRecorder(trainer, Path(out_dir), every)
    guard = recorder.guard
    compute_metrics = getattr(trainer, "_compute_metrics", None)
    is_v1 = compute_metrics is not None and "global_steps" in inspect.signature(compute_metrics).parameters
    if is_v1:

        def _compute_metrics(batch: Any, metrics: Any, timing_raw: Any, global_steps: int, epoch: Any) -> Any:
            guard.record(recorder.v1, batch, global_steps)
            return compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)

        trainer._compute_metrics = _compute_metrics
    else:
        update_actor = trainer._update_actor

        def _update_actor(batch: Any) -> Any:
            guard.record(recorder.legacy, batch)
            return update_actor(batch)

        trainer._update_actor = _update_actor
    trainer._pgdiag_hook = recorder
