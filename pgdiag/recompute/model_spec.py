"""The model of a recompute before its weights are read: config, device, attention backend, and how to load it.

What: `read_model_spec(model, device=..., attn=..., dtype=...)` reads a checkpoint's config (not its weights), or
takes a loaded `pgdiag.model.CausalLM` as it is, and resolves the device (E508 when CUDA is asked for and absent)
and the attention backend. `ModelSpec.meta()` is the ``model`` entry of the manifest and footers;
`ModelSpec.load(...)` loads this rank's shard.

Why apart: the plan (`pgdiag.recompute.plan`) needs the config to refuse bad settings before any weight is read,
and the load comes only once the output has been decided (`pgdiag.recompute.logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pgdiag.errors import Code, UsageError

if TYPE_CHECKING:
    from pgdiag.model import CausalLM, ModelConfig
    from pgdiag.model.weight_stream import WeightStream
    from pgdiag.recompute.launch import ParallelLayout
    from pgdiag.recompute.settings import RecomputeSettings


@dataclass(frozen=True)
class ModelSpec:
    """The model before its weights are read: config, resolved device and attention backend, how to load it."""

    source: CausalLM | Path
    config: ModelConfig
    device: torch.device
    attn: str

    def meta(self) -> dict[str, Any]:
        """The ``pgdiag.recompute.model`` metadata."""
        return {
            "path": str(self.source.resolve()) if isinstance(self.source, Path) else None,
            "architecture": self.config.architecture,
            "config_sha256": self.config.config_sha256,
            "storage_dtype": self.config.storage_dtype,
        }

    def load(
        self, *, dtype: str, head_dtype: str, tp_group: Any, experts: str, stream: WeightStream | None = None
    ) -> CausalLM:
        """This rank's shard of the model (a model passed in already loaded is returned as it is); tensors that
        `stream` holds are taken from it."""
        if not isinstance(self.source, Path):
            return self.source
        from pgdiag.model import load_model

        return load_model(
            self.source,
            dtype=dtype,
            head_dtype=head_dtype,
            device=self.device,
            tp_group=tp_group,
            attention=self.attn,
            experts="loop" if experts == "none" else experts,
            # one compiled kernel each for RMSNorm, RoPE and SwiGLU: +28% tokens/s on an H100 (docs/benchmarks.md)
            fuse_pointwise=torch.device(self.device).type == "cuda",
            stream=stream,
        )


def read_model_spec(
    model: CausalLM | str | Path, *, device: str | torch.device | None, attn: str, dtype: str
) -> ModelSpec:
    """Read the checkpoint's config (not its weights) and resolve the device and attention backend."""
    if not isinstance(model, (str, Path)):
        return ModelSpec(model, model.config, model.lm_head_weight.device, str(model.attention_backend))
    from pgdiag.model import read_model_config
    from pgdiag.model.attention import resolve_attention_backend
    from pgdiag.model.checkpoint import parse_dtype

    where = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if where.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            Code.DEVICE_UNAVAILABLE, f"device {where} requested but CUDA is not available", "use --device cpu"
        )
    config = read_model_config(model)
    backend = resolve_attention_backend(attn, where, parse_dtype(dtype, "--dtype"))
    return ModelSpec(Path(model), config, where, backend)


def start_stream(
    model: CausalLM | str | Path,
    settings: RecomputeSettings,
    layout: ParallelLayout,
    device: str | torch.device | None,
) -> WeightStream | None:
    """Start reading this rank's weights of checkpoint `model` onto the GPU in the background
    (`pgdiag.model.weight_stream`), before the run is read; None for a loaded model, a CPU device or settings the
    plan will refuse (the plan and the loader report those as before)."""
    from pgdiag.model.checkpoint import DTYPES

    if (
        not isinstance(model, (str, Path))
        or settings.dtype not in DTYPES
        or settings.head_dtype not in DTYPES
    ):
        return None
    where = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if where.type != "cuda" or not torch.cuda.is_available():
        return None
    from pgdiag.model.warmup import triton_key_thread
    from pgdiag.model.weight_stream import start_weight_stream

    stream = start_weight_stream(
        model, device=where, tp_rank=layout.tp_rank, tp_size=layout.tp_size,
        dtype=DTYPES[settings.dtype], head_dtype=DTYPES[settings.head_dtype],
    )  # fmt: skip
    triton_key_thread()  # the first Triton kernel's hash of Triton itself, meanwhile (`pgdiag.model.warmup`)
    return stream
