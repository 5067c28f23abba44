"""Kept sets from engine outputs (`pgdiag.capture.kept`), recorded by the TRL hook and imported as columns.

The engine objects are built in the shapes the engines hand to Python (neither engine installs on this CPU box):

* vLLM, PR #49577 "Mask Replay": ``RequestOutput.outputs[i]`` is a ``CompletionOutput`` with ``token_ids`` and
  ``sampling_mask = SamplingMask(token_ids: list[list[int]], logprobs: list[list[float]] | None)`` (the
  ``vllm.outputs`` dataclass; the two-field form is the one vLLM's ``tests/test_outputs.py`` builds as
  ``SamplingMask([support], [[-0.1] * len(support)])``); the HTTP ``/inference/v1/generate`` choice carries
  ``"sampling_mask": [[...], ...]``;
* SGLang, PR #27408: the ``/generate`` response ``{"output_ids": [...], "meta_info":
  {"output_token_sampling_mask": [[...], ...], "output_token_sampling_logprobs": [...],
  "output_token_sampling_mask_length": n}}`` (its ``test/registered/sampling/test_sampling_mask.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pgdiag.capture.kept import completion_sets, engine_sets, kept_lists, match_rows
from pgdiag.errors import InvalidInputError
from tests.importers.hook_fixtures import (
    TRL_COMPLETIONS,
    TRL_PROMPTS,
    rewrite_hook_file,
    trl_output,
    trl_trainer_stub,
    wire_trl_generation,
)


@dataclass
class SamplingMask:  # vllm.outputs.SamplingMask
    token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput (the fields read here and their neighbours)
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: Any = None
    lora_request: Any = None
    sampling_mask: SamplingMask | None = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput (what LLM.generate returns, one per prompt)
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def _sets_for(tokens: list[int], extra: int = 2) -> list[list[int]]:
    """A kept set per token: the token and `extra` others (ids 40 + ...), in the engine's ascending order."""
    return [sorted({t, *range(40 + 3 * j, 40 + 3 * j + extra)}) for j, t in enumerate(tokens)]


def test_vllm_completion_output_with_and_without_logprobs() -> None:
    sets = [[3, 42, 55], [1, 17]]
    out = CompletionOutput(0, "", [42, 17], None, None, sampling_mask=SamplingMask(sets))
    rows = completion_sets(out, out.token_ids)
    assert (
        rows is not None
        and rows.ids == [3, 42, 55, 1, 17]
        and rows.counts == [3, 2]
        and rows.logprobs is None
    )
    with_lp = SamplingMask(sets, [[-2.0, -0.2, -3.0], [-1.0, -0.4]])
    rows = completion_sets(CompletionOutput(0, "", [42, 17], None, None, sampling_mask=with_lp), [42, 17])
    assert rows is not None and rows.logprobs == [-2.0, -0.2, -3.0, -1.0, -0.4]
    # no mask requested: nothing
    assert completion_sets(CompletionOutput(0, "", [42, 17], None, None), [42, 17]) is None


def test_vllm_http_choice_and_sglang_meta_info() -> None:
    choice = {
        "token_ids": [42, 17, 99],
        "sampling_mask": [[3, 42, 55], [1, 17], [8, 9, 23, 99]],
        "finish_reason": "stop",
    }
    rows = completion_sets(choice, choice["token_ids"])
    assert rows is not None and rows.counts == [3, 2, 4] and rows.ids[-1] == 99
    response = {
        "text": "...",
        "output_ids": [7, 5],
        "meta_info": {
            "output_token_sampling_mask": [[7, 2], [5]],
            "output_token_sampling_logprobs": [-0.3, 0.0],  # one per token: not kept-set log-probs
            "output_token_sampling_mask_length": 2,
        },
    }
    rows = completion_sets(response, response["output_ids"])
    assert rows is not None and rows.ids == [7, 2, 5] and rows.counts == [2, 1] and rows.logprobs is None
    assert engine_sets(response["meta_info"])[0] == [[7, 2], [5]]


def test_sets_that_do_not_line_up_are_dropped() -> None:
    mask = SamplingMask([[3, 42], [1, 17]])
    assert (
        completion_sets(CompletionOutput(0, "", [42], None, None, sampling_mask=mask), [42]) is None
    )  # 2 sets, 1 token
    assert (
        completion_sets(CompletionOutput(0, "", [42, 16], None, None, sampling_mask=mask), [42, 16]) is None
    )
    # kept log-probs of another shape: the sets stay, the log-probs go
    odd = SamplingMask([[3, 42], [1, 17]], [[-1.0], [-1.0, -2.0]])
    rows = completion_sets(CompletionOutput(0, "", [42, 17], None, None, sampling_mask=odd), [42, 17])
    assert rows is not None and rows.logprobs is None
    assert kept_lists([None, None]) == {}


def test_match_rows_finds_this_ranks_slice() -> None:
    completions = [([1, 2], "a"), ([3], "b"), ([4, 5], "c"), ([6], "d")]
    assert match_rows(completions, [[4, 5], [6]]) == ["c", "d"]  # TP rank 1 of 2 keeps the second half
    assert match_rows(completions, [[4, 5], [7]]) is None


