"""The supported model families: how each config spells its geometry, default class and tied head."""

from __future__ import annotations

# HF config ``model_type`` -> architecture family (ARCHITECTURE.md). Llama, Mistral, Qwen2, Qwen3
# and Gemma share one module layout but stay separate families, as they are separate model types;
# Gemma 2 and Gemma 3's text model add norms after each sub-layer.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "gpt2": "gpt2",
    "gpt_neo": "gpt_neo",
    "gptj": "gptj",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
    "gpt_neox": "gpt_neox",
    "falcon": "falcon",
    "bloom": "bloom",
    "bert": "bert",
}
ENCODER_MODEL_TYPES: frozenset[str] = frozenset({"bert"})

# Per family: config keys for hidden size, layer count and context length, first match wins
# (legacy spellings included); the model class Auto* gives when "architectures" is missing;
# whether the output head is tied to the input embedding when the config does not say.
_HIDDEN_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_embd", "hidden_size"),
    "gptj": ("n_embd", "hidden_size"),
    "bloom": ("hidden_size", "n_embed"),
}
_LAYER_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_layer", "num_hidden_layers"),
    "gpt_neo": ("num_layers", "num_hidden_layers"),
    "gptj": ("n_layer", "num_hidden_layers"),
    "falcon": ("num_hidden_layers", "n_layer"),
    "bloom": ("n_layer", "num_hidden_layers"),
}
_CONTEXT_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_positions", "n_ctx", "max_position_embeddings"),
    "gptj": ("n_positions", "max_position_embeddings"),
    # BLOOM uses ALiBi and has no position limit of its own; some configs record the
    # training length as seq_length.
    "bloom": ("seq_length",),
}
_HEAD_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("n_head", "num_attention_heads"),
    "gptj": ("n_head", "num_attention_heads"),
    "gpt_neo": ("num_heads", "num_attention_heads"),
}
DEFAULT_ARCHITECTURES: dict[str, str] = {
    "gpt2": "GPT2LMHeadModel",
    "gpt_neo": "GPTNeoForCausalLM",
    "gptj": "GPTJForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "falcon": "FalconForCausalLM",
    "bloom": "BloomForCausalLM",
    "bert": "BertModel",
}
_TIED_BY_DEFAULT: dict[str, bool] = {
    "gpt2": True,
    "gpt_neo": True,
    "gptj": False,
    "llama": False,
    "mistral": False,
    "qwen2": False,
    "qwen3": False,
    "gemma": True,
    "gemma2": True,
    "gemma3_text": True,
    "gpt_neox": False,
    "falcon": True,
    "bloom": True,
    "bert": True,
}

# Rotary families: how their rotary tables are laid out. Each table registers inv_freq and
# original_inv_freq (float32, head_dim / 2 each); Gemma 3 keeps one table per attention kind
# in config.layer_types (sliding and full attention use different bases).
ROTARY_FAMILIES: frozenset[str] = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gpt_neox", "falcon", "gemma", "gemma2", "gemma3_text"}
)
ROTARY_TABLE_PER_LAYER_TYPE: frozenset[str] = frozenset({"gemma3_text"})
# Families whose embedding multiplies by sqrt(hidden_size), kept as a float32 scalar buffer.
SCALED_EMBEDDING_FAMILIES: frozenset[str] = frozenset({"gemma", "gemma2", "gemma3_text"})
