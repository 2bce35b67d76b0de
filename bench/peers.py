"""The peers' side of the benchmarks: a TransformerLens GPT-2 built from a local folder (no Hub)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def stand_in_for_datasets() -> None:
    """Empty ``datasets`` modules where that package is not installed, so TransformerLens imports.

    TransformerLens imports ``datasets`` when it is imported, for its dataset helpers
    (``tokenize_and_concatenate``, the evals' ``load_dataset``), which the benchmarks never call;
    ``datasets`` needs pyarrow, a 55 MB wheel that the GPU machine's wheel folder leaves out
    (.gpu-wheels/README.txt). The stand-ins hold what TransformerLens names; calling
    ``load_dataset`` says what is missing. Nothing changes where ``datasets`` is installed."""
    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        return

    class Dataset:
        pass

    class IterableDataset:
        pass

    def load_dataset(*args, **kwargs):
        raise ImportError("datasets is not installed (bench/peers.py put a stand-in in its place)")

    contents = {
        "datasets": {"Dataset": Dataset, "IterableDataset": IterableDataset, "load_dataset": load_dataset},
        "datasets.arrow_dataset": {"Dataset": Dataset},
        "datasets.iterable_dataset": {"IterableDataset": IterableDataset},
        "datasets.load": {"load_dataset": load_dataset},
    }
    for name, names in contents.items():
        module = types.ModuleType(name, "A stand-in: datasets is not installed (bench/peers.py).")
        module.__dict__.update(names)
        sys.modules[name] = module


def load_transformer_lens(folder: Path, *, tokenizer: bool = True):
    """A HookedTransformer with the folder's GPT-2 weights, processed as
    ``from_pretrained_no_processing`` (activations equal the Hugging Face model's). Without
    ``tokenizer`` it has none: a caller that passes token ids needs none, and transformers 4
    cannot load the tokenizer_config.json that transformers 5 writes."""
    stand_in_for_datasets()
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
