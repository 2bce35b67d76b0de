"""Loading a transformers model onto a device, optionally quantized with bitsandbytes.

Importable without Django. Safety defaults are not negotiable here: safetensors only and no
remote code, whatever the model's files ask for.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENCODER_MODEL_TYPES = {"bert"}


@dataclass
class LoadedWeights:
    model: Any
    tokenizer: Any
    memory_usage_bytes: int
    parameter_count: int


def torch_dtype_for(quantization: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(quantization, torch.float32)


def quantization_config_for(quantization: str):
    if quantization not in {"int8", "int4"}:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )


def load_weights(folder: Path, *, model_type: str, quantization: str, device: str) -> LoadedWeights:
    """Load the model and tokenizer in ``folder`` onto ``device`` in eval mode."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    model_class = AutoModel if model_type in ENCODER_MODEL_TYPES else AutoModelForCausalLM
    quantization_config = quantization_config_for(quantization)
    kwargs: dict[str, Any] = {
        "use_safetensors": True,
        "trust_remote_code": False,
        "dtype": torch_dtype_for(quantization),
    }
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        kwargs["device_map"] = {"": device}
    model = model_class.from_pretrained(str(folder), **kwargs)
    if quantization_config is None:
        model = model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    with torch.no_grad():
        parameter_count = sum(parameter.numel() for parameter in model.parameters())
    return LoadedWeights(
        model=model,
        tokenizer=tokenizer,
        memory_usage_bytes=int(model.get_memory_footprint()),
        parameter_count=parameter_count,
    )


def warm_up(weights: LoadedWeights) -> None:
    """One tiny forward pass, so the first real request does not pay for lazy initialisation."""
    import torch

    device = next(weights.model.parameters()).device
    input_ids = torch.tensor([[weights.tokenizer.pad_token_id or 0]], device=device)
    with torch.no_grad():
        weights.model(input_ids=input_ids)
