"""The compile warm-up covers the forward (no graph compiled after it), and the environment `torch.compile` starts
under (`pgdiag.model.compile_env`). On the CPU `torch.compile` is given dynamo's ``eager`` backend: the guards
and graphs are dynamo's, the same as with Inductor on a GPU, without a C++ build."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hf_tiny import packed_inputs, save_hf_model
from torch._dynamo.utils import counters

import pgdiag.model.transformer as transformer
from pgdiag.model import load_model
from pgdiag.model.compile_env import prepare_compile_environment


def test_environment_sets_what_is_unset() -> None:
    environ: dict[str, str] = {}
    added = prepare_compile_environment(environ)
    assert environ == added
    assert environ["TORCH_WARM_POOL"] == "0"
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    assert environ["TRITON_CACHE_DIR"] == triton_cache_dir(0)
    assert environ["TRITON_CACHE_DIR"].endswith(str(Path("triton") / "0"))


def test_environment_leaves_the_users_choice() -> None:
    environ = {"TORCH_WARM_POOL": "1", "TRITON_CACHE_DIR": "/somewhere", "OTHER": "x"}
    assert prepare_compile_environment(environ) == {}
    assert environ == {"TORCH_WARM_POOL": "1", "TRITON_CACHE_DIR": "/somewhere", "OTHER": "x"}


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.compile` with dynamo's eager backend; the compile environment set beforehand (restored after)."""
    monkeypatch.setenv("TORCH_WARM_POOL", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/unused-triton-cache")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_warm_up_compiles_every_graph_the_forward_uses(
    tmp_path: Path, eager_compile: None, arch: str
) -> None:
    save_hf_model(tmp_path, arch)
    model = load_model(tmp_path, dtype="fp32", fuse_pointwise=True)
    counters.clear()
    transformer._warm_calls(model, torch.device("cpu"), torch.float32)
    warmed = counters["stats"]["unique_graphs"]
    # rms_norm on (n, H), rope, swiglu; with q/k norms also rms_norm on (n, heads, D)
    assert warmed == (4 if arch.startswith("Qwen3") else 3)
    ids, pos, cu = packed_inputs([5, 9, 3], model.config.vocab_size)
    counters.clear()
    with torch.inference_mode():
        model.forward_packed(ids, pos, cu)
    assert counters["stats"]["unique_graphs"] == 0  # every call of the forward met a warmed graph
    assert counters["stats"]["calls_captured"] == 0


def test_a_plain_tensor_weight_is_another_graph(tmp_path: Path, eager_compile: None) -> None:
    """Why the warm-up passes parameters: the norm warmed with a plain tensor weight compiles again for the
    forward's parameter (what the warm-up did before, 0.4 s of a start on a GPU)."""
    save_hf_model(tmp_path, "LlamaForCausalLM")
    model = load_model(tmp_path, dtype="fp32", fuse_pointwise=True)
    norm = model.model.layers[0].input_layernorm
    h = model.config.hidden_size
    counters.clear()
    with torch.inference_mode():
        norm.norm(torch.randn(4, h), torch.randn(h), 1e-6)
        assert counters["stats"]["unique_graphs"] == 1
        norm(torch.randn(7, h))
    assert counters["stats"]["unique_graphs"] == 2
