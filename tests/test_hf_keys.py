"""The names an HF export is held against are those of the model class its config builds,
computed once per (architecture, config): every export of a run asks again."""

from __future__ import annotations

from transformers import Qwen2Config

from areal_ckpt.formats import hf_keys


def _config(layers: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip


def test_names_are_built_once_per_config_and_follow_a_changed_config(monkeypatch):
    built = []
    build = hf_keys._built_names
    monkeypatch.setattr(hf_keys, "_built_names", lambda cls, config: built.append(cls) or build(cls, config))
    monkeypatch.setattr(hf_keys, "_LOADABLE", {})
    two, tied = hf_keys.loadable_names(_config(2), "Qwen2ForCausalLM")
    assert hf_keys.loadable_names(_config(2), "Qwen2ForCausalLM") == (two, tied) and len(built) == 1
    assert "model.layers.1.mlp.up_proj.weight" in two and "lm_head.weight" in tied
    three, _ = hf_keys.loadable_names(_config(3), "Qwen2ForCausalLM")
    assert three - two == {name.replace("layers.1.", "layers.2.") for name in two if "layers.1." in name}
    assert len(built) == 2
    two.add("changed by the caller")  # a caller's set is its own: the remembered names stay
    assert "changed by the caller" not in hf_keys.loadable_names(_config(2), "Qwen2ForCausalLM")[0]
