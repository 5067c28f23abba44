"""`explain --layers A slime:DIR`: one side an imported slime layer-wise alignment dump (slime_layer_dumps.py).

The dump is made by transformers' Qwen3 from a checkpoint whose block 3 is perturbed and saved in bf16 as slime
saves it; pgdiag's own model on the clean checkpoint is side A. The local error (pgdiag's block i fed the dump's
input to block i) finds block 3; the cumulative error cannot, it stays high after it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from explain_factory import make_checkpoint, perturbed_checkpoint, sample_rows, score, write_plant
from slime_layer_dumps import write_sglang_layer_dump, write_slime_layer_dump
from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.explain.layers import compare_layers
from pgdiag.explain.settings import ExplainSettings
from pgdiag.explain.sglang_layers import match_samples as sglang_match
from pgdiag.explain.slime_layers import match_samples, read_pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | list]:
    root = tmp_path_factory.mktemp("slime_layers")
    checkpoint = make_checkpoint(root / "ckpt", layers=6)
    planted = perturbed_checkpoint(checkpoint, root / "planted", 0.5, only="layers.3.mlp")
    rows = sample_rows(checkpoint, steps=2, per_step=3)
    lp = score(checkpoint, rows)
    samples = [r["input_ids"] for r in rows]
    return {
        "checkpoint": checkpoint,
        "planted": planted,
        "run": write_plant(root / "run", rows, lp, lp),
        "samples": samples,
        "planted_dump": write_slime_layer_dump(root / "planted_dump", planted, samples, tp=2),
        "clean_dump": write_slime_layer_dump(root / "clean_dump", checkpoint, samples, passes=1),
        "subset_dump": write_slime_layer_dump(root / "subset_dump", planted, samples, layers=[0, 1, 3, 4]),
    }


def test_the_reader_splits_the_packed_pass_and_drops_the_padding(setup) -> None:
    path = setup["clean_dump"] / "rank00000" / "actor_Pass00000.pt"
    sequences = read_pass(path, 32)
    assert [s.ids.tolist() for s in sequences] == setup["samples"]  # the zero padding segment is not a sample
    assert sorted(sequences[0].hidden) == list(range(6))
    assert sequences[1].hidden[2].shape == (len(setup["samples"][1]), 32)
    assert sequences[1].hidden[2].dtype == torch.bfloat16
    # several TP ranks dump the same sequences: each sample matched once, to the first rank's copy
    found = match_samples(setup["planted_dump"], [torch.tensor(s).numpy() for s in setup["samples"]], 32)
    assert sorted(found) == list(range(len(setup["samples"])))
    assert all("rank00000" in s.source for s in found.values())


def test_a_perturbation_planted_in_one_layer_of_the_dump_is_found_there(setup) -> None:
    found = compare_layers(
        setup["run"],
        setup["checkpoint"],
        "ref",
        f"slime:{setup['planted_dump']}",
        ExplainSettings(tokens=1000),
    )
    assert found.first_divergent == 3
    assert found.n_tokens == sum(len(s) for s in setup["samples"])
    local = {r.layer: r.local for r in found.rows}
    cumulative = {r.layer: r.cumulative for r in found.rows}
    assert sorted(local) == list(range(6))  # no embeddings row: the dump has none
    assert local[3] > 0.01  # measured 0.016 (the block's MLP weights x (1 + 0.5 N(0, 1)))
    assert all(0.0 < local[i] < 0.004 for i in (0, 1, 2, 4, 5))  # bf16 rounding of the dump: 0.0016-0.0024
    assert cumulative[2] < 0.004 and cumulative[5] > 0.01  # cumulative stays high after block 3
    assert all(r.route_flips is None for r in found.rows)


def test_the_clean_dump_is_uniform(setup) -> None:
    found = compare_layers(
        setup["run"], setup["checkpoint"], "ref", f"slime:{setup['clean_dump']}", ExplainSettings(tokens=1000)
    )
    assert found.first_divergent is None
    assert max(r.local for r in found.rows) < 0.004


def test_a_layer_subset_gives_local_errors_only_where_the_input_was_dumped(setup) -> None:
    found = compare_layers(
        setup["run"],
        setup["checkpoint"],
        "ref",
        f"slime:{setup['subset_dump']}",
        ExplainSettings(tokens=1000),
    )
    rows = {r.layer: r for r in found.rows}
    assert sorted(rows) == [0, 1, 3, 4]
    assert rows[3].local is None  # block 2's output (block 3's input) was not dumped
    assert rows[4].local is not None and rows[4].local < 0.004  # block 4 itself is clean
    assert rows[3].cumulative > 0.01 and rows[1].cumulative < 0.004
    assert found.first_divergent is None


def test_a_run_the_dump_does_not_hold_and_a_missing_dump(setup, tmp_path: Path) -> None:
    other = sample_rows(setup["checkpoint"], steps=1, per_step=2, seed=7)
    lp = score(setup["checkpoint"], other)
    run = write_plant(tmp_path / "other", other, lp, lp)
    with pytest.raises(InvalidInputError) as error:
        compare_layers(run, setup["checkpoint"], "ref", f"slime:{setup['clean_dump']}", ExplainSettings())
    assert error.value.code == "E304"
    with pytest.raises(UsageError) as error:
        compare_layers(run, setup["checkpoint"], "ref", f"slime:{tmp_path / 'none'}", ExplainSettings())
    assert error.value.code == "E501"
    torn = tmp_path / "torn" / "rank00000"
    torn.mkdir(parents=True)
    (torn / "actor_Pass00000.pt").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(InvalidInputError) as error:
        compare_layers(run, setup["checkpoint"], "ref", f"slime:{tmp_path / 'torn'}", ExplainSettings())
    assert error.value.code == "E703" and "actor_Pass00000.pt" in str(error.value)


def test_cli_with_a_dump(setup, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        build_app(),
        ["explain", str(setup["run"]), "--model", str(setup["checkpoint"]), "--layers", "ref",
         f"slime:{setup['subset_dump']}", "--json", "--html", str(tmp_path / "page.html")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [r["layer"] for r in payload["layers"]["rows"]] == [0, 1, 3, 4]
    assert payload["layers"]["rows"][2]["local"] is None
    assert "<img " in (tmp_path / "page.html").read_text()


@pytest.fixture(scope="module")
def sglang(setup, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang_layers")
    rows = sample_rows(setup["checkpoint"], steps=2, per_step=3)
    assert [r["input_ids"] for r in rows] == setup["samples"]  # the same seed: the same samples
    prompts = [r["prompt_len"] for r in rows]
    return {
        "planted": write_sglang_layer_dump(
            root / "planted", setup["planted"], setup["samples"], prompts, chunk=3
        ),
        "clean": write_sglang_layer_dump(root / "clean", setup["checkpoint"], setup["samples"], prompts),
    }


def test_sglang_requests_are_matched_and_read_at_the_positions_the_engine_ran(setup, sglang) -> None:
    samples = [np.asarray(s) for s in setup["samples"]]
    found = sglang_match(sglang["clean"], samples, 32)
    assert sorted(found) == list(range(len(samples)))  # HEALTH_CHECK_ skipped, every request matched
    for k, sequence in found.items():
        held = sequence.observed
        assert held[:-1].all() and held[-1] == (k % 2 == 0)  # odd requests never fed their last token
        assert sorted(sequence.hidden) == list(range(6))


def test_a_perturbation_in_one_layer_of_an_sglang_dump_is_found_there(setup, sglang) -> None:
    found = compare_layers(
        setup["run"], setup["checkpoint"], "ref", f"sglang:{sglang['planted']}", ExplainSettings(tokens=1000)
    )
    assert found.first_divergent == 3
    assert found.n_tokens == sum(len(s) for s in setup["samples"]) - len(setup["samples"]) // 2
    local = {r.layer: r.local for r in found.rows}
    assert local[3] > 0.01 and all(0.0 < local[i] < 0.004 for i in (0, 1, 2, 4, 5))
    clean = compare_layers(
        setup["run"], setup["checkpoint"], "ref", f"sglang:{sglang['clean']}", ExplainSettings(tokens=1000)
    )
    assert clean.first_divergent is None and max(r.local for r in clean.rows) < 0.004


def test_a_foreign_sglang_file_is_named(setup, tmp_path: Path) -> None:
    folder = tmp_path / "dump" / "TP0_PP0_Rank0_pid1"
    folder.mkdir(parents=True)
    torch.save({"model.layers.0": torch.zeros(3, 32)}, folder / "Pass00000.pt")  # no forward_batch_info
    with pytest.raises(InvalidInputError) as error:
        sglang_match(tmp_path / "dump", [np.arange(3)], 32)
    assert (
        error.value.code == "E703" and "Pass00000.pt" in str(error.value) and "input_ids" in str(error.value)
    )
    with pytest.raises(UsageError) as error:
        sglang_match(tmp_path / "nothing", [np.arange(3)], 32)
    assert error.value.code == "E501"
