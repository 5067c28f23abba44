"""The Triton LM-head kernel on the CPU through the Triton interpreter, and its launch heuristics."""

from __future__ import annotations

from pathlib import Path

import torch
import triton
from triton_interpreter import run_interpreted

from pgdiag.kernels.lm_head_logprobs_triton import head_mode_for
from pgdiag.kernels.triton_shared import SplitPlan, choose_n_splits, choose_plan


def test_kernel_cases_under_the_interpreter() -> None:
    run_interpreted(Path(__file__).with_name("triton_interpret_cases.py"))


def test_choose_n_splits_fills_whole_waves() -> None:
    # 128 token blocks x 594 vocab tiles on 132 SMs: 33 splits of 18 tiles are exactly 32 waves
    assert choose_n_splits(128, 594, 132) == 33
    assert choose_n_splits(1, 1, 132) == 1
    # one token block: as many splits as there are slots (capped by the tile count)
    assert choose_n_splits(1, 40, 8) == 8
    # 64 blocks x 501 tiles (fp32 head, TP = 2, d = 8192): 2 splits of 251 would fill one wave (cost 251.25) with
    # 64 token blocks in flight; from 11 splits up the best is 39 splits of 13 tiles: 19 waves x 13.25 = 251.75
    assert choose_n_splits(64, 501, 132) == 39


def test_choose_plan_prefers_l2_aligned_groups_unless_waves_are_lost() -> None:
    # 512 token blocks x 501 vocab tiles, 132 slots, groups of 12: 2 x 132 // 12 = 22 splits of cdiv(501, 22) = 23
    # tiles; 512 x 22 = 11264 programs = 86 waves x 23.25 = 1999.5, against 70 waves x 28.25 = 1977.5 for the
    # wave-filling 18 splits (1.1 % more, within the 5 % slack): aligned, in groups of 12
    assert choose_plan(512, 501, 132, 12) == SplitPlan(22, 23, 12)
    # 16 blocks x 594 tiles: aligned 22 splits of 27 -> 3 waves x 27.25 = 81.75; wave-filling 33 splits of 18
    # -> 4 waves x 18.25 = 73.0 (12 % less): wave-filling, in groups of 132 // 33 = 4
    assert choose_plan(16, 594, 132, 12) == SplitPlan(33, 18, 4)
    # 128 blocks x 251 tiles (bf16, TP = 2, d = 8192): 22 splits would be dealt as 21 of 12 tiles (not aligned), so
    # 11 splits of 23 tiles, one wave per group: 11 waves x 23.25 = 255.75 against 253.75 (36 wave-filling splits; 0.8 % more)
    assert choose_plan(128, 251, 132, 12) == SplitPlan(11, 23, 12)
    # no aligned group size: the wave-filling plan (9 splits of 56 would cost 1968.75, but put 14 token blocks
    # in flight; at least cdiv(132, 12) = 11 splits are taken)
    assert choose_plan(512, 501, 132) == SplitPlan(18, 28, 7)
    # T = 65536, V = 151936 at 256 x 128 tiles, groups of 6: 44 splits of 27 tiles, 86 waves x 27.25 = 2343.5
    # against 2318.25 for 17 wave-filling splits (1.1 % more): aligned
    assert choose_plan(256, 1187, 132, 6) == SplitPlan(44, 27, 6)


def test_head_modes() -> None:
    import torch

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert head_mode_for("bf16", bf16, f32) == "bf16"
    assert head_mode_for("fp32", bf16, f32) == "bf16x3"
    assert head_mode_for("fp32", bf16, bf16) == "bf16x1"
    assert head_mode_for("fp32", bf16, f16) == "bf16x3"
    assert head_mode_for("fp32", f16, f32) == "fp16x3"
    assert head_mode_for("fp32", f16, f16) == "fp16x1"
    assert head_mode_for("fp32", f32, bf16) == "tf32x3"


def test_pieces_chunk_splits_tokens_evenly_within_the_budget() -> None:
    from pgdiag.kernels.fp32_head_triton import PIECES_BUDGET_BYTES, pieces_chunk

    assert PIECES_BUDGET_BYTES == 384 << 20
    # 384 MiB / (6 B x 4096) = 16384 tokens: one launch at 16k, four equal ones at 64k
    assert pieces_chunk(16384, 4096, 128) == 16384
    assert pieces_chunk(65536, 4096, 128) == 16384
    assert pieces_chunk(65536, 8192, 128) == 8192
    # 20000 tokens -> 2 chunks of 10112 (79 token blocks) rather than 16384 + 3616
    assert pieces_chunk(20000, 4096, 128) == 10112
    assert pieces_chunk(100, 4096, 128) == 128  # never below one token block


def test_gluon_kernel_absent_where_gluon_is_missing(monkeypatch) -> None:
    """A Triton without Gluon (its import fails) gets no Gluon kernel: `gluon_kernel` is None and the fp32 head
    runs the Triton kernel."""
    import sys

    from pgdiag.kernels import fp32_head_triton

    monkeypatch.delitem(sys.modules, "pgdiag.kernels.fp32_head_gluon", raising=False)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)  # import raises ImportError
    assert fp32_head_triton.gluon_kernel() is None


def test_gluon_kernel_offered_exactly_where_it_compiles() -> None:
    """The Gluon kernel is offered (`gluon_kernel` not None) exactly where the installed Triton compiles it:
    compiled here offline for sm_90 (no GPU needed: an explicit target, Triton's own ptxas), three pieces,
    bf16, the default tiles. With Triton 3.6 both hold; with 3.9 neither (its Gluon removed calls the kernel
    makes), and the fp32 head runs the Triton kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.errors import CompilationError
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from pgdiag.kernels import fp32_head_gluon, fp32_head_triton

    layout = gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16)
    h_desc = TensorDescriptor.from_tensor(torch.empty(3 * 256, 256, dtype=torch.bfloat16), [128, 64], layout)
    w_desc = TensorDescriptor.from_tensor(torch.empty(512, 256, dtype=torch.bfloat16), [128, 64], layout)
    kernel = fp32_head_gluon._fp32_head_gluon_kernel
    ints = ["n_tokens", "piece_rows", "vocab_local", "hidden_size", "stride_split", "stride_stat"]
    ints += ["tiles_per_split", "n_splits", "group_blocks"]
    signature = {"h_desc": h_desc.__mangle__(), "w_desc": w_desc.__mangle__(), "targets_ptr": "*i32"}
    signature |= {"partials_ptr": "*fp32", "inv_temperature": "fp32", **dict.fromkeys(ints, "i32")}
    constants = {"N_PIECES": 3, "FRESH_STEPS": 1, "FRESH_PER_GROUP": 8, "NUM_STAGES": 3, "num_warps": 8}
    signature |= dict.fromkeys(constants, "constexpr")
    source = GluonASTSource(
        kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constants.items()}
    )
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        compiles = True
    except CompilationError:
        compiles = False
    assert (fp32_head_triton.gluon_kernel() is not None) == compiles
