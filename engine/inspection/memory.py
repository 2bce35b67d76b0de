"""The quantization options a model can be loaded with, and the memory each one takes."""

from __future__ import annotations

from engine.inspection.description import ModelInfo

QUANTIZATIONS: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "int4")
BITSANDBYTES_QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")

# transformers 5 swaps in bitsandbytes layers only for modules whose type is exactly
# ``nn.Linear`` (or GPT-2's ``Conv1D``). Falcon's layers are ``FalconLinear``, a subclass, so
# an int8/int4 load of Falcon would silently give an unquantized bf16 model: not offered.
BITSANDBYTES_UNSUPPORTED_FAMILIES: frozenset[str] = frozenset({"falcon"})
# Device types bitsandbytes 0.50 runs int8 / nf4 on (no MPS backend).
BITSANDBYTES_DEVICE_TYPES: frozenset[str] = frozenset({"cpu", "cuda", "xpu"})


def memory_estimates(info: ModelInfo, *, device: str = "cpu") -> dict[str, int]:
    """Predicted ``model.get_memory_footprint()`` in bytes after ``load_weights`` per option.

    Mirrors loading.py: ``none`` is float32; ``fp16``/``bf16`` are 2 bytes per parameter; for
    ``int8``/``int4`` bitsandbytes stores the Linear weights in 1 byte / half a byte per
    element and everything else (embeddings, output head, norms, biases) stays in 16-bit
    (bf16). Buffers keep their own dtype. Like ``get_memory_footprint()``, the quantization
    constants (per-row scales for int8, one float32 absmax per 64 weights for nf4, about 12 %
    on top of the 4-bit weights) are not counted. Only applicable options are listed.
    """
    parameters = info.parameter_count
    quantizable = info.quantizable_parameter_count
    rest = parameters - quantizable
    estimates = {
        "none": parameters * 4,
        "fp16": parameters * 2,
        "bf16": parameters * 2,
        "int8": quantizable + rest * 2,
        "int4": (quantizable + 1) // 2 + rest * 2,
    }
    options = applicable_quantizations(info, device=device)
    return {option: estimates[option] + info.buffer_bytes for option in options}


def applicable_quantizations(info: ModelInfo, *, device: str = "cpu") -> list[str]:
    """The options of :data:`QUANTIZATIONS` that ``load_weights`` can honour for ``info`` on ``device``.

    Half precision works everywhere torch runs. int8 and int4 (nf4) need a bitsandbytes
    backend for the device type and a family whose layers transformers can swap.
    """
    options = ["none", "fp16", "bf16"]
    device_type = device.split(":", 1)[0]
    if (
        device_type in BITSANDBYTES_DEVICE_TYPES
        and info.family not in BITSANDBYTES_UNSUPPORTED_FAMILIES
        and info.quantizable_parameter_count > 0
    ):
        options.extend(BITSANDBYTES_QUANTIZATIONS)
    return options
