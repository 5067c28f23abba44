"""Hypothesis-driven malformed runs and checkpoints given to `pgdiag logprobs` (docs/reliability.md).

Each example damages a valid one-file run or a copy of the tiny checkpoint and runs ``pgdiag logprobs RUN
--model CKPT`` on it: exit 0, or the clean-error contract (one ``error[CODE]`` line with the code's exit code, no
traceback, no ``internal error``) and nothing under ``RUN/logprobs/``. The per-token temperatures also have an
oracle: the run is refused with E219 exactly when the rule of docs/recompute.md says so. Examples per test: 4 by
default, 400 with ``pytest --slow``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import polars as pl
from clean_error import error_code, run_cli
from hypothesis import given
from hypothesis import strategies as st
from rollout_factory import valid_rows, write_rollouts_file
from sample_paths import SAMPLE_DATA
from test_fuzz_inputs import COLUMN_TYPES, FOOTER_KEYS, JSON_VALUES, fuzz_settings

TINY = SAMPLE_DATA / "tiny-qwen"
CONFIG_KEYS = (
    "architectures",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "vocab_size",
    "dtype",
)
TEMPERATURES = st.sampled_from([0.7, 1.3, 0.0, -1.0, math.nan, math.inf, None])


def write_run(run: Path, rows: list[dict], **meta) -> Path:
    """`rows` as the one part of the run directory `run` (replacing what an earlier example left)."""
    shutil.rmtree(run, ignore_errors=True)
    raw_types = meta.pop("raw_types", None)
    write_rollouts_file(run / "rollouts" / "part-00000.parquet", rows, raw_types=raw_types, **meta)
    return run


def logprobs(run: Path, model: Path = TINY) -> str | None:
    """Run `pgdiag logprobs` on `run`; None on success, else the error code after asserting the contract."""
    result = run_cli(["logprobs", run, "--model", model, "--device", "cpu", "--dtype", "fp32", "-q"])
    if result.exit_code == 0:
        return None
    code = error_code(result)
    assert not (run / "logprobs").exists(), (code, result.output)
    return code


def test_logprobs_on_a_footer_of_any_json_shape(tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples)
    @given(key=st.sampled_from(FOOTER_KEYS), value=JSON_VALUES)
    def case(key: str, value: object) -> None:
        logprobs(write_run(tmp_path / "run", valid_rows(), **{key: value}))

    case()


def test_logprobs_on_a_column_of_another_type(tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples)
    @given(column=st.sampled_from(sorted(COLUMN_TYPES)), data=st.data())
    def case(column: str, data: st.DataObject) -> None:
        dtype = data.draw(st.sampled_from(COLUMN_TYPES[column]))
        try:
            rows = (
                pl.DataFrame(valid_rows()).with_columns(pl.col(column).cast(dtype, strict=False)).to_dicts()
            )
        except pl.exceptions.PolarsError:
            return  # polars cannot even build this file
        logprobs(write_run(tmp_path / "run", rows, raw_types={column: dtype}))

    case()


def test_logprobs_on_damaged_bytes(tmp_path: Path, fuzz_examples: int) -> None:
    good = write_run(tmp_path / "good", valid_rows()) / "rollouts" / "part-00000.parquet"
    good_bytes = good.read_bytes()

    @fuzz_settings(fuzz_examples)
    @given(
        cut=st.integers(0, len(good_bytes)),
        noise=st.binary(max_size=64),
        at=st.integers(0, len(good_bytes)),
    )
    def case(cut: int, noise: bytes, at: int) -> None:
        damaged = bytearray(good_bytes[:cut] if cut < len(good_bytes) - 8 else good_bytes)
        damaged[at : at + len(noise)] = noise
        run = write_run(tmp_path / "run", valid_rows())
        (run / "rollouts" / "part-00000.parquet").write_bytes(bytes(damaged))
        logprobs(run)

    case()


def expected_temperature_code(rows: list[dict]) -> str | None:
    """The oracle, written out plainly: a NaN or infinite row `temperature` is the reader's E207
    (docs/schema.md); a per-token list of another length, or a temperature that is not finite and positive
    where it is used, is the `--temperature auto` rule's E219 (docs/recompute.md)."""
    if any(r.get("temperature") is not None and not math.isfinite(r["temperature"]) for r in rows):
        return "E207"
    if all(r.get("temperature_tok") is None and r.get("temperature") is None for r in rows):
        return None  # no temperature in the columns: the footer's, else 1.0

    def positive(value: float | None) -> bool:
        return value is not None and math.isfinite(value) and value > 0

    for row in rows:
        listed = row.get("temperature_tok")
        if listed is None:
            if not positive(row.get("temperature")):
                return "E219"
        elif len(listed) != len(row["input_ids"]) or not all(
            positive(t) for t, loss in zip(listed, row["loss_mask"], strict=True) if loss
        ):
            return "E219"
    return None


