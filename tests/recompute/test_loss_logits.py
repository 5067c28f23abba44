"""`recompute.loss_logits`: pgdiag's own forward pass gives, at each listed position, the logits of transformers'
LlamaForCausalLM (the reference, run on the CPU in fp32) and the logit of the token there."""

from __future__ import annotations

import numpy as np
import torch
from hf_tiny import save_tiny_llama

from pgdiag.recompute.loss_logits import loss_logits

VOCAB = 61


def test_logits_at_positions_match_transformers(tmp_path) -> None:
    reference = save_tiny_llama(tmp_path / "ckpt", seed=1, vocab_size=VOCAB, max_position_embeddings=64)
    rng = np.random.default_rng(5)
    input_ids = [rng.integers(0, VOCAB, size=n) for n in (9, 14)]
    positions = [np.array([1, 4, 8]), np.array([13, 2, 7, 7])]  # any order, repeats allowed
    got = loss_logits(tmp_path / "ckpt", input_ids, positions)
    assert got.logits.shape == (7, VOCAB) and got.target.shape == (7,)
    assert got.logits.dtype == np.float64
    want_rows, want_target = [], []
    for ids, pos in zip(input_ids, positions, strict=True):
        with torch.no_grad():
            logits = (
                reference(torch.as_tensor(ids)[None]).logits[0].double().numpy()
            )  # (T, V): row p predicts p + 1
        want_rows.append(logits[pos - 1])
        want_target.append(logits[pos - 1, ids[pos]])
    np.testing.assert_allclose(got.logits, np.concatenate(want_rows), rtol=0, atol=2e-5)
    np.testing.assert_allclose(got.target, np.concatenate(want_target), rtol=0, atol=2e-5)
    # the target is the row's entry at the token actually there
    tokens = np.concatenate([ids[pos] for ids, pos in zip(input_ids, positions, strict=True)])
    np.testing.assert_array_equal(got.target, got.logits[np.arange(7), tokens])


def test_no_samples_gives_empty_logits(tmp_path) -> None:
    save_tiny_llama(tmp_path / "ckpt", seed=1, vocab_size=VOCAB, max_position_embeddings=64)
    got = loss_logits(tmp_path / "ckpt", [], [])
    assert got.target.shape == (0,) and got.logits.shape == (0, 1)
