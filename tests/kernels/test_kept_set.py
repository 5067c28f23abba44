"""The kept-set head (`kernels.kept_set`: K scored inside the head, as packed bitmask words) against fp64,
its words (CSR ids, bitmasks at any shard offset), TP = 2 on gloo, the Triton kernels under the interpreter,
and the reconstruction of K in vLLM's and SGLang's orders (ties at the k-th logit, min-p + top-p)."""

from __future__ import annotations

import math
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kept_cases import edge_kept_case, kept_case, kept_reference, with_bitmask_rows
from lm_head_cases import IGNORE
from triton_interpreter import run_interpreted

from pgdiag.errors import InvalidInputError, UsageError
from pgdiag.kernels import kept_set, kept_threshold, lm_head_logprobs
from pgdiag.kernels.kept_reconstruct import (
    keep_mask_sglang,
    keep_mask_vllm,
    reconstruct_kept,
)
from pgdiag.kernels.kept_set import KeptSet, bitmask_words, kept_words, or_bits_torch
from pgdiag.kernels.kept_threshold import keep_mask_threshold
from pgdiag.kernels.lm_head_logprobs_ref import unpack_words
from pgdiag.kernels.vocab_parallel import vocab_shard_range

TEMPERATURE = 0.7


def _ids(mask: torch.Tensor) -> list[list[int]]:
    return [row.nonzero()[:, 0].tolist() for row in mask]


