"""Where the bf16 kept-set head's time over the plain head goes, per |K|: `kept_words` (the bitmask words), the
Triton head given the words (the K pass inside the kernel), the whole `lm_head_logprobs` with the kept set, and
the rows re-scored for underflow. The inputs are bench_kept_set's (d = 4096, V = 151,936, 16,384 tokens, bf16).

With `--profile`, a `torch.profiler` pass of a few plain and kept calls gives each call's GPU kernel time by
kernel name beside its wall time (CUDA events): the difference is time the GPU waited on the host.

GPU only: `python benchmarks/diag_kept_head.py [--sizes 1 16 64] [--profile]` (docs/benchmarks.md, "Kept set
scored inside the fused LM head").
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton.testing as tt
from torch.profiler import ProfilerActivity, profile

from pgdiag.kernels import lm_head_logprobs
from pgdiag.kernels import lm_head_logprobs_triton as triton_head
from pgdiag.kernels.kept_set import kept_words
from pgdiag.kernels.vocab_parallel import PARTIAL_ROWS, merge_partials

VOCAB, HIDDEN, TOKENS = 151936, 4096, 16384


def profile_calls(name: str, fn, calls: int = 4) -> None:
    """Print the mean wall ms of `fn` (events around each call) and its GPU kernels' ms per call, by name."""
    fn()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            walls.append(start.elapsed_time(stop))
    by_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kernel[event.name[:70]] += event.device_time / 1000 / calls  # us -> ms a call
    busy = sum(by_kernel.values())
    wall = sum(walls) / calls
    print(f"{name}: wall {wall:.2f} ms, GPU kernels {busy:.2f} ms, GPU idle {wall - busy:.2f} ms a call")
    for kernel, ms in sorted(by_kernel.items(), key=lambda item: -item[1])[:12]:
        print(f"    {ms:8.3f} ms  {kernel}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 16, 64])
    parser.add_argument(
        "--profile", action="store_true", help="a torch.profiler pass of plain and kept calls"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_kept_set import kept_sets, make_inputs

    hidden, weight, targets = make_inputs(TOKENS, HIDDEN, VOCAB)
    options = {"temperature": 1.0, "head_dtype": "bf16"}
    plain = tt.do_bench(lambda: lm_head_logprobs(hidden, weight, targets, **options))
    if args.profile:
        profile_calls("plain", lambda: lm_head_logprobs(hidden, weight, targets, **options))
        for size in args.sizes:
            kept = kept_sets(targets, size, VOCAB)
            profile_calls(
                f"kept |K|={size}",
                lambda kept=kept: lm_head_logprobs(hidden, weight, targets, kept=kept, **options),
            )
        return
    print(f"plain head {plain:.2f} ms")
    for size in args.sizes:
        kept = kept_sets(targets, size, VOCAB)

        def words_of(kept=kept):
            return kept_words(kept, 0, TOKENS, vocab_start=0, vocab_local=VOCAB, impl="triton")

        words = words_of()  # (N, W) int32

        def head(words=words):
            return triton_head.lm_head_partials(hidden, weight, targets, kept_words=words, **options)

        masked = merge_partials(head()[:, PARTIAL_ROWS:])  # (4, N) K's partials
        underflow = int((words.any(dim=1) & (masked[1] == 0)).sum())
        t_words, t_head = tt.do_bench(words_of), tt.do_bench(head)
        t_all = tt.do_bench(lambda kept=kept: lm_head_logprobs(hidden, weight, targets, kept=kept, **options))
        print(
            f"|K|={size}: words {t_words:.2f} ms, head with words {t_head:.2f} ms, whole {t_all:.2f} ms "
            f"({t_all / plain:.3f}x the plain head), underflow rows {underflow}"
        )


if __name__ == "__main__":
    main()
