"""A refused or interrupted recompute never blocks the run: a refusal (``--impl triton`` on a CPU, triton not
installed) leaves no file, an interruption before the first part leaves none either, and one after some parts
leaves a resumable dataset that `check`, `metrics` and `compare` report as warning W504 (naming the tag and the
commands that finish or remove it) instead of failing."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from sample_paths import SAMPLE_DATA
from test_logprobs import StopAfter
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.errors import UsageError
from pgdiag.kernels import resolve_impl
from pgdiag.recompute.jobs import recompute_logprobs

ROOT = Path(__file__).resolve().parents[2]
TINY = SAMPLE_DATA / "tiny-qwen"


@pytest.fixture
def run_copy(tmp_path: Path) -> Path:
    run = tmp_path / "run_a"
    shutil.copytree(SAMPLE_DATA / "run_a", run, ignore=shutil.ignore_patterns("logprobs"))
    return run


def invoke(*args: object):
    return CliRunner().invoke(build_app(), [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_triton_on_cpu_is_refused_before_anything_is_written(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    result = invoke("logprobs", run_copy, "--model", TINY, "--impl", "triton")
    assert result.exit_code == 2
    assert result.stderr.startswith("error[E508] impl 'triton' needs a CUDA device, got cpu")
    assert not (run_copy / "logprobs").exists()
    check = invoke("check", run_copy)
    assert check.exit_code == 0 and check.stdout.strip().endswith("check: clean")  # the verdict: stdout


def test_triton_not_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with pytest.raises(UsageError) as error:
        resolve_impl("triton", torch.device("cuda", 0))
    assert error.value.code == "E509" and "needs the triton package" in error.value.message
    assert "pgdiag[gpu]" in error.value.hint
    assert resolve_impl("torch", torch.device("cpu")) == "torch"


def test_interrupted_before_the_first_part_leaves_nothing(run_copy: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        recompute_logprobs(run_copy, TINY, device="cpu", part_samples=8, progress=StopAfter(0))
    assert not (run_copy / "logprobs" / "rc_bf16_fp32").exists()
    assert invoke("check", run_copy).exit_code == 0


def test_interrupted_after_some_parts_is_a_warning_naming_the_tag(run_copy: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        recompute_logprobs(run_copy, TINY, device="cpu", part_samples=8, progress=StopAfter(2))
    out_dir = run_copy / "logprobs" / "rc_bf16_fp32"
    assert len(list(out_dir.glob("step=*/part-*.parquet"))) == 2
    assert json.loads((out_dir / "_manifest.json").read_text())["complete"] is False
    check = invoke("check", run_copy, "--json")
    assert check.exit_code == 0, check.stderr  # a warning, not E504 for the whole run
    (finding,) = [c for c in json.loads(check.stdout)["checks"] if c["code"] == "W504"]
    assert finding["severity"] == "warning" and "'rc_bf16_fp32'" in finding["message"]
    stderr = " ".join(check.stderr.split())
    finish = (
        f"pgdiag logprobs {run_copy} --model {TINY.resolve()} --tag rc_bf16_fp32 --dtype bf16 --head-dtype fp32"
        " --part-samples 8"
    )
    assert f"hint: finish it: {finish} (resumes); or remove it: rm -r {out_dir}" in stderr
    assert "check: warnings (1 warning); first: warning[W504]" in stderr
    assert invoke("check", run_copy, "--strict").exit_code == 1
    metrics = invoke("metrics", run_copy, "--json")
    assert metrics.exit_code == 0 and "W504" in {c["code"] for c in json.loads(metrics.stdout)["checks"]}
    explicit = invoke("metrics", run_copy, "--new", "rc_bf16_fp32")  # not a stream until it is finished
    assert explicit.exit_code == 2 and explicit.stderr.startswith("error[E111]")
    with pytest.raises(UsageError) as read:  # the library names the unfinished tag and the way out
        from pgdiag.data.runs import read_run

        read_run(run_copy).collect(["rc_bf16_fp32_logprobs"])
    assert read.value.code == "E504" and "finish it: pgdiag logprobs" in read.value.hint
    # the command the hint names finishes it: the warning is gone and the stream is read
    resumed = invoke(*finish.split()[1:], "-q", "--json")
    assert resumed.exit_code == 0, resumed.stderr
    assert json.loads(resumed.stdout)["summary"]["rc_bf16_fp32"]["parts_skipped"] == 2
    done = invoke("check", run_copy, "--json")
    assert done.exit_code == 0 and not json.loads(done.stdout)["checks"]
    assert invoke("metrics", run_copy, "--new", "rc_bf16_fp32", "-q").exit_code == 0


def poisoned_checkpoint(directory: Path, tensor: str, value: float, *, whole: bool = False) -> Path:
    """A copy of the tiny checkpoint with one element of `tensor` (every element when `whole`) set to `value`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(TINY, directory)
    weights = load_file(directory / "model.safetensors")
    if whole:
        weights[tensor][:] = value
    else:
        weights[tensor][0, 0] = value
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def no_writes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every file pgdiag writes (every write goes through `atomic_write`), writing none."""
    import pgdiag.data.writing as writing

    written: list[Path] = []
    monkeypatch.setattr(writing, "atomic_write", lambda path, write: written.append(Path(path)))
    return written


@pytest.mark.parametrize("case", ["nan_weight", "inf_weight", "sampling_temperature_0", "token_out_of_vocab"])
def test_refusals_come_before_anything_is_written(
    case: str, run_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the manifest was written first and removed again on the error, leaving RUN/logprobs/ behind; a
    # NaN weight surfaced as E208 ("token ... is not in the vocabulary") from the LM head.
    model = TINY
    if case in ("nan_weight", "inf_weight"):
        value = float("nan") if case == "nan_weight" else float("inf")
        model = poisoned_checkpoint(tmp_path / "ckpt", "model.layers.2.mlp.down_proj.weight", value)
    if case == "sampling_temperature_0":
        path = next((run_copy / "rollouts").glob("step=0/*.parquet"))
        table = pq.read_table(path)
        metadata = {**table.schema.metadata, b"pgdiag.sampling": json.dumps({"temperature": 0.0}).encode()}
        pq.write_table(table.replace_schema_metadata(metadata), path)
        for other in (run_copy / "rollouts").glob("step=[123]"):
            shutil.rmtree(other)
    written = no_writes(monkeypatch)
    result = invoke("logprobs", run_copy, "--model", model, "--dtype", "fp32", *(
        ["--softmax-vocab", "100"] if case == "token_out_of_vocab" else []
    ))  # fmt: skip
    expected = {
        "nan_weight": ("E612", 2, f"{model / 'model.safetensors'}: tensor 'model.layers.2.mlp.down_proj.weight' "
                       "holds 1 NaN or inf values (loaded as float32)"),
        "inf_weight": ("E612", 2, "tensor 'model.layers.2.mlp.down_proj.weight' holds 1 NaN or inf values"),
        "sampling_temperature_0": ("E219", 3, "pgdiag.sampling.temperature 0.0 is not a number > 0"),
        "token_out_of_vocab": ("E208", 3, "input_ids: token id < 0 or >= vocab_size 100"),
    }[case]  # fmt: skip
    code, exit_code, text = expected
    assert result.exit_code == exit_code, result.output
    assert result.stderr.startswith(f"error[{code}] ") and text in result.stderr, result.stderr
    assert written == [] and not (run_copy / "logprobs").exists()


def test_forward_overflow_is_e612_naming_the_sample(run_copy: Path, tmp_path: Path) -> None:
    # finite weights whose activations overflow fp32: an MLP projection of all 3e38 (was E208 from the head)
    model = poisoned_checkpoint(tmp_path / "ckpt", "model.layers.0.mlp.up_proj.weight", 3e38, whole=True)
    result = invoke("logprobs", run_copy, "--model", model, "--dtype", "fp32")
    assert result.exit_code == 2, result.output
    first = result.stderr.splitlines()[0]
    assert (
        first.startswith(f"error[E612] {run_copy}: step 0, sample ")
        and "hidden states hold NaN or inf" in first
    )
    assert not list((run_copy / "logprobs").rglob("*.parquet"))
