"""Writes verl_rollout_corr.json: verl's own rollout-correction functions run on a fixed batch.

Why: the whatif rules `token_k1..seq_max_k3` (chained with '+') and `token_tis_bn` / `seq_tis_bn` replay verl's
`compute_rollout_rejection_mask` and `compute_rollout_correction_weights`; the test beside this script checks
pgdiag's masks and weights against verl's, computed by verl itself. How: verl 0.9.1 imports on a CPU once its
light dependencies are on the path (ray, omegaconf, codetiming and orjson are imported by `verl.protocol`
and verl's config classes, not used by these two functions). verl is not a pgdiag dependency (it is heavy and ships a
top-level ``tests`` package), so the fixture is stored and this script regenerates it:

    pip download --no-deps verl==0.9.1 && unzip verl-0.9.1-py3-none-any.whl -d /tmp/verl
    pip install --no-deps -t /tmp/verlsite ray msgpack jsonschema jsonschema-specifications attrs referencing \
        rpds-py omegaconf codetiming orjson
    PYTHONPATH=/tmp/verl:/tmp/verlsite python tests/analysis/own_code/make_verl_rollout_corr.py

The batch is float32, as verl holds log-probs, and plants values exactly on the thresholds in float32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import verl
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)

# (rollout_rs, rollout_rs_threshold) as verl's config takes them; pgdiag's rule spelling is in the test
REJECTIONS = [
    ("token_k1", "0.5_2.0"),
    ("token_k2", "0.02"),
    ("token_k3", "0.02"),
    ("seq_sum_k1", "0.5_2.0"),
    ("seq_sum_k2", "0.1"),
    ("seq_sum_k3", "0.1"),
    ("seq_mean_k1", "0.9_1.1"),
    ("seq_mean_k2", "0.01"),
    ("seq_mean_k3", "0.01"),
    ("seq_max_k2", "0.05"),
    ("seq_max_k3", "0.05"),
    ("token_k1,seq_max_k2", "0.5_2.0,0.05"),
    ("token_k2,seq_mean_k3,seq_sum_k1", "0.02,0.01,0.5_2.0"),
]
WEIGHTS = [
    ("token", "2.0"),
    ("sequence", "2.0"),
    ("token", "1.2"),
    ("sequence", "5.0"),
    ("token", "0.8_1.25"),
]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) float32 log ratios log π_old − log μ and the (B, T) response mask; row 5 is empty."""
    gen = torch.Generator().manual_seed(20261127)
    lengths = [12, 7, 1, 9, 12, 0, 4, 10]
    log_ratio = (torch.randn(len(lengths), 12, generator=gen) * 0.25).float()
    log_ratio[3, 2] = 25.0  # beyond the ±20 clamp
    log_ratio[4, 5] = -30.0
    log_ratio[1, 0] = -math.log(0.5)  # k1 = log 0.5 exactly (in float32)
    log_ratio[1, 1] = -math.log(2.0)
    log_ratio[6, 1] = math.sqrt(2 * 0.02)  # k2 on the threshold
    mask = torch.zeros_like(log_ratio)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1.0
    return log_ratio, mask


def main() -> None:
    log_ratio, mask = batch()
    out = {
        "verl_version": verl.__version__,
        "log_ratio": log_ratio.tolist(),
        "mask": mask.tolist(),
        "rejections": [],
        "weights": [],
    }
    for options, threshold in REJECTIONS:
        kept, _ = compute_rollout_rejection_mask(log_ratio, mask, options, threshold)
        out["rejections"].append({"rollout_rs": options, "threshold": threshold, "kept": kept.tolist()})
    for level, threshold in WEIGHTS:
        for normalize in (False, True) if "_" not in threshold else (False,):  # pgdiag has no IcePop + norm
            w, _ = compute_rollout_correction_weights(log_ratio, mask, level, threshold, normalize)
            out["weights"].append(
                {
                    "rollout_is": level,
                    "threshold": threshold,
                    "batch_normalize": normalize,
                    "weights": w.tolist(),
                }
            )
    path = Path(__file__).with_name("verl_rollout_corr.json")
    path.write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