def test_logprobs_on_any_per_token_temperatures(tmp_path: Path, fuzz_examples: int) -> None:
    @fuzz_settings(fuzz_examples)
    @given(data=st.data())
    def case(data: st.DataObject) -> None:
        rows = valid_rows()
        for row in rows:
            n = len(row["input_ids"])
            if data.draw(st.booleans()):
                length = n + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
                row["temperature_tok"] = data.draw(st.lists(TEMPERATURES, min_size=length, max_size=length))
            else:
                row["temperature_tok"] = None
            row["temperature"] = data.draw(TEMPERATURES)
        code = logprobs(write_run(tmp_path / "run", rows, sampling={"temperature": 0.7}))
        assert code == expected_temperature_code(rows), (code, rows)

    case()


def checkpoint_copy(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(TINY, directory)
    return directory


def test_logprobs_with_a_config_of_any_json(tmp_path: Path, fuzz_examples: int) -> None:
    run = write_run(tmp_path / "run", valid_rows())

    @fuzz_settings(fuzz_examples)
    @given(key=st.sampled_from(CONFIG_KEYS), value=JSON_VALUES)
    def case(key: str, value: object) -> None:
        model = checkpoint_copy(tmp_path / "ckpt")
        config = json.loads((model / "config.json").read_text())
        config[key] = value
        (model / "config.json").write_text(json.dumps(config))
        shutil.rmtree(run / "logprobs", ignore_errors=True)
        logprobs(run, model)

    case()


def test_logprobs_with_damaged_or_poisoned_weights(tmp_path: Path, fuzz_examples: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    run = write_run(tmp_path / "run", valid_rows())
    good = (TINY / "model.safetensors").read_bytes()
    with safe_open(str(TINY / "model.safetensors"), framework="pt") as weights:
        names = sorted(weights.keys())

    @fuzz_settings(fuzz_examples)
    @given(
        cut=st.integers(0, len(good)),
        noise=st.binary(max_size=64),
        at=st.integers(0, len(good)),
        poison=st.none()
        | st.tuples(st.sampled_from(names), st.sampled_from([math.nan, math.inf, -math.inf])),
    )
    def case(cut: int, noise: bytes, at: int, poison: tuple[str, float] | None) -> None:
        model = checkpoint_copy(tmp_path / "ckpt")
        if poison is None:  # bytes truncated at any offset and overwritten anywhere
            damaged = bytearray(good[:cut] if cut < len(good) - 8 else good)
            damaged[at : at + len(noise)] = noise
            (model / "model.safetensors").write_bytes(bytes(damaged))
        else:  # a NaN or inf in one tensor: always E612, never a number
            with safe_open(str(TINY / "model.safetensors"), framework="pt") as source:
                tensors = {name: source.get_tensor(name) for name in names}
            name, value = poison
            tensors[name].view(-1)[at % tensors[name].numel()] = value
            save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
        shutil.rmtree(run / "logprobs", ignore_errors=True)
        code = logprobs(run, model)
        if poison is not None:
            assert code == "E612", code

    case()
