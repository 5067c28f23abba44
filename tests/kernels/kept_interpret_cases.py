"""Kept-set cases under the Triton interpreter (TRITON_INTERPRET=1), fp16 and fp32 on the CPU: the head kernels'
kept pass against the plain-torch reference, the atomic OR of the words, the engine-term gather-dot, and TP = 2.

Not collected by the main test run: `test_kept_set.py` runs this file in a child pytest with the interpreter on.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import triton
from kept_cases import edge_kept_case, kept_case, kept_reference, with_bitmask_rows
from test_kept_set import check_tp2_against_one_rank

from pgdiag.kernels import kept_set, lm_head_logprobs
from pgdiag.kernels import lm_head_logprobs_ref as reference
from pgdiag.kernels.kept_set import KeptSet, csr_words_torch, kept_logits, kept_words
from pgdiag.kernels.kept_set_triton import csr_words_triton, kept_logits_triton
from pgdiag.kernels.lm_head_logprobs_triton import head_mode_for, lm_head_partials
from pgdiag.kernels.triton_shared import TritonTiles
from pgdiag.kernels.vocab_parallel import merge_partials

SMALL_TILES = TritonTiles(block_n=16, block_v=16, block_k=16, num_warps=4, num_stages=1)


def test_interpreter_is_on() -> None:
    assert triton.knobs.runtime.interpret


@pytest.mark.parametrize("start, stop", [(0, 40), (7, 33)])
def test_csr_words_equal_the_torch_reference(start: int, stop: int) -> None:
    """The row-parallel Triton packing against the search-and-OR of the torch path, over the shard [45, 145) of
    V = 200 (it starts mid-word): sets of 0 to 150 ids (more than one block of a program), duplicates, ids of
    other shards, bit 31 of a word, a chunk of inner tokens."""
    gen = torch.Generator().manual_seed(1)
    sizes = torch.randint(0, 151, (40,), generator=gen)
    sizes[3], sizes[9] = 0, 150
    offsets = torch.zeros(41, dtype=torch.int64)
    offsets[1:] = torch.cumsum(sizes, 0)
    ids = torch.randint(0, 200, (int(offsets[-1]),), generator=gen)
    ids[int(offsets[5])] = 45 + 31  # bit 31 of the shard's first word
    kept = KeptSet(ids, offsets)
    shard = {"vocab_start": 45, "vocab_local": 100}
    got = csr_words_triton(ids, offsets, start, stop, **shard)
    assert torch.equal(got, csr_words_torch(kept, start, stop, **shard))
    assert torch.equal(got, kept_words(kept, start, stop, impl="triton", **shard))
    assert int(got[5 - start, 0]) < 0 if start <= 5 < stop else True  # the sign bit is bit 31


def test_csr_words_of_offsets_that_fall_stay_in_bounds() -> None:
    """Offsets that fall or run past len(ids) (reported by `lm_head_logprobs` only after the head): each range is
    clipped to [its start, len(ids)], a falling one is empty, so no access leaves the ids."""
    ids = torch.arange(10)
    offsets = torch.tensor([0, 6, 2, 14, 10])
    words = csr_words_triton(ids, offsets, 0, 4, vocab_start=0, vocab_local=10)
    assert words.shape == (4, 1)
    assert int(words[0, 0]) == 0b111111 and int(words[1, 0]) == 0 and int(words[2, 0]) == 0b1111111100


def _stats(merged: torch.Tensor) -> torch.Tensor:
    """(3, N) fp64 lse, entropy and max of merged (4, N) partials (0 where a token has none)."""
    m, s, s1, _ = merged.double().unbind(0)
    has = s > 0
    safe = torch.where(has, s, 1.0)
    return torch.stack(
        [torch.where(has, m + torch.log(safe), 0.0), torch.log(safe) - s1 / safe, has.double()]
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau={t}")
@pytest.mark.parametrize(
    ("dtype", "head_dtype", "mode"),
    [(torch.float16, "bf16", "bf16"), (torch.float16, "fp32", "fp16x1"), (torch.float32, "fp32", "tf32x3")],
    ids=["fp16_plain", "fp16_exact_hidden", "fp32_tf32x3"],
)
@pytest.mark.parametrize(("vocab_start", "n_splits"), [(0, 3), (45, 2)], ids=["whole", "shard_from_45"])
@pytest.mark.parametrize("block_v", [16, 64], ids=["half_word_tiles", "two_word_tiles"])
def test_kept_pass_equals_the_torch_reference(
    block_v: int,
    vocab_start: int,
    n_splits: int,
    dtype: torch.dtype,
    head_dtype: str,
    mode: str,
    temperature: float,
) -> None:
    """The kernels' 8 partial rows a split, merged, against the reference's: the full vocabulary and K (the whole
    vocabulary, one token, two tied logits, not recorded, bitmask rows) over the shard [vocab_start, 131), in
    vocab tiles of half a word and of two words (the last one ragged)."""
    kc = edge_kept_case(37, 40, 131, seed=5, dtype=dtype)
    kept = with_bitmask_rows(kc.kept, [2, 6, 30], 131)
    weight = kc.case.weight[vocab_start:]
    vocab_local = weight.shape[0]
    local = kc.case.targets - vocab_start
    local = torch.where((local >= 0) & (local < vocab_local), local, -1)
    words = kept_words(kept, 0, 37, vocab_start=vocab_start, vocab_local=vocab_local, impl="triton")
    assert torch.equal(
        words, kept_words(kept, 0, 37, vocab_start=vocab_start, vocab_local=vocab_local, impl="torch")
    )
    assert head_mode_for(head_dtype, weight.dtype, kc.case.hidden.dtype) == mode
    tiles = replace(SMALL_TILES, n_splits=n_splits, block_v=block_v)
    got = lm_head_partials(
        kc.case.hidden, weight, local, temperature=temperature, head_dtype=head_dtype, tiles=tiles,
        kept_words=words,
    )  # fmt: skip
    want = reference.lm_head_partials(
        kc.case.hidden, weight, local, temperature=temperature, head_dtype=head_dtype, kept_words=words
    )
    assert got.shape == (n_splits, 8, 37) and want.shape == (1, 8, 37)
    for rows in (slice(0, 4), slice(4, 8)):
        torch.testing.assert_close(
            _stats(merge_partials(got[:, rows])), _stats(merge_partials(want[:, rows])), rtol=0, atol=2e-5
        )
    assert bool((got[:, 7] == float("-inf")).all())  # the kept target row is the caller's


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_triton_impl_end_to_end_matches_fp64(dtype: torch.dtype) -> None:
    kc = edge_kept_case(24, 32, 61, seed=4, dtype=dtype)
    out = lm_head_logprobs(
        kc.case.hidden, kc.case.weight, kc.case.targets, temperature=0.7, head_dtype="fp32", impl="triton",
        kept=with_bitmask_rows(kc.kept, [2, 5], 61),
    )  # fmt: skip
    assert out.impl == "triton"
    ref = kept_reference(kc, 0.7)
    torch.testing.assert_close(out.logprobs.double(), ref["logprobs"], rtol=0, atol=2e-5)
    torch.testing.assert_close(out.entropy.double(), ref["entropy"], rtol=0, atol=2e-5)
    torch.testing.assert_close(out.kept_mass.double(), ref["kept_mass"], rtol=5e-6, atol=1e-7)
    assert out.logprobs[0].item() == 0.0  # a one-token set


def test_tp2_on_gloo_with_the_triton_head(tmp_path: Path) -> None:
    check_tp2_against_one_rank(tmp_path, "triton")


@pytest.mark.parametrize(
    ("dtype", "head_dtype"),
    [(torch.float16, "bf16"), (torch.float16, "fp32"), (torch.float32, "fp32")],
    ids=["fp16_head16", "fp16_head32", "fp32"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_dot_equals_the_torch_reference(
    dtype: torch.dtype, head_dtype: str, temperature: float
) -> None:
    kc = kept_case(20, 40, 53, seed=9, hidden_dtype=dtype, weight_dtype=dtype)
    tokens = kc.kept.element_token()
    rows = kc.kept.ids.clone()
    rows[::5] = -1  # ids of another shard
    ref = kept_logits(
        kc.case.hidden, kc.case.weight, tokens, rows, temperature=temperature, head_dtype=head_dtype
    )
    got = kept_logits_triton(
        kc.case.hidden, kc.case.weight, tokens, rows, temperature=temperature, head_dtype=head_dtype
    )
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and bool(torch.isinf(got[::5]).all())
    torch.testing.assert_close(got[torch.isfinite(ref)], ref[torch.isfinite(ref)], rtol=1e-6, atol=1e-5)


def _ascending_thresholds(z: torch.Tensor, n_levels: int, gen: torch.Generator) -> torch.Tensor:
    """(C, S) ascending thresholds: random values in the rows' range, some equal to logits (ties with z)."""
    low = torch.where(torch.isfinite(z), z, float("inf")).amin(1, keepdim=True)  # thresholds are finite
    high = z.amax(1, keepdim=True)
    t = low + (high - low) * torch.rand(z.shape[0], n_levels, generator=gen)
    t[:, 3] = z[:, 7]  # a threshold equal to a logit: z >= t counts it
    return t.sort(dim=1).values


