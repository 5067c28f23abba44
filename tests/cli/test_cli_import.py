"""`pgdiag import` through the CLI: help lists every preset, per-step lines, refusals as one line with their
documented exit code and nothing written."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pgdiag.cli.app import build_app
from pgdiag.importers.base import PRESET_MODULES
from tests.importers.conftest import assert_nothing_written
from tests.importers.nemo_rl_fixture import group_samples, write_train_data


def _invoke(*args: str):
    return CliRunner().invoke(build_app(), ["import", *args])


def test_help_lists_every_preset():
    res = _invoke("--help")
    assert res.exit_code == 0
    for name in PRESET_MODULES:
        assert name in res.output, name


def test_per_step_lines_and_json(tmp_path):
    src = tmp_path / "logs"
    for n in (1, 2):
        write_train_data(src / f"train_data_step{n}.jsonl", group_samples(n), seed=n)
    res = _invoke("--preset", "nemo-rl", str(src), str(tmp_path / "run"), "--json", "--temperature", "0.7")
    assert res.exit_code == 0, res.output
    assert "step 1: 4 samples" in res.stderr and "step 2: 4 samples" in res.stderr
    assert "streams rollout, old" in res.stderr
    payload = json.loads(res.stdout.strip().splitlines()[-1])
    assert payload["status"] == "ok" and payload["inputs"]["streams"] == ["rollout", "old"]
    sidecar = json.loads((tmp_path / "run" / "pgdiag.json").read_text())
    assert sidecar["sampling"]["temperature"] == 0.7 and sidecar["steps"] == [1, 2]


def test_text_only_is_exit_2(tmp_path):
    src = tmp_path / "rollout_data"
    src.mkdir()
    (src / "3.jsonl").write_text(json.dumps({"input": "a", "output": "b", "score": 1.0, "step": 3}) + "\n")
    res = _invoke("--preset", "verl-jsonl", str(src), str(tmp_path / "run"))
    assert res.exit_code == 2
    assert "error[E702]" in res.stderr and "hint: pass --retokenize --tokenizer PATH" in res.stderr
    assert "Traceback" not in res.output
    assert_nothing_written(tmp_path / "run")


def test_torn_file_is_exit_3(tmp_path):
    src = tmp_path / "logs"
    path = src / "train_data_step1.jsonl"
    write_train_data(path, group_samples(1))
    path.write_bytes(path.read_bytes()[:-5])
    res = _invoke("--preset", "nemo-rl", str(src), str(tmp_path / "run"))
    assert res.exit_code == 3 and "error[E703]" in res.stderr and "train_data_step1.jsonl" in res.stderr
    assert_nothing_written(tmp_path / "run")


def test_bad_options_are_exit_2(tmp_path):
    res = _invoke("--preset", "nope", str(tmp_path), str(tmp_path / "run"))
    assert res.exit_code == 2 and "error[E503]" in res.stderr  # not one of the presets
    res = _invoke("--preset", "canonical", str(tmp_path), str(tmp_path / "run"), "--group-by", "contig")
    assert res.exit_code == 2 and "error[E112]" in res.stderr
    res = _invoke("--preset", "canonical", str(tmp_path), str(tmp_path / "run"), "--shift", "x=y")
    assert res.exit_code == 2 and "error[E112]" in res.stderr