def scored_fp32(kc, temperature: float):
    """The fp32 head's scores of `kc` over its kept sets, and the fp64 reference's."""
    out = lm_head_logprobs(
        kc.case.hidden,
        kc.case.weight,
        kc.case.targets,
        temperature=temperature,
        head_dtype="fp32",
        kept=kc.kept,
    )
    return out, kept_reference(kc, temperature)


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_kept_scores_match_fp64(temperature: float) -> None:
    kc = kept_case(48, 32, 97, seed=5)
    out, ref = scored_fp32(kc, temperature)
    assert out.kept_mass is not None and out.logprobs_full is not None
    torch.testing.assert_close(out.logprobs.double(), ref["logprobs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ref["entropy"], rtol=0, atol=1e-5)
    # the mass is exp(lse_K - lse) of two fp32 log-sum-exps near |z| ~ 20: a few fp32 ulp of 20, relative
    torch.testing.assert_close(out.kept_mass.double(), ref["kept_mass"], rtol=5e-6, atol=1e-7)
    torch.testing.assert_close(out.logprobs_full.double(), ref["full"], rtol=1e-6, atol=1e-5)
    # the identity the bias rests on: renormalised - full = -log kept mass
    loss = kc.case.targets != IGNORE
    gap = (out.logprobs - out.logprobs_full)[loss].double()
    torch.testing.assert_close(gap, -torch.log(out.kept_mass[loss].double()), rtol=0, atol=2e-5)
    assert out.logprobs[0].item() == 0.0  # a one-token set: exactly 0.0
    assert out.kept_mass[3].item() == 1.0 and out.logprobs[3] == out.logprobs_full[3]  # not recorded


def test_target_outside_its_set_is_e221() -> None:
    kc = kept_case(8, 16, 40, seed=2)
    ids = kc.kept.ids.clone()
    first = int(kc.kept.offsets[2])
    ids[first] = (int(kc.case.targets[2]) + 1) % 40  # the target (first element) replaced
    if int(ids[first]) in ids[first + 1 : int(kc.kept.offsets[3])].tolist():
        pytest.skip("replacement already in the set")  # not reached with this seed
    with pytest.raises(InvalidInputError) as raised:
        lm_head_logprobs(kc.case.hidden, kc.case.weight, kc.case.targets, kept=KeptSet(ids, kc.kept.offsets))
    assert raised.value.code == "E221" and "token 2" in raised.value.message


@pytest.mark.parametrize(
    "broken",
    [
        lambda offsets: offsets + 1,  # does not start at 0
        lambda offsets: torch.cat([offsets[:-1], offsets[-1:] - 1]),  # does not end at len(ids)
        lambda offsets: torch.cat([offsets[:2], offsets[3:4], offsets[2:3], offsets[4:]]),  # falls
    ],
    ids=["start", "end", "falls"],
)
@pytest.mark.parametrize("with_bitmasks", [False, True], ids=["ids", "ids and bitmask rows"])
def test_kept_offsets_that_do_not_rise_from_0_to_len_ids_are_e513(broken, with_bitmasks: bool) -> None:
    """Reported after the head pass (the packing clips every range), with or without bitmask rows beside the ids."""
    kc = kept_case(8, 16, 40, seed=2)
    kept = with_bitmask_rows(kc.kept, [5, 6], 40) if with_bitmasks else kc.kept
    assert int(kept.sizes()[2]) > 0  # swapping offsets 2 and 3 makes token 2's range fall
    bad = replace(kept, offsets=broken(kept.offsets))
    with pytest.raises(UsageError) as raised:
        lm_head_logprobs(kc.case.hidden, kc.case.weight, kc.case.targets, kept=bad)
    assert raised.value.code == "E513" and "rise from 0 to len(ids)" in raised.value.message


def test_a_negative_target_is_reported_before_the_kept_offsets() -> None:
    kc = kept_case(8, 16, 40, seed=2)
    targets = kc.case.targets.clone()
    targets[5] = -7
    with pytest.raises(InvalidInputError) as raised:
        lm_head_logprobs(
            kc.case.hidden, kc.case.weight, targets, kept=KeptSet(kc.kept.ids, kc.kept.offsets + 1)
        )
    assert raised.value.code == "E208" and "token 5" in raised.value.message


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tp_kept(kc, vocab: int) -> KeptSet:
    """The TP cases' kept sets: engine log-probs, and tokens 5 and 9 as bitmasks (no engine log-probs)."""
    return with_bitmask_rows(_with_engine_logprobs(kc), [5, 9], vocab)


def _tp_rank(rank: int, world: int, port: int, vocab: int, out_dir: str, impl: str = "auto") -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        kc = kept_case(40, 24, vocab, seed=11)
        start, stop = vocab_shard_range(vocab, rank, world)
        calls = []
        original = dist.all_gather

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        dist.all_gather = counted
        out = lm_head_logprobs(
            kc.case.hidden,
            kc.case.weight[start:stop],
            kc.case.targets,
            temperature=TEMPERATURE,
            head_dtype="fp32",
            tp_group=dist.group.WORLD,
            vocab_start=start,
            kept=_tp_kept(kc, vocab),
            impl=impl,
        )
        dist.all_gather = original
        n = kc.case.targets.shape[0]
        shown = torch.arange(n, dtype=torch.int64)
        top_k = torch.full((n,), 5, dtype=torch.int64)
        top_p = torch.full((n,), 0.9)
        min_p = torch.zeros(n)
        rebuilt = reconstruct_kept(
            kc.case.hidden,
            kc.case.weight[start:stop],
            temperature=TEMPERATURE,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            engine="vllm",
            tp_group=dist.group.WORLD,
            vocab_start=start,
        )
        torch.save(
            {
                "logprobs": out.logprobs,
                "entropy": out.entropy,
                "kept_mass": out.kept_mass,
                "full": out.logprobs_full,
                "kl": out.kept_kl,
                "gathers": len(calls),
                "rebuilt_ids": rebuilt.ids,
                "rebuilt_offsets": rebuilt.offsets,
                "n": shown,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_tp2_on_gloo_equals_one_rank(tmp_path: Path) -> None:
    check_tp2_against_one_rank(tmp_path, "auto")


def check_tp2_against_one_rank(tmp_path: Path, impl: str) -> None:
    """Shards of 19 and 18 rows (the second starts mid-word: its bitmask words are shifted by 19 bits), each
    rank's head run with `impl`, against one rank of the torch head with the same sets as ids."""
    vocab = 37
    mp.spawn(_tp_rank, args=(2, _free_port(), vocab, str(tmp_path), impl), nprocs=2)
    kc = kept_case(40, 24, vocab, seed=11)
    single = lm_head_logprobs(
        kc.case.hidden,
        kc.case.weight,
        kc.case.targets,
        temperature=TEMPERATURE,
        head_dtype="fp32",
        kept=_with_engine_logprobs(kc),
        impl="torch",
    )
    assert bool(torch.isfinite(single.kept_kl[[5, 9]]).all())  # with ids: a KL; as bitmasks below: NaN
    single_kl = single.kept_kl.clone()
    single_kl[[5, 9]] = float("nan")
    n = kc.case.targets.shape[0]
    rebuilt = reconstruct_kept(
        kc.case.hidden,
        kc.case.weight,
        temperature=TEMPERATURE,
        top_k=torch.full((n,), 5, dtype=torch.int64),
        top_p=torch.full((n,), 0.9),
        min_p=torch.zeros(n),
        engine="vllm",
    )
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["logprobs"], single.logprobs, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got["entropy"], single.entropy, rtol=0, atol=1e-5)
        torch.testing.assert_close(got["kept_mass"], single.kept_mass, rtol=5e-6, atol=1e-7)
        torch.testing.assert_close(got["full"], single.logprobs_full, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got["kl"], single_kl, rtol=0, atol=2e-5, equal_nan=True)
        assert got["gathers"] == 1  # the head's and the kept partials (and Σ p_e z) are reduced once
        assert torch.equal(got["rebuilt_ids"], rebuilt.ids) and torch.equal(
            got["rebuilt_offsets"], rebuilt.offsets
        )


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_edge_sets_match_fp64(temperature: float) -> None:
    """The whole vocabulary as K (kept mass 1, the full scores), a one-token set, a set of two tied logits, an
    unrecorded token, an ignored one."""
    kc = edge_kept_case(24, 32, 70, seed=6)
    out, ref = scored_fp32(kc, temperature)
    torch.testing.assert_close(out.logprobs.double(), ref["logprobs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ref["entropy"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.kept_mass.double(), ref["kept_mass"], rtol=5e-6, atol=1e-7)
    assert abs(out.kept_mass[2].item() - 1.0) <= 1e-6 and abs(out.logprobs[2] - out.logprobs_full[2]) <= 1e-6
    assert abs(out.logprobs[4].item() - math.log(0.5)) <= 1e-6  # two tied logits: 1/2 each
    assert abs(out.entropy[4].item() - math.log(2.0)) <= 1e-6
    assert out.logprobs[0].item() == 0.0 and out.logprobs[1].item() == 0.0  # one-token set; ignored
    assert out.kept_mass[3].item() == 1.0 and out.logprobs[3] == out.logprobs_full[3]  # not recorded


def test_bitmask_rows_score_as_their_ids() -> None:
    """Sets given as packed bitmasks (the whole vocabulary among them) give the very numbers of the same sets as
    ids: the head reads the same bits."""
    kc = edge_kept_case(24, 32, 70, seed=6)
    as_ids = lm_head_logprobs(kc.case.hidden, kc.case.weight, kc.case.targets, temperature=0.7, kept=kc.kept)
    packed = with_bitmask_rows(kc.kept, [2, 4, 7, 8], 70)
    as_bits = lm_head_logprobs(kc.case.hidden, kc.case.weight, kc.case.targets, temperature=0.7, kept=packed)
    for name in ("logprobs", "entropy", "kept_mass", "logprobs_full"):
        assert torch.equal(getattr(as_bits, name), getattr(as_ids, name)), name


def test_words_from_ids_and_from_bitmasks_agree() -> None:
    """`kept_words` over the shard [45, 120) of V = 150 (starts mid-word): the CSR ids (duplicates included)
    and the packed bitmasks of the same sets give the same words, and unpack to exactly the sets' local ids."""
    gen = torch.Generator().manual_seed(4)
    sets = [torch.randperm(150, generator=gen)[: int(k)].tolist() for k in (0, 1, 150, 40, 3, 75)]
    sets[3] += sets[3][:5]  # duplicates: an OR, not a sum
    ids = torch.tensor([i for one in sets for i in one], dtype=torch.int64)
    offsets = torch.zeros(len(sets) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(one) for one in sets]), 0)
    got = kept_words(KeptSet(ids, offsets), 0, len(sets), vocab_start=45, vocab_local=75, impl="torch")
    assert got.shape == (len(sets), 3) and got.dtype == torch.int32
    bits = unpack_words(got, 75)
    for n, one in enumerate(sets):
        assert bits[n].nonzero()[:, 0].tolist() == sorted({i - 45 for i in one if 45 <= i < 120})
    packed = with_bitmask_rows(KeptSet(ids, offsets), [1, 2, 3, 5], 150)
    words_packed = kept_words(packed, 0, len(sets), vocab_start=45, vocab_local=75, impl="torch")
    assert torch.equal(unpack_words(words_packed, 75), bits)
    tail = kept_words(packed, 2, 5, vocab_start=45, vocab_local=75, impl="torch")  # a chunk of tokens
    assert torch.equal(unpack_words(tail, 75), bits[2:5])


def test_bitmask_words_shift_by_hand() -> None:
    """Ids 3, 40 and 41 of V = 64 as one bitmask; the shard from id 33 holds 40 and 41 at local rows 7 and 8; a
    shard's words hold no bit past its last row (the next shard's ids)."""
    mask = torch.zeros(1, 8, dtype=torch.uint8)
    mask[0, 0] = 1 << 3
    mask[0, 5] = (1 << 0) | (1 << 1)  # ids 40, 41
    assert bitmask_words(mask, 33, 31).tolist() == [[(1 << 7) | (1 << 8)]]
    assert bitmask_words(mask, 0, 64).tolist() == [[1 << 3, (1 << 8) | (1 << 9)]]
    assert bitmask_words(mask, 0, 41).tolist() == [[1 << 3, 1 << 8]]  # id 41: past the shard, cleared
    assert bitmask_words(mask, 33, 8).tolist() == [[1 << 7]]  # the same, mid-word
    assert or_bits_torch(2, torch.tensor([1, 1, 0]), torch.tensor([31, 31, 0])).tolist() == [1, -(1 << 31)]


def test_an_empty_shard_scores_no_kept_id() -> None:
    """A TP rank with no vocabulary rows (more ranks than rows): zero-width words, empty kept partials."""
    from pgdiag.kernels.lm_head_logprobs_ref import lm_head_partials

    kc = kept_case(6, 8, 20, seed=1)
    empty = kc.case.weight[:0]

    def head(hidden: torch.Tensor, targets: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        return lm_head_partials(hidden, empty, targets, temperature=1.0, head_dtype="fp32", kept_words=words)

    full, masked, underflow = kept_set.kept_head_partials(
        head, kc.case.hidden, torch.full((6,), -1), kc.kept, vocab_start=20, vocab_local=0, impl="torch"
    )
    assert masked.shape == (4, 6) and bool((masked[1] == 0).all()) and bool(torch.isinf(masked[3]).all())
    assert bool((full[1] == 0).all()) and not bool(underflow.any())  # no word, so nothing underflowed


def test_token_chunks_give_the_one_chunk_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A words budget of one 256-token block a chunk (600 tokens -> 3 chunks) changes nothing."""
    kc = kept_case(600, 16, 90, seed=12)
    kept = with_bitmask_rows(kc.kept, [5, 300, 599], 90)
    whole = lm_head_logprobs(kc.case.hidden, kc.case.weight, kc.case.targets, kept=kept)
    monkeypatch.setattr(kept_set, "KEPT_WORDS_BUDGET_BYTES", 4 * 3 * 256)
    assert kept_set.kept_chunk(600, 90) == 256
    chunked = lm_head_logprobs(kc.case.hidden, kc.case.weight, kc.case.targets, kept=kept)
    for name in ("logprobs", "entropy", "kept_mass", "logprobs_full"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name


def test_triton_kernels_under_the_interpreter() -> None:
    run_interpreted(Path(__file__).with_name("kept_interpret_cases.py"))


def _threshold(engine: str):
    def mask(z, top_k, top_p, min_p):
        return keep_mask_threshold(z, top_k, top_p, min_p, engine=engine)

    return mask


VLLM = [keep_mask_vllm, _threshold("vllm")]
SGLANG = [keep_mask_sglang, _threshold("sglang")]
PAIRS = list(zip(VLLM, SGLANG, strict=True))


@pytest.mark.parametrize(("vllm", "sglang"), PAIRS, ids=["sort_reference", "threshold"])
def test_vllm_keeps_ties_at_the_kth_logit_and_sglang_does_not(vllm, sglang) -> None:
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, -1.0]])
    one = torch.ones(1)
    k2 = torch.tensor([2])
    # top-k 2: the 2nd largest logit is 2.0, held by three tokens; vLLM keeps every token >= it
    assert _ids(vllm(z, k2, one, torch.zeros(1))) == [[0, 1, 2, 3]]
    # SGLang keeps rank < 2 after its (stable, descending) sort: the max and the lowest id of the tie
    assert _ids(sglang(z, k2, one, torch.zeros(1))) == [[0, 1]]


@pytest.mark.parametrize(("vllm", "sglang"), PAIRS, ids=["sort_reference", "threshold"])
def test_ties_at_the_top_p_boundary_follow_each_engines_sort(vllm, sglang) -> None:
    # probabilities 0.4, 0.2, 0.2, 0.2 and top-p 0.5. vLLM sorts ascending (stable: ids 1, 2, 3, 0), cumulative
    # 0.2, 0.4, 0.6, 1.0, drops <= 0.5: ids 1 and 2 -> K = {0, 3}. SGLang sorts descending (ids 0, 1, 2, 3),
    # mass before 0, 0.4, 0.6, 0.8, keeps <= 0.5 -> K = {0, 1}
    z = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    args = (torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.0]))
    assert _ids(vllm(z, *args)) == [[0, 3]]
    assert _ids(sglang(z, *args)) == [[0, 1]]


@pytest.mark.parametrize(("vllm", "sglang"), PAIRS, ids=["sort_reference", "threshold"])
def test_min_p_then_top_p_in_vllm_order_by_hand(vllm, sglang) -> None:
    # probabilities 0.5, 0.25, 0.15, 0.06, 0.04 (z = log p): min-p 0.1 drops p < 0.05 (token 4);
    # top-p 0.8 on the renormalised rest (0.5208, 0.2604, 0.1563, 0.0625): ascending cumulative 0.0625, 0.2188,
    # 0.4792, 1.0 -> drop those <= 0.2: token 3 only -> K = {0, 1, 2}
    p = torch.tensor([[0.5, 0.25, 0.15, 0.06, 0.04]])
    z = torch.log(p)
    kept = vllm(z, torch.tensor([0]), torch.tensor([0.8]), torch.tensor([0.1]))
    assert _ids(kept) == [[0, 1, 2]]
    # SGLang, independent masks on the full distribution: before-mass 0, 0.5, 0.75, 0.9, 0.96 <= 0.8 keeps 0-2;
    # min-p 0.1 x 0.5 = 0.05 drops token 4: the same K here
    assert _ids(sglang(z, torch.tensor([0]), torch.tensor([0.8]), torch.tensor([0.1]))) == [[0, 1, 2]]
    # top-p 0.76 tells the orders apart: vLLM drops the renormalised ascending cumulative <= 0.24 (tokens 3 and 2:
    # 0.0625, 0.2188) -> {0, 1}; SGLang's before-mass of token 2 on the full distribution is 0.75 <= 0.76 -> {0, 1, 2}
    args = (torch.tensor([0]), torch.tensor([0.76]), torch.tensor([0.1]))
    assert _ids(vllm(z, *args)) == [[0, 1]]
    assert _ids(sglang(z, *args)) == [[0, 1, 2]]


def test_vllm_order_matches_transformers_warpers() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(3)
    z = torch.randn(64, 200, generator=gen) * 3
    for k, p, m in ((20, 0.9, 0.0), (0, 0.7, 0.05), (50, 1.0, 0.0), (10, 0.95, 0.02)):
        scores = z.clone()
        if m > 0:
            scores = MinPLogitsWarper(m)(None, scores)
        if k > 0:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        expected = torch.isfinite(scores)
        n = z.shape[0]
        args = (torch.full((n,), k), torch.full((n,), p), torch.full((n,), m))
        assert torch.equal(keep_mask_vllm(z, *args), expected), (k, p, m)
        assert torch.equal(keep_mask_threshold(z, *args, engine="vllm"), expected), (k, p, m)


SETTINGS = [
    (20, 0.9, 0.0),
    (0, 0.7, 0.05),
    (0, 0.99, 0.0),
    (0, 1.0, 0.1),
    (5, 0.5, 0.0),
    (0, 0.95, 0.0),
    (2000, 0.999, 0.0),
    (10, 0.95, 0.02),
    (0, 1.0, 0.0),
]


def _boundary_gap(z: torch.Tensor, token: int, k: int, p: float, m: float, engine: str) -> float:
    """fp64 distance from the top-p line of `token`'s mass above it: renormalised over the tokens vLLM's min-p
    and top-k leave (ties at the k-th logit kept), over the full distribution for SGLang."""
    zd = z.double()
    keep = torch.ones_like(zd, dtype=torch.bool)
    if engine == "vllm":
        if m > 0:
            keep &= zd >= zd.max() + math.log(m)
        if 0 < k < zd.numel():
            keep &= zd >= torch.where(keep, zd, float("-inf")).topk(k).values[-1]
    probs = torch.softmax(torch.where(keep, zd, float("-inf")), 0)
    return abs(float(probs[zd > zd[token]].sum()) - p)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("window", [1024, 6])
def test_threshold_bisection_equals_the_sort_reference(
    engine: str, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bisection (no vocabulary sort) gives the literal sort's sets: every row equal except a token within
    fp32 rounding of the top-p boundary (the reference sums fp32 probabilities, the bisection fp64 masses).
    `window` 6 forces many bisection passes; on odd rows, ties (three tied maxima, ten tied logits further
    down, fifty tied at the top-k boundary) exercise the tie order."""
    monkeypatch.setattr(kept_threshold, "WINDOW_MAX", window)
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(64, 2000, generator=gen) * 2.5
    z[1::2, :3] = 9.0
    z[1::2, 10:20] = 5.0
    z[1::2, 100:150] = 4.0
    reference = keep_mask_vllm if engine == "vllm" else keep_mask_sglang
    n = z.shape[0]
    for k, p, m in [*SETTINGS, (60, 1.0, 0.0), (30, 0.97, 0.0)]:
        args = (torch.full((n,), k), torch.full((n,), p), torch.full((n,), m))
        got, want = keep_mask_threshold(z, *args, engine=engine), reference(z, *args)
        differ = (got != want).any(dim=1).nonzero()[:, 0].tolist()
        assert len(differ) <= 2, (k, p, m, differ)
        for row in differ:
            assert int((got[row] != want[row]).sum()) == 1
            token = int((got[row] != want[row]).nonzero()[0, 0])
            assert _boundary_gap(z[row], token, k, p, m, engine) < 2e-6, (k, p, m, row)


def test_per_row_settings_mix() -> None:
    """Rows with different settings in one call (top-k on some rows only, top-p on others, min-p alone)."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(60, 500, generator=gen) * 2
    z[::7, 40:45] = z[::7].amax(1, keepdim=True) - 1.0  # ties below the max
    top_k = torch.tensor([0, 5, 50, 499, 500, 1] * 10)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.3] * 12)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.2] * 15)
    for engine, reference in (("vllm", keep_mask_vllm), ("sglang", keep_mask_sglang)):
        got = keep_mask_threshold(z, top_k, top_p, min_p, engine=engine)
        assert torch.equal(got, reference(z, top_k, top_p, min_p)), engine


def test_reconstruct_equals_the_reference_on_its_logits() -> None:
    kc = kept_case(48, 32, 300, seed=6)
    n = kc.case.targets.shape[0]
    top_k = torch.full((n,), 40, dtype=torch.int64)
    top_p = torch.full((n,), 0.8)
    min_p = torch.full((n,), 0.01)
    z = (kc.case.hidden.float() @ kc.case.weight.float().T) / TEMPERATURE
    for engine, reference in (("vllm", keep_mask_vllm), ("sglang", keep_mask_sglang)):
        rebuilt = reconstruct_kept(
            kc.case.hidden, kc.case.weight, temperature=TEMPERATURE, top_k=top_k, top_p=top_p, min_p=min_p,
            engine=engine,
        )  # fmt: skip
        rows, cols = reference(z, top_k, top_p, min_p).nonzero(as_tuple=True)
        assert torch.equal(rebuilt.ids, cols)
        assert torch.equal(rebuilt.sizes(), torch.bincount(rows, minlength=n))


def _with_engine_logprobs(kc, seed: int = 3) -> KeptSet:
    """The case's kept sets with engine log-probs: the model's own, perturbed (an engine of another precision)."""
    z = (kc.case.hidden.double() @ kc.case.weight.double().T) / TEMPERATURE
    token = kc.kept.element_token()
    gen = torch.Generator().manual_seed(seed)
    noisy = z[token, kc.kept.ids] + 0.05 * torch.randn(token.shape[0], generator=gen, dtype=torch.float64)
    return KeptSet(kc.kept.ids, kc.kept.offsets, noisy.float())


def test_kept_kl_matches_fp64() -> None:
    kc = kept_case(40, 24, 61, seed=8)
    kept = _with_engine_logprobs(kc)
    out = lm_head_logprobs(
        kc.case.hidden, kc.case.weight, kc.case.targets, temperature=TEMPERATURE, head_dtype="fp32", kept=kept
    )
    assert out.kept_kl is not None
    z = (kc.case.hidden.double() @ kc.case.weight.double().T) / TEMPERATURE
    for n in range(kc.case.targets.shape[0]):
        lo, hi = int(kept.offsets[n]), int(kept.offsets[n + 1])
        if hi == lo:
            assert torch.isnan(out.kept_kl[n])
            continue
        engine = torch.log_softmax(kept.logprobs[lo:hi].double(), 0)
        model = torch.log_softmax(z[n, kept.ids[lo:hi]], 0)
        truth = float((engine.exp() * (engine - model)).sum())
        assert abs(float(out.kept_kl[n]) - truth) <= 2e-5, (n, float(out.kept_kl[n]), truth)
    assert float(out.kept_kl[0]) == pytest.approx(0.0, abs=1e-6)  # a one-token set: no divergence
