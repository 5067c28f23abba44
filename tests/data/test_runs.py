"""Reading runs: RUN forms, hive partitions, steps, projection, recompute join and flattening."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_factory import valid_rows, write_logprobs_part, write_rollouts_file

from pgdiag.data.load import read_token_batch
from pgdiag.data.runs import read_run
from pgdiag.data.seqhash import seq_hash
from pgdiag.data.steps import StepSpec, parse_steps
from pgdiag.errors import InvalidInputError, UsageError


def _write_run_dir(root: Path, rows: list[dict[str, Any]]) -> Path:
    for step in sorted({r["step"] for r in rows}):
        write_rollouts_file(
            root / "rollouts" / f"step={step}" / "part-00000.parquet", [r for r in rows if r["step"] == step]
        )
    return root


def test_parse_steps() -> None:
    assert parse_steps("3") == StepSpec(((3, 3),), False)
    assert parse_steps("0-2, 7,last") == StepSpec(((0, 2), (7, 7)), True)
    assert parse_steps([4, 5]) == StepSpec(((4, 4), (5, 5)), False)
    for bad in ("x", "3-1", "1-", ""):
        with pytest.raises(UsageError) as err:
            parse_steps(bad)
        assert err.value.code == "E112"


def test_single_file(valid_rollouts_file: Path) -> None:
    run = read_run(valid_rollouts_file)
    assert run.label == "t"
    assert run.streams == ("rollout", "old")
    assert run.paths == (valid_rollouts_file,) and run.root is None
    assert run.meta["schema"] == "pgdiag.rollouts/v1"
    assert run.collect(["step"]).height == 4


def test_run_directory_with_hive_steps(tmp_path: Path) -> None:
    rows = valid_rows()
    rows += [{**r, "step": 10, "sample_id": "10:" + r["sample_id"][2:], "group_id": "g10"} for r in rows[:2]]
    root = _write_run_dir(tmp_path / "run", rows)
    (root / "rollouts" / "_ignored").mkdir()
    (root / "rollouts" / ".hidden.parquet").write_bytes(b"junk")
    (root / "rollouts" / "_ignored" / "junk.parquet").write_bytes(b"junk")
    run = read_run(root)
    assert run.root == root and run.hive
    # natural step order: step=2 would sort before step=10 only numerically
    assert [p.parent.name for p in run.paths] == ["step=0", "step=1", "step=10"]
    assert run.collect(["step"])["step"].to_list() == [0, 0, 1, 1, 10, 10]
    assert read_run(root, steps="1-10").collect(["step"])["step"].to_list() == [1, 1, 10, 10]
    assert read_run(root, steps="last").collect(["step"])["step"].to_list() == [10, 10]
    batch = read_token_batch(read_run(root, steps="0,10"), streams=["rollout"]).batch
    assert batch.step.tolist() == [0, 0, 10, 10]


def test_directory_of_parquet_and_glob(tmp_path: Path) -> None:
    rows = valid_rows()
    write_rollouts_file(tmp_path / "d" / "a.parquet", rows[:2])
    write_rollouts_file(tmp_path / "d" / "sub" / "b.parquet", rows[2:])
    run = read_run(tmp_path / "d")
    assert len(run.paths) == 2 and run.root is None
    assert run.collect(["sample_id"])["sample_id"].to_list() == ["0:0", "0:1", "1:0", "1:1"]
    globbed = read_run(str(tmp_path / "d" / "**" / "*.parquet"))
    assert len(globbed.paths) == 2
    assert read_run(str(tmp_path / "d" / "a*.parquet")).collect(["step"]).height == 2


def test_nothing_matched_is_e501(tmp_path: Path) -> None:
    for missing in (tmp_path / "none", str(tmp_path / "*.parquet")):
        with pytest.raises(UsageError) as err:
            read_run(missing)
        assert err.value.code == "E501" and str(tmp_path) in err.value.message


def test_bad_footers(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    no_schema = write_rollouts_file(tmp_path / "a.parquet", rollout_rows, schema=None)
    with pytest.raises(InvalidInputError) as e101:
        read_run(no_schema)
    assert e101.value.code == "E101" and "a.parquet" in e101.value.message
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(InvalidInputError) as unreadable:
        read_run(tmp_path / "junk.parquet")
    assert unreadable.value.code == "E101"
    response = write_rollouts_file(tmp_path / "b.parquet", rollout_rows, alignment="response")
    with pytest.raises(InvalidInputError) as e104:
        read_run(response)
    assert e104.value.code == "E104"


def test_run_labels_filter_and_override(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    mixed = [{**r, "run": "a"} for r in rollout_rows] + [{**r, "run": "b"} for r in rollout_rows]
    path = write_rollouts_file(tmp_path / "m.parquet", mixed)
    for label in (None, "mine"):  # a label never licenses mixing two runs
        with pytest.raises(UsageError) as several:
            read_run(path, label=label)
        assert several.value.code == "E505" and "['a', 'b']" in several.value.message
    run_b = read_run(path, run="b")
    assert run_b.label == "b" and run_b.collect(["run"])["run"].cast(pl.String).unique().to_list() == ["b"]
    assert read_run(path, run="a", label="mine").label == "mine"
    with pytest.raises(UsageError):
        read_run(path, run="c")


def test_steps_of_one_run_among_several(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    """With --run, the steps present (E503's hint) and `last` are those of that run, not of the file."""
    late = [{**r, "run": "a", "step": r["step"] + 5} for r in rollout_rows]  # run a: steps 5, 6
    path = write_rollouts_file(tmp_path / "m.parquet", late + [{**r, "run": "b"} for r in rollout_rows])
    with pytest.raises(UsageError) as absent:
        read_run(path, run="b", steps="5")
    assert absent.value.code == "E503" and absent.value.hint == "steps present: 0-1"
    last_b = read_run(path, run="b", steps="last")
    assert last_b.collect(["step"])["step"].unique().to_list() == [1]
    assert read_run(path, run="a", steps="last").collect(["step"])["step"].unique().to_list() == [6]


def test_projection_ignores_unneeded_missing_columns(
    tmp_path: Path, rollout_rows: list[dict[str, Any]]
) -> None:
    slim = [
        {k: v for k, v in r.items() if k not in ("old_logprobs", "reward", "env", "advantages")}
        for r in rollout_rows
    ]
    run = read_run(write_rollouts_file(tmp_path / "slim.parquet", slim))
    assert run.streams == ("rollout",)
    loaded = read_token_batch(run, streams=["rollout"], env=True)
    assert loaded.batch.reward is None and loaded.batch.advantages is None and loaded.batch.env is None
    assert loaded.batch.n_tokens == 10
    with pytest.raises(UsageError) as no_stream:
        read_token_batch(run, streams=["old"])
    assert no_stream.value.code == "E111" and "streams: rollout" in no_stream.value.hint


def test_token_batch_values(valid_rollouts_file: Path) -> None:
    loaded = read_token_batch(read_run(valid_rollouts_file), streams=["rollout", "old"], env=True)
    batch = loaded.batch
    assert loaded.checks.n_errors == 0 and loaded.checks.n_warnings == 0
    assert batch.offsets.tolist() == [0, 3, 5, 8, 10]
    assert batch.pos.tolist() == [2, 4, 5, 2, 3] * 2
    assert batch.token_id.tolist() == [13, 15, 16, 21, 22] * 2
    assert batch.streams["rollout"].dtype == np.float64
    assert batch.streams["rollout"].tolist() == [-0.5, -1.25, -0.125, -2.0, -0.75] * 2
    assert batch.streams["old"].tolist() == [-0.5, -1.0, -0.25, -2.5, -0.5] * 2
    assert batch.advantages.tolist() == [1.0, 1.0, 1.0, -1.0, -1.0] * 2
    assert batch.reward.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.env.tolist() == ["math", "code", "math", "code"]
    assert batch.group_names.tolist() == ["g0", "g1"] and batch.group.tolist() == [0, 0, 1, 1]
    assert batch.seq_len.tolist() == [6, 4, 6, 4] and batch.prompt_len.tolist() == [2, 2, 2, 2]
    assert batch.segment_idx.tolist() == [0, 0, 0, 0] and batch.sample_row.tolist() == [0, 1, 2, 3]


def test_scalar_advantage_is_broadcast(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    scalar = [
        {**{k: v for k, v in r.items() if k != "advantages"}, "advantage": 0.5 * (i + 1)}
        for i, r in enumerate(rollout_rows)
    ]
    batch = read_token_batch(
        read_run(write_rollouts_file(tmp_path / "s.parquet", scalar)), streams=["rollout"]
    ).batch
    assert batch.advantages.tolist() == [0.5] * 3 + [1.0] * 2 + [1.5] * 3 + [2.0] * 2


def test_float64_and_int64_inputs_cast_losslessly(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    raw = {"rollout_logprobs": pl.List(pl.Float64), "input_ids": pl.List(pl.Int64)}
    path = write_rollouts_file(tmp_path / "wide.parquet", rollout_rows, raw_types=raw)
    batch = read_token_batch(read_run(path), streams=["rollout"]).batch
    assert batch.streams["rollout"].tolist()[:3] == [-0.5, -1.25, -0.125]
    assert batch.token_id.dtype == np.int32


def _recompute_rows(rows: list[dict[str, Any]], shift: float) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        lp = [None if v is None else v + shift for v in r["rollout_logprobs"]]
        ent = [None if v is None else 0.25 for v in r["rollout_logprobs"]]
        out.append(
            {
                "step": r["step"],
                "sample_id": r["sample_id"],
                "segment_idx": 0,
                "seq_hash": seq_hash(r["input_ids"]),
                "logprobs": lp,
                "entropy": ent,
            }
        )
    return out


def _manifest(directory: Path, complete: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "_manifest.json").write_text(json.dumps({"tag": directory.name, "complete": complete}))


def test_recompute_join(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    root = _write_run_dir(tmp_path / "run", rollout_rows)
    tag_dir = root / "logprobs" / "rc_test"
    _manifest(tag_dir, complete=True)
    # parts written in another order than the rollouts: the join must follow the rollouts' order
    write_logprobs_part(
        tag_dir / "step=1" / "part-00000.parquet", _recompute_rows(rollout_rows[2:], -0.125)[::-1]
    )
    write_logprobs_part(tag_dir / "step=0" / "part-00000.parquet", _recompute_rows(rollout_rows[:2], -0.125))
    run = read_run(root)
    assert run.streams == ("rollout", "old", "rc_test") and run.entropy_streams == ("rc_test",)
    batch = read_token_batch(run, streams=["rollout", "rc_test"], entropy=["rc_test"]).batch
    np.testing.assert_array_equal(batch.streams["rc_test"], batch.streams["rollout"] - 0.125)
    assert batch.entropy["rc_test"].tolist() == [0.25] * 10
    assert run.collect(["sample_id", "rc_test_logprobs"])["sample_id"].to_list() == [
        "0:0",
        "0:1",
        "1:0",
        "1:1",
    ]


def test_recompute_attach_stale_and_incomplete(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    path = write_rollouts_file(tmp_path / "r.parquet", rollout_rows)
    attached = tmp_path / "out" / "rc_x"
    _manifest(attached, complete=True)
    stale = _recompute_rows(rollout_rows, 0.0)
    stale[3]["seq_hash"] = 12345
    write_logprobs_part(attached / "part-00000.parquet", stale)
    run = read_run(path, attach=[attached])
    assert run.streams == ("rollout", "old", "rc_x")
    with pytest.raises(InvalidInputError) as e305:
        read_token_batch(run, streams=["rc_x"])
    assert e305.value.code == "E305" and "rc_x" in e305.value.message and "sample 1:1" in e305.value.message
    _manifest(attached, complete=False)
    with pytest.raises(UsageError) as e504:
        read_token_batch(read_run(path, attach=[attached]), streams=["rc_x"])
    assert e504.value.code == "E504"


row_strategy = st.lists(
    st.tuples(st.integers(1, 9), st.lists(st.booleans(), min_size=0, max_size=12)), min_size=1, max_size=8
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=row_strategy, seed=st.integers(0, 2**16))
def test_flattening_matches_python_reference(tmp_path_factory, spec, seed) -> None:
    rng = np.random.default_rng(seed)
    rows = []
    for i, (prompt_len, response_mask) in enumerate(spec):
        mask = [False] * prompt_len + response_mask
        ids = rng.integers(0, 1000, len(mask)).tolist()
        lps = [-float(np.float32(rng.random() * 5 + 0.01)) if m else None for m in mask]
        rows.append(
            {
                "step": i % 2,
                "sample_id": f"s{i}",
                "group_id": "g",
                "input_ids": ids,
                "prompt_len": prompt_len,
                "loss_mask": mask,
                "rollout_logprobs": lps,
            }
        )
    path = write_rollouts_file(tmp_path_factory.mktemp("flat") / "f.parquet", rows)
    loaded = read_token_batch(read_run(path), streams=["rollout"], ignore=["E209"])
    batch = loaded.batch
    ref_pos, ref_ids, ref_lp, ref_off = [], [], [], [0]
    for r in rows:
        for p, m in enumerate(r["loss_mask"]):
            if m:
                ref_pos.append(p)
                ref_ids.append(r["input_ids"][p])
                ref_lp.append(r["rollout_logprobs"][p])
        ref_off.append(len(ref_pos))
    assert batch.pos.tolist() == ref_pos
    assert batch.token_id.tolist() == ref_ids
    assert batch.streams["rollout"].tolist() == ref_lp
    assert batch.offsets.tolist() == ref_off
    empty = sum(1 for r in rows if not any(r["loss_mask"]))
    assert (loaded.checks.issues["code"].to_list() == ["W215"]) == (empty > 0)


def test_integer_reward_and_fixed_size_lists_are_read(tmp_path: Path) -> None:
    rows = [{**r, "reward": int(r["reward"])} for r in valid_rows()]
    path = write_rollouts_file(tmp_path / "int.parquet", rows, raw_types={"reward": pl.Int64})
    assert read_token_batch(read_run(path), streams=["rollout"]).batch.reward.tolist() == [1.0, 0.0, 1.0, 0.0]
    short = []
    for r in valid_rows():
        r = {k: (v[:4] if isinstance(v, list) else v) for k, v in r.items()}
        r["seq_hash"] = seq_hash(r["input_ids"])
        short.append(r)
    fixed = write_rollouts_file(
        tmp_path / "fixed.parquet", short, raw_types={"input_ids": pl.Array(pl.Int32, 4)}
    )
    batch = read_token_batch(read_run(fixed), streams=["rollout"]).batch
    assert batch.token_id.tolist() == [13, 21, 22, 13, 21, 22] and batch.pos.tolist() == [2, 2, 3] * 2


def test_uncastable_scalar_and_empty_selection(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    text_steps = [{**r, "step": str(r["step"])} for r in rollout_rows]
    path = write_rollouts_file(tmp_path / "s.parquet", text_steps, raw_types={"step": pl.String})
    with pytest.raises(InvalidInputError) as e103:
        read_token_batch(read_run(path), streams=["rollout"])
    assert e103.value.code == "E103" and "s.parquet: step" in e103.value.message
    valid = write_rollouts_file(tmp_path / "v.parquet", rollout_rows)
    with pytest.raises(UsageError) as absent:  # was E209 "(0 samples) has no loss tokens", with no hint
        read_run(valid, steps="7")
    assert absent.value.code == "E503" and absent.value.message == "--steps 7: 7 matches no step of the run"
    assert absent.value.hint == "steps present: 0-1"


def test_recompute_duplicate_keys_refused(tmp_path: Path, rollout_rows: list[dict[str, Any]]) -> None:
    path = write_rollouts_file(tmp_path / "r.parquet", rollout_rows)
    attached = tmp_path / "out" / "rc_dup"
    _manifest(attached, complete=True)
    parts = _recompute_rows(rollout_rows, 0.0)
    write_logprobs_part(attached / "part-00000.parquet", [*parts, parts[0]])
    with pytest.raises(InvalidInputError) as dup:
        read_token_batch(read_run(path, attach=[attached]), streams=["rc_dup"])
    assert dup.value.code == "E103" and "join the recompute parts" in dup.value.message
