"""verl files made as verl 0.9.1 makes them, without verl installed (it needs Ray).

`save_gen_batch` writes RolloutSkip's ``<step>/gen_batch.dp`` + ``meta.json`` exactly as
`verl.utils.skip.rollout_skip.RolloutSkip.prepare_data` does: ``DataProto.save_to_disk`` is ``pickle.dump(self)``,
and ``DataProto.__getstate__`` returns ``(torch.save bytes of batch.contiguous().consolidate(),
non_tensor_batch, meta_info)`` (`verl/protocol.py`). The stand-in class below is named
``verl.protocol.DataProto`` so the pickle names the same global; the batch is a real tensordict `TensorDict`.
Its ``__setstate__`` is verl's (what plain pickle runs under ``--allow-unsafe-pickle``): the batch bytes through
``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def _data_proto_class() -> type:
    module = sys.modules.get("verl.protocol")
    if module is not None:
        return module.DataProto
    module = types.ModuleType("verl.protocol")

    @dataclass
    class DataProto:
        batch: Any = None
        non_tensor_batch: dict = field(default_factory=dict)
        meta_info: dict = field(default_factory=dict)

        def __getstate__(self) -> tuple[bytes, dict, dict]:
            batch = self.batch.contiguous().consolidate()
            buffer = io.BytesIO()
            torch.save(batch, buffer)
            return buffer.getvalue(), self.non_tensor_batch, self.meta_info

        def __setstate__(self, state: tuple[bytes, dict, dict]) -> None:
            # what plain pickle (--allow-unsafe-pickle) calls: verl's loads the batch with weights_only=False
            batch_bytes, self.non_tensor_batch, self.meta_info = state
            self.batch = torch.load(io.BytesIO(batch_bytes), weights_only=False, map_location="cpu")

        def save_to_disk(self, filepath: Path) -> None:
            with open(filepath, "wb") as f:
                pickle.dump(self, f)

    DataProto.__module__ = "verl.protocol"
    DataProto.__qualname__ = "DataProto"
    module.DataProto = DataProto
    sys.modules.setdefault("verl", types.ModuleType("verl"))
    sys.modules["verl.protocol"] = module
    return DataProto


def save_gen_batch(
    step_dir: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    non_tensor: dict,
    meta_info: dict | None = None,
) -> Path:
    """``step_dir/gen_batch.dp`` and ``step_dir/meta.json`` as RolloutSkip writes them (meta_info default
    ``{"temperature": 1.0}``)."""
    from tensordict import TensorDict

    batch = TensorDict(tensors, batch_size=[next(iter(tensors.values())).shape[0]])
    meta_info = {"temperature": 1.0} if meta_info is None else meta_info
    proto = _data_proto_class()(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)
    step_dir.mkdir(parents=True, exist_ok=True)
    proto.save_to_disk(step_dir / "gen_batch.dp")
    (step_dir / "meta.json").write_text(json.dumps({"global_steps": step}))
    return step_dir / "gen_batch.dp"
