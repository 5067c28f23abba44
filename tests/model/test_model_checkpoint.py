"""Strict checkpoint loading: every bad checkpoint is one line with its spec code, never a traceback or a number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_tiny import save_hf_model
from safetensors.torch import load_file, save_file

from pgdiag.errors import PgdiagError, UsageError
from pgdiag.model import TensorSource, load_model, tp_layout
from pgdiag.model.config import read_model_config
from pgdiag.model.tp import shard_slice


def rewrite_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(path: Path, edit) -> None:
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))


def expect_error(path: Path, code: str, match: str) -> PgdiagError:
    with pytest.raises(UsageError) as info:
        load_model(path, dtype="fp32")
    err = info.value
    assert err.code == code, err
    assert match in err.message
    assert "\n" not in err.message and err.exit_code == 2
    return err


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    save_hf_model(tmp_path, "LlamaForCausalLM")
    return tmp_path


def test_missing_tensor(llama: Path) -> None:
    rewrite_tensors(llama, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    expect_error(llama, "E603", "tensor 'model.layers.1.mlp.up_proj.weight' is missing")


def test_wrong_shape(llama: Path) -> None:
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)

    rewrite_tensors(llama, edit)
    expect_error(
        llama, "E603", "'model.layers.0.self_attn.k_proj.weight' has shape [8, 32], config implies [16, 32]"
    )


def test_unexpected_tensor(llama: Path) -> None:
    def edit(t):
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)

    rewrite_tensors(llama, edit)
    expect_error(llama, "E603", "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'")


def test_rotary_inv_freq_is_ignored(llama: Path) -> None:
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    rewrite_tensors(llama, edit)
    assert load_model(llama, dtype="fp32").load_warnings == ()


def test_prefixed_names(llama: Path) -> None:
    rewrite_tensors(llama, lambda t: t.update({f"_orig_mod.{k}": t.pop(k) for k in list(t)}))
    err = expect_error(llama, "E603", "wrapper prefix ('_orig_mod.")
    assert "model_merger" in (err.hint or "")


def test_untied_without_lm_head(llama: Path) -> None:
    rewrite_tensors(llama, lambda t: t.pop("lm_head.weight"))
    expect_error(llama, "E603", "tie_word_embeddings is false but 'lm_head.weight' is missing")


def test_embedding_rows_differ_from_vocab(llama: Path) -> None:
    rewrite_config(llama, lambda c: c.update(vocab_size=256))
    expect_error(llama, "E608", "'model.embed_tokens.weight' has 251 rows but vocab_size is 256")


def test_unknown_architecture(llama: Path) -> None:
    rewrite_config(llama, lambda c: c.update(architectures=["DeepseekV3ForCausalLM"]))
    err = expect_error(llama, "E601", "unsupported architecture 'DeepseekV3ForCausalLM'")
    assert err.message.endswith(
        "supported: Llama, Mistral, Qwen2, Qwen3 (dense), Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss. "
        "pgdiag never runs checkpoint code."
    )


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps"])
def test_config_without_needed_field(llama: Path, field: str) -> None:
    rewrite_config(llama, lambda c: c.pop(field))
    expect_error(llama, "E606", f"field '{field}' is missing")


def test_unsupported_activation(llama: Path) -> None:
    rewrite_config(llama, lambda c: c.update(hidden_act="gelu"))
    expect_error(llama, "E606", "hidden_act 'gelu' is not supported")


def test_missing_files(tmp_path: Path) -> None:
    expect_error(tmp_path, "E604", "config.json not found")
    save_hf_model(tmp_path / "s", "LlamaForCausalLM", shard_kb=20)
    next((tmp_path / "s").glob("model-00002-*.safetensors")).unlink()
    expect_error(tmp_path / "s", "E604", "shard model-00002-of-")
    (tmp_path / "s" / "model.safetensors.index.json").unlink()
    expect_error(tmp_path / "s", "E604", "no model.safetensors")


def test_tp_size_that_does_not_divide(llama: Path) -> None:
    config = read_model_config(llama)
    with pytest.raises(UsageError) as info:
        tp_layout(config, 3, 0)
    assert info.value.code == "E605" and "num_attention_heads = 4" in info.value.message


def test_bad_dtype_name(llama: Path) -> None:
    with pytest.raises(UsageError) as info:
        load_model(llama, dtype="float8")
    assert info.value.code == "E607"


def test_tied_with_differing_lm_head_warns_and_uses_embedding(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "Qwen3ForCausalLM", tie_word_embeddings=True)

    def edit(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0

    rewrite_tensors(tmp_path, edit)
    model = load_model(tmp_path, dtype="fp32")
    assert [code for code, _ in model.load_warnings] == ["W606"]
    assert torch.equal(
        model.lm_head_weight, load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"]
    )


def test_pickle_checkpoint_is_refused_with_the_conversion(tmp_path: Path) -> None:
    # safe by default: a .bin is never unpickled (before: torch.load, and exit 101 on a legacy or garbage file)
    save_hf_model(tmp_path / "st", "LlamaForCausalLM")
    for name, content in (
        ("pytorch_model.bin", None),
        ("model.pt", b"garbage"),
        ("legacy.bin", b"PK\x03\x04"),
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
        if content is None:
            torch.save(load_file(tmp_path / "st" / "model.safetensors"), folder / name)
        else:
            (folder / name).write_bytes(content)
        with pytest.raises(UsageError) as caught:
            load_model(folder, dtype="fp32")
        assert caught.value.code == "E609"
        assert f"torch.load('{name}', weights_only=True)" in caught.value.hint


def test_damaged_safetensors_is_e610(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "LlamaForCausalLM")
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    for damaged in (data[: len(data) // 2], b"\xff" * 16, data[:4]):
        weights.write_bytes(damaged)
        with pytest.raises(UsageError) as caught:
            load_model(tmp_path, dtype="fp32")
        assert caught.value.code == "E610", caught.value


def test_rank_slices_concatenate_to_the_full_tensor(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "LlamaForCausalLM", num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                  intermediate_size=36)  # fmt: skip
    config = read_model_config(tmp_path)
    full = load_file(tmp_path / "model.safetensors")
    source = TensorSource(files=dict.fromkeys(full, tmp_path / "model.safetensors"))
    with source:
        for name, dim in (
            ("model.layers.0.self_attn.q_proj.weight", 0),
            ("model.layers.0.self_attn.k_proj.weight", 0),
            ("model.layers.1.self_attn.o_proj.weight", 1),
            ("model.layers.1.mlp.up_proj.weight", 0),
            ("model.layers.1.mlp.down_proj.weight", 1),
            ("lm_head.weight", 0),
        ):
            layouts = [tp_layout(config, 3, r) for r in range(3)]
            parts = [source.read(name, shard_slice(name, tuple(full[name].shape), lay)) for lay in layouts]
            assert torch.equal(torch.cat(parts, dim=dim), full[name]), name
        assert [lay.local_vocab_size for lay in layouts] == [84, 84, 83]  # 251 = 84 + 84 + 83
        assert [lay.vocab_start for lay in layouts] == [0, 84, 168]
        assert shard_slice("model.norm.weight", (48,), layouts[1]) is None


def test_integer_or_quantized_weights_are_refused(tmp_path: Path) -> None:
    # before: int8 weights were copied into the float parameters as numbers, a silently wrong model
    save_hf_model(tmp_path, "LlamaForCausalLM")
    name = "model.layers.1.mlp.up_proj.weight"
    for dtype, stored in ((torch.int8, "I8"), (torch.uint8, "U8"), (torch.int32, "I32")):
        rewrite_tensors(tmp_path, lambda t, dtype=dtype: t.update({name: t[name].round().to(dtype)}))
        caught = expect_error(tmp_path, "E611", name)
        assert f"stored as {stored}" in caught.message
    rewrite_tensors(tmp_path, lambda t: t.update({name: t[name].to(torch.float64)}))
    load_model(tmp_path, dtype="fp32")  # float64 weights are floats: read