def test_levels_kernel_equals_the_torch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from pgdiag.kernels import kept_threshold_triton
    from pgdiag.kernels.kept_threshold import LEVELS, levels_torch

    monkeypatch.setattr(kept_threshold_triton, "SPLIT_COLUMNS", 256)  # three splits, the last one partial
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(12, 700, generator=gen) * 3
    z[:, 50:60] = 1.25  # ties
    z[2, 100:] = float("-inf")  # masked logits carry no count and no mass
    row_max = z.amax(1)
    t = _ascending_thresholds(z, LEVELS, gen)
    counts, masses = kept_threshold_triton.levels_triton(z, row_max, t)
    want_counts, want_masses = levels_torch(z, row_max, t)
    assert torch.equal(counts, want_counts)
    assert int(counts[0, 0]) == int((z[0] >= t[0, 0]).sum())
    torch.testing.assert_close(masses, want_masses, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_reconstruct_with_the_triton_pass_equals_the_sort_reference(
    engine: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pgdiag.kernels import kept_threshold, kept_threshold_triton
    from pgdiag.kernels.kept_reconstruct import keep_mask_sglang, keep_mask_vllm, reconstruct_kept

    monkeypatch.setattr(kept_threshold_triton, "SPLIT_COLUMNS", 256)
    monkeypatch.setattr(kept_threshold, "WINDOW_MAX", 4)  # several bisection passes
    kc = kept_case(16, 32, 600, seed=3, hidden_dtype=dtype, weight_dtype=dtype)
    n = kc.case.targets.shape[0]
    top_k = torch.tensor([0, 30, 5, 200] * (n // 4))
    top_p = torch.tensor([0.9, 0.8, 1.0, 0.95] * (n // 4))
    min_p = torch.tensor([0.02, 0.0, 0.0, 0.0] * (n // 4))
    rebuilt = reconstruct_kept(
        kc.case.hidden, kc.case.weight, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, engine=engine,
        impl="triton",
    )  # fmt: skip
    z = (kc.case.hidden.float() @ kc.case.weight.float().T) / 0.7
    reference = keep_mask_vllm if engine == "vllm" else keep_mask_sglang
    rows, cols = reference(z, top_k, top_p, min_p).nonzero(as_tuple=True)
    assert torch.equal(rebuilt.ids, cols)
    assert torch.equal(rebuilt.sizes(), torch.bincount(rows, minlength=n))


@pytest.mark.parametrize("n_tokens, budget", [(24, None), (600, 8 * 256)])
def test_kept_sets_far_below_the_maximum_are_scored_exactly(
    monkeypatch: pytest.MonkeyPatch, n_tokens: int, budget: int | None
) -> None:
    """At T = 0.05 the one-token sets of unlikely targets lie hundreds of nats below the row's maximum: the kernel's
    K sums (centred on the full maximum) underflow to 0 there, and those rows are scored again by the reference
    (K's own maximum): the same numbers as the torch head, a one-token set exactly 0.0. With a words budget of
    8 bytes x 256 rows the 600 tokens run in three chunks (256, 256, 88 rows), and the underflowing rows of every
    chunk are re-scored after the one check that follows all the head passes."""
    if budget is not None:
        monkeypatch.setattr(kept_set, "KEPT_WORDS_BUDGET_BYTES", budget)
        assert kept_set.kept_chunk(n_tokens, 61) == 256
    kc = kept_case(n_tokens, 32, 61, seed=4)
    ones = [n for n in range(n_tokens) if int(kc.kept.sizes()[n]) > 0][:: max(1, n_tokens // 40)][:40]
    ids = torch.cat([kc.kept.ids[int(kc.kept.offsets[n]) : int(kc.kept.offsets[n + 1])][:1] for n in ones])
    sizes = torch.zeros(n_tokens, dtype=torch.int64)
    sizes[ones] = 1  # each of these tokens keeps its target alone (the first id of its set)
    offsets = torch.zeros(n_tokens + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(sizes, 0)
    kept = KeptSet(ids, offsets)
    words = kept_words(kept, 0, n_tokens, vocab_start=0, vocab_local=61, impl="triton")
    local = torch.where(kc.case.targets < 0, -1, kc.case.targets)
    raw = lm_head_partials(
        kc.case.hidden, kc.case.weight, local, temperature=0.05, head_dtype="fp32", kept_words=words
    )
    underflowed = torch.tensor(ones)[merge_partials(raw[:, 4:])[1][ones] == 0]
    assert int(underflowed.shape[0]) >= 3  # the case exercises the fallback
    if budget is not None:  # in every chunk
        assert set((underflowed // 256).tolist()) == {0, 1, 2}
    args = (kc.case.hidden, kc.case.weight, kc.case.targets)
    got = lm_head_logprobs(*args, temperature=0.05, head_dtype="fp32", impl="triton", kept=kept)
    want = lm_head_logprobs(*args, temperature=0.05, head_dtype="fp32", impl="torch", kept=kept)
    assert bool((got.logprobs[ones] == 0.0).all())
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-4)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=1e-4)
    torch.testing.assert_close(got.kept_mass, want.kept_mass, rtol=1e-4, atol=0)
