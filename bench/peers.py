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


def _transformer_lens_config(config, HookedTransformerConfig):
    """The HookedTransformerConfig of a GPT-2 or Llama transformers config: the fields
    TransformerLens's own convert_hf_model_config fills for GPT2LMHeadModel and LlamaForCausalLM."""
    if config.model_type == "gpt2":
        return HookedTransformerConfig(
            d_model=config.n_embd,
            d_head=config.n_embd // config.n_head,
            n_heads=config.n_head,
            d_mlp=config.n_inner or config.n_embd * 4,
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
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return HookedTransformerConfig(
        d_model=config.hidden_size,
        d_head=head_dim,
        n_heads=config.num_attention_heads,
        d_mlp=config.intermediate_size,
        n_layers=config.num_hidden_layers,
        n_ctx=config.max_position_embeddings,
        eps=config.rms_norm_eps,
        d_vocab=config.vocab_size,
        act_fn=config.hidden_act,
        n_key_value_heads=config.num_key_value_heads,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=head_dim,
        rotary_base=config.rope_parameters["rope_theta"],
        final_rms=True,
        gated_mlp=True,
        original_architecture="LlamaForCausalLM",
        default_prepend_bos=False,
        device="cpu",
    )


def _converted_weights(hf_model, cfg):
    if hf_model.config.model_type == "gpt2":
        from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

        return convert_gpt2_weights(hf_model, cfg)
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    return convert_llama_weights(hf_model, cfg)


def load_transformer_lens(folder: Path, *, tokenizer: bool = True, model_class=None):
    """A HookedTransformer (or ``model_class``, a subclass) with the folder's GPT-2 or Llama
    weights, processed as ``from_pretrained_no_processing`` (activations equal the Hugging Face
    model's). Without ``tokenizer`` it has none: a caller that passes token ids needs none, and
    transformers 4 cannot load the tokenizer_config.json that transformers 5 writes."""
    stand_in_for_datasets()
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    cfg = _transformer_lens_config(hf_model.config, HookedTransformerConfig)
    model = (model_class or HookedTransformer)(
        cfg, tokenizer=AutoTokenizer.from_pretrained(folder) if tokenizer else None
    )
    model.load_and_process_state_dict(
        _converted_weights(hf_model, cfg), fold_ln=False, center_writing_weights=False, center_unembed=False
    )
    return model.eval()


def load_circuit_tracer_clt(model_folder: Path, clt_folder: Path):
    """circuit-tracer's TransformerLens replacement model of the folder's GPT-2 or Llama, with the
    cross-layer transcoder in ``clt_folder`` (what engine.sae.clt.save_clt writes), read by its own
    ``load_clt``: features read each MLP's input and write into its output and every later one's."""
    import torch

    import_circuit_tracer()
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from circuit_tracer.transcoder.cross_layer_transcoder import load_clt

    clt = load_clt(
        str(clt_folder), feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out",
        scan="mistudio", device=torch.device("cpu"), dtype=torch.float32, lazy_decoder=False,
    )  # fmt: skip
    model = load_transformer_lens(model_folder, model_class=TransformerLensReplacementModel)
    model._configure_replacement_model(clt)
    return model


def import_circuit_tracer():
    """circuit_tracer, imported in the benchmark environment. circuit-tracer 0.5 pins
    huggingface-hub < 1 and transformers <= 4.57 (bench/requirements-circuits.txt installs it
    without them); of hub 1.x it only misses the constant HF_HUB_ENABLE_HF_TRANSFER, read when its
    hub helpers are imported (they download from the Hub, which the benchmarks never do)."""
    import huggingface_hub.constants

    if not hasattr(huggingface_hub.constants, "HF_HUB_ENABLE_HF_TRANSFER"):
        huggingface_hub.constants.HF_HUB_ENABLE_HF_TRANSFER = False
    stand_in_for_datasets()
    import circuit_tracer

    return circuit_tracer


def load_circuit_tracer(model_folder: Path, transcoder_folder: Path, *, n_layers: int):
    """circuit-tracer's TransformerLens replacement model of the folder's GPT-2 or Llama, with the
    per-layer transcoders ``layer_{i}.safetensors`` of ``transcoder_folder`` (what
    engine.sae.formats.save_circuit_tracer writes), reading each MLP's input and writing its output."""
    import torch

    import_circuit_tracer()
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set

    transcoders = load_transcoder_set(
        {layer: str(Path(transcoder_folder) / f"layer_{layer}.safetensors") for layer in range(n_layers)},
        scan="mistudio",
        feature_input_hook="mlp.hook_in",
        feature_output_hook="mlp.hook_out",
        device=torch.device("cpu"),
        lazy_encoder=False,
        lazy_decoder=False,
    )
    # Weights first, then the replacement (from_pretrained_and_transcoders' order): its MLP
    # wrappers rename the parameters the weight conversion writes.
    model = load_transformer_lens(model_folder, model_class=TransformerLensReplacementModel)
    model._configure_replacement_model(transcoders)
    return model
