"""`pgdiag.model.fused_ops`: building a fused model compiles nothing and imports no dynamo; off CUDA the ops are
compiled at their first call, the warm-up compiles every graph the forward then uses (none after it); the
environment `torch.compile` starts under. On the CPU `torch.compile` is given dynamo's ``eager`` backend: the
guards and graphs are dynamo's, as with Inductor, without a C++ build."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_tiny import packed_inputs, save_hf_model
from torch._dynamo.utils import counters

import pgdiag.model.transformer as transformer
from pgdiag.model import load_model
from pgdiag.model.fused_ops import prepare_compile_environment


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


def test_a_fused_model_imports_no_compiler(tmp_path: Path) -> None:
    """Loading with fused ops compiles nothing: dynamo (1.2 s of imports on a GPU machine) and Inductor are
    imported only when a compiled op first runs, which on CUDA is never (the Triton kernels run there)."""
    save_hf_model(tmp_path, "Qwen3ForCausalLM")
    code = f"""
import sys
from pgdiag.model import load_model
model = load_model({str(tmp_path)!r}, dtype="fp32", fuse_pointwise=True)
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


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