class _FakeLLM:
    """vllm.LLM in TRL's colocate mode: `generate` returns one RequestOutput per prompt (n = 1)."""

    def __init__(self, completions: list[list[int]], with_mask: bool = True) -> None:
        self.completions = completions
        self.with_mask = with_mask

    def generate(
        self, prompts: list[dict[str, Any]], sampling_params: Any = None, use_tqdm: bool = False
    ) -> list:
        outputs = []
        for i, (prompt, tokens) in enumerate(zip(prompts, self.completions, strict=True)):
            mask = SamplingMask(_sets_for(tokens)) if self.with_mask else None
            completion = CompletionOutput(0, "", list(tokens), None, None, sampling_mask=mask)
            outputs.append(RequestOutput(str(i), prompt["prompt_token_ids"], [completion]))
        return outputs


def _trl_trainer(step: int, llm: _FakeLLM, *, rank_rows: slice = slice(None)) -> tuple[Any, dict]:
    """A stand-in GRPOTrainer whose `_generate` calls the colocated engine as TRL's VLLMGeneration.generate does
    (``self.llm.generate(vllm_prompts, ...)``) and keeps its rank's slice of the completions."""
    output = trl_output(step)
    trainer = trl_trainer_stub(
        step,
        args=SimpleNamespace(temperature=1.0, top_p=0.9, top_k=50, min_p=None),
        vllm_generation=SimpleNamespace(llm=llm),
    )

    def _generate(prompts: list[Any]) -> tuple:
        engine = trainer.vllm_generation.llm
        all_outputs = engine.generate(
            [{"prompt_token_ids": p} for p in [*TRL_PROMPTS, *TRL_PROMPTS][: len(llm.completions)]]
        )
        completions = [list(o.token_ids) for req in all_outputs for o in req.outputs][rank_rows]
        return TRL_PROMPTS, completions, None, ["a"] * 4, None, {}, None, []

    rewards = torch.tensor([[1.0, 0.5], [0.0, 0.5], [1.0, 0.0], [0.0, 0.0]])
    wire_trl_generation(trainer, _generate, rewards, output)
    return trainer, output


@pytest.mark.parametrize("tp_rank", [None, 1], ids=["tp1", "tp2_rank1"])
def test_trl_hook_records_the_engine_kept_sets_and_the_import_writes_them(
    tmp_path: Path, tp_rank: int | None
) -> None:
    import pgdiag.capture.trl

    if tp_rank is None:
        llm, rows = _FakeLLM(TRL_COMPLETIONS), slice(None)
    else:  # the TP group generated another rank's four completions first; this rank keeps the second four
        other = [[21, 1], [22], [23, 24], [25, 1]]
        llm, rows = _FakeLLM(other + TRL_COMPLETIONS), slice(4, 8)
    trainer, _ = _trl_trainer(3, llm, rank_rows=rows)
    pgdiag.capture.trl.install(trainer, tmp_path / "dump")
    trainer._generate_and_score_completions(["p"] * 4)
    payload = torch.load(tmp_path / "dump" / "step_3.pt", weights_only=True)
    assert payload["lists"]["sampling_kept_counts"] == [
        [len(s) for s in _sets_for(c)] for c in TRL_COMPLETIONS
    ]
    pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    frame = pgdiag.read_run(tmp_path / "out").collect(
        ["sample_id", "input_ids", "sampling_kept_ids", "sampling_kept_offsets"]
    )
    for row in frame.sort("sample_id").iter_rows(named=True):
        r = int(row["sample_id"].split(":")[1])
        prompt, completion = TRL_PROMPTS[r], TRL_COMPLETIONS[r]
        sets = _sets_for(completion)
        assert row["sampling_kept_ids"] == [t for s in sets for t in s]
        expected = [0] * (len(prompt) + 1)
        for s in sets:
            expected.append(expected[-1] + len(s))
        assert row["sampling_kept_offsets"] == expected  # prompt positions: empty sets


def test_without_sampling_masks_nothing_is_recorded(tmp_path: Path) -> None:
    import pgdiag.capture.trl

    trainer, _ = _trl_trainer(0, _FakeLLM(TRL_COMPLETIONS, with_mask=False))
    pgdiag.capture.trl.install(trainer, tmp_path / "dump")
    trainer._generate_and_score_completions(["p"] * 4)
    payload = torch.load(tmp_path / "dump" / "step_0.pt", weights_only=True)
    assert "sampling_kept_ids" not in payload["lists"]


def test_recorded_counts_of_another_length_are_e703(tmp_path: Path) -> None:
    import pgdiag.capture.trl

    trainer, _ = _trl_trainer(0, _FakeLLM(TRL_COMPLETIONS))
    pgdiag.capture.trl.install(trainer, tmp_path / "dump")
    trainer._generate_and_score_completions(["p"] * 4)

    def drop_one(payload: dict) -> None:
        payload["lists"]["sampling_kept_counts"][1] = payload["lists"]["sampling_kept_counts"][1][:-1]

    rewrite_hook_file(tmp_path / "dump" / "step_0.pt", drop_one)
    with pytest.raises(InvalidInputError) as raised:
        pgdiag.import_run("trl", tmp_path / "dump", tmp_path / "out")
    assert raised.value.code == "E703" and "row 1" in raised.value.message
    assert not (tmp_path / "out" / "rollouts").exists()
