"""Gemma, Gemma 2, Gemma 3 (text) and Qwen3: inspection of their configs, against the model that
transformers instantiates from the same config (on the meta device: no memory, exact counts)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
import transformers

from engine.hooks import family_of, norm_weight_offset
from engine.inspection import describe
from engine.testing.tiny_models import build_config, default_tokenizer, model_class

NEW_FAMILIES = ("qwen3", "gemma", "gemma2", "gemma3_text")

# Gemma 3 270M's geometry (its config.json, as converted from the GGUF release).
GEMMA3_270M = {
    "vocab_size": 262_144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 32_768,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "layer_types": ["full_attention" if (layer + 1) % 6 == 0 else "sliding_attention" for layer in range(18)],
}


def _on_meta(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _saved_shapes(model) -> dict[str, tuple[list[int], str]]:
    """The tensors save_pretrained writes: every parameter once (a tied head is not stored)."""
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {
        name: (list(parameter.shape), "F32")
        for name, parameter in model.state_dict().items()
        if not (tied and name == "lm_head.weight") and name in dict(model.named_parameters())
    }


def _buffer_bytes(model) -> int:
    return sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())


def _describe(config_dict, model):
    return describe(config_dict, _saved_shapes(model), ["config.json", "model.safetensors"])


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_describe_matches_the_instantiated_model(family):
    config = build_config(family, tokenizer=default_tokenizer(family))
    model = _on_meta(config)
    as_saved = config.to_dict()

    info = _describe(as_saved, model)

    assert (info.family, info.model_type, info.architecture) == (family, family, model_class(family).__name__)
    assert (info.hidden_size, info.num_layers) == (config.hidden_size, config.num_hidden_layers)
    assert (info.vocab_size, info.context_length) == (config.vocab_size, config.max_position_embeddings)
    assert info.parameter_count == model.num_parameters()
    assert info.buffer_bytes == _buffer_bytes(model)
    assert not info.is_encoder


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_configs_tie_the_head_unless_they_say_otherwise(family):
    config = build_config(family, tokenizer=default_tokenizer(family))
    model = _on_meta(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    silent = {key: value for key, value in config.to_dict().items() if key != "tie_word_embeddings"}
    # A checkpoint that stores the tied head anyway still counts it once.
    shapes = {**_saved_shapes(model), "lm_head.weight": ([config.vocab_size, config.hidden_size], "F32")}

    info = describe(silent, shapes, ["config.json", "model.safetensors"])

    assert info.parameter_count == model.num_parameters()


def test_describe_gemma3_270m_geometry():
    config = transformers.Gemma3TextConfig(**GEMMA3_270M)
    model = _on_meta(config)

    info = _describe(config.to_dict(), model)

    assert (info.hidden_size, info.num_layers, info.context_length) == (640, 18, 32_768)
    assert info.parameter_count == model.num_parameters() == 268_098_176
    assert info.buffer_bytes == _buffer_bytes(model)  # two rotary tables: sliding and full attention
    assert family_of(model) == "gemma3_text" and norm_weight_offset(model) == 1.0
