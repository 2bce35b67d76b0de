"""The peers' side of the benchmarks: a TransformerLens GPT-2 built from a local folder (no Hub)."""

from __future__ import annotations

from pathlib import Path


def load_transformer_lens(folder: Path, *, tokenizer: bool = True):
    """A HookedTransformer with the folder's GPT-2 weights, processed as
    ``from_pretrained_no_processing`` (activations equal the Hugging Face model's). Without
    ``tokenizer`` it has none: a caller that passes token ids needs none, and transformers 4
    cannot load the tokenizer_config.json that transformers 5 writes."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = hf_model.config
    # The fields TransformerLens's own convert_hf_model_config fills for GPT2LMHeadModel.
    cfg = HookedTransformerConfig(
        d_model=config.n_embd,
        d_head=config.n_embd // config.n_head,
        n_heads=config.n_head,
        d_mlp=config.n_embd * 4,
        n_layers=config.n_layer,
        n_ctx=config.n_positions,
        eps=config.layer_norm_epsilon,
        d_vocab=config.vocab_size,
        act_fn=config.activation_function,
        normalization_type="LN",
        original_architecture="GPT2LMHeadModel",
        default_prepend_bos=False,
        device="cpu",
    )
    model = HookedTransformer(cfg, tokenizer=AutoTokenizer.from_pretrained(folder) if tokenizer else None)
    model.load_and_process_state_dict(
        convert_gpt2_weights(hf_model, cfg), fold_ln=False, center_writing_weights=False, center_unembed=False
    )
    return model.eval()
