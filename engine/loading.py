"""Loading a transformers model onto a device, optionally quantized with bitsandbytes.

Importable without Django, torch or transformers (they are imported inside the functions).
Safety defaults are not negotiable here: safetensors only and no remote code, whatever the
model's files ask for.

Quantization options (``inspection.QUANTIZATIONS``, plus ``fp4``):

* ``none``: float32, full precision;
* ``fp16`` / ``bf16``: every parameter in that dtype;
* ``int8``: bitsandbytes LLM.int8() Linear layers; ``int4``: bitsandbytes NF4 Linear layers;
  ``fp4``: bitsandbytes FP4. It runs on the CPU too, with the footprint of NF4 but 25-35 %
  more output error on the tiny test models, so it is loadable but not offered.

For int8/int4 bitsandbytes quantizes only the Linear (and GPT-2 Conv1D) weights; embeddings,
the output head, norms and biases are loaded in 16-bit instead of float32 (see
:func:`unquantized_dtype`). Without that, GPT-2's fp32 embeddings alone would keep int4 at
0.4x of the fp32 footprint instead of 0.24x.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.inspection import (
    BITSANDBYTES_UNSUPPORTED_FAMILIES,
    ENCODER_MODEL_TYPES,
    QUANTIZATIONS,
    SUPPORTED_MODEL_TYPES,
    confined_folder_entries,
    is_quantizable_weight,
)
from engine.placement import DISK, Placement, bytes_by_device, input_device

__all__ = [
    "ENCODER_MODEL_TYPES",
    "LOADABLE_QUANTIZATIONS",
    "STAGES",
    "LoadError",
    "LoadedWeights",
    "load_weights",
    "release",
    "warm_up",
]

LOADABLE_QUANTIZATIONS: tuple[str, ...] = (*QUANTIZATIONS, "fp4")
_FOUR_BIT = {"int4": "nf4", "fp4": "fp4"}
_BITSANDBYTES = frozenset({"int8", *_FOUR_BIT})
# Stages reported through ``on_stage`` (name, fraction of the stage done).
STAGES: tuple[str, ...] = ("weights", "place", "warm-up")
StageCallback = Callable[[str, float], None]


class LoadError(EngineError):
    """A load refused or failed for a reason worth a stable code (read by the load task)."""


@dataclass
class LoadedWeights:
    model: Any
    tokenizer: Any
    # ``model.get_memory_footprint()``: parameters and buffers as stored.
    memory_usage_bytes: int
    # ``model.num_parameters()``: the unquantized count, also for packed 4-bit weights.
    parameter_count: int
    quantization: str = "none"
    # The placement's device: cpu, cuda:N, or auto (split across devices and disk).
    device: str = "cpu"
    # Bytes on each device ("cpu", "cuda:0", "disk"): one entry unless the placement is split.
    bytes_by_device: dict[str, int] = field(default_factory=dict)
    # bitsandbytes Linear8bitLt / Linear4bit modules in the model (0 unless int8/int4/fp4).
    quantized_module_count: int = 0
    # Seconds per stage: "weights" (which includes "tokenizer"), "place", and "warm-up" once
    # warm_up ran.
    timings: dict[str, float] = field(default_factory=dict)


def _device_type(device: str) -> str:
    return device.split(":", 1)[0]


def unquantized_dtype(device: str):
    """The dtype of what bitsandbytes leaves unquantized, and its compute dtype.

    bf16 keeps float32's exponent range, so no activation or embedding can overflow where an
    fp32 model would not (fp16 overflows above 65504, which some bf16-trained models reach in
    their residual stream). Its coarser mantissa costs far less than int8/int4 weights do: on
    the tiny test models, bf16 alone is 0.6 % relative error against 1-2 % for int8 and 8-14 %
    for int4. It is native on recent x86 CPUs (AVX512-BF16, AMX) and on GPUs from Ampere on;
    fp16 is used only on a GPU without bf16 support, where bf16 would be emulated. (The int8
    matmul of bitsandbytes casts its input to fp16 to quantize it in either case; Linear
    inputs beyond 65504 are vanishingly rare.)
    """
    import torch

    if _device_type(device) == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def torch_dtype_for(quantization: str, device: str = "cpu"):
    """The dtype ``from_pretrained`` loads the (non-quantized) parameters in."""
    import torch

    if quantization == "fp16":
        return torch.float16
    if quantization == "bf16":
        return torch.bfloat16
    if quantization in _BITSANDBYTES:
        return unquantized_dtype(device)
    return torch.float32


def quantization_config_for(quantization: str, device: str = "cpu", *, split: bool = False):
    """The ``BitsAndBytesConfig`` for ``quantization``, or None when it is not a bitsandbytes one.

    ``split``: the model may be spread over devices; layers placed on the CPU or disk then stay
    unquantized in the compute dtype (bitsandbytes' "fp32 CPU offload", which transformers
    requires for any split quantized load).
    """
    if quantization not in _BITSANDBYTES:
        return None
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=split)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=_FOUR_BIT[quantization],
        bnb_4bit_compute_dtype=unquantized_dtype(device),
        llm_int8_enable_fp32_cpu_offload=split,
    )


class _DropInt8CastWarning(logging.Filter):
    """bitsandbytes logs this for every int8 matmul whose input is not fp16, i.e. every layer
    of every forward pass of a bf16 model: a flood in the worker's log that says nothing new."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


@functools.cache
def _silence_int8_cast_warning() -> None:
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DropInt8CastWarning())


@functools.cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return None


def _return_free_heap_to_os() -> None:
    """Hand glibc's freed-but-kept heap pages back to the OS, so RSS shows what is in use.

    Loading leaves large temporaries behind (the fp32 tensors read before quantization,
    conversion buffers); glibc keeps freed blocks in its heap, which for int8 GPT-2 small is
    ~1.5x the model's own footprint. The worker checks free system memory before each load,
    so this memory must really be returned. Cheap (about 20 ms).
    """
    trim = _libc_malloc_trim()
    if trim is not None:
        trim(0)


def _check_request(model_type: str, quantization: str) -> None:
    if quantization not in LOADABLE_QUANTIZATIONS:
        raise LoadError(
            "UNSUPPORTED_QUANTIZATION",
            f"Unknown quantization {quantization!r}; expected one of {', '.join(LOADABLE_QUANTIZATIONS)}.",
        )
    family = SUPPORTED_MODEL_TYPES.get(model_type)
    if family in BITSANDBYTES_UNSUPPORTED_FAMILIES and quantization in _BITSANDBYTES:
        raise LoadError(
            "UNSUPPORTED_QUANTIZATION",
            f"bitsandbytes cannot quantize {model_type} models here (transformers only swaps plain "
            "nn.Linear layers); load it in bf16 or fp16 instead.",
            {"model_type": model_type, "quantization": quantization},
        )


def _count_quantized_modules(model: Any) -> int:
    import bitsandbytes

    kinds = (bitsandbytes.nn.Linear8bitLt, bitsandbytes.nn.Linear4bit)
    return sum(isinstance(module, kinds) for module in model.modules())


def quantized_device_map(
    model_class: Any, folder: Path, quantization: str, max_memory: dict | None, compute_dtype: Any
) -> dict[str, Any]:
    """Where each module of an int8/int4 model goes when it is split: the GPUs first, up to their
    budgets, then the CPU, then the disk, in module order.

    Computed here, as an explicit map, rather than by transformers' ``device_map="auto"``, which
    sizes every module at the quantized width (embeddings, norms and the head included) and so
    put a whole model on the GPU that its budget could not hold, without a device map. Here the
    Linear weights bitsandbytes quantizes count at 1 byte (int8) or half a byte (int4), and
    everything else in the compute dtype, as :func:`engine.inspection.memory_estimates` counts
    them. An explicit map also lets bitsandbytes keep the modules placed on the CPU or disk
    unquantized (its fp32 CPU offload), in the compute dtype.
    """
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import CustomDtype, infer_auto_device_map
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    with init_empty_weights():
        skeleton = model_class.from_config(config, trust_remote_code=False)
    unquantized = {
        name: compute_dtype
        for name, parameter in skeleton.named_parameters()
        if not is_quantizable_weight(name, list(parameter.shape))
    }
    return infer_auto_device_map(
        skeleton,
        max_memory=max_memory,
        no_split_module_classes=list(getattr(skeleton, "_no_split_modules", None) or []),
        dtype=torch.int8 if quantization == "int8" else CustomDtype.INT4,
        special_dtypes=unquantized,
    )


def load_weights(
    folder: Path,
    *,
    model_type: str,
    quantization: str,
    device: str | Placement,
    on_stage: StageCallback | None = None,
    roots: Sequence[Path | str] | None = None,
    free_memory: dict[str, int] | None = None,
) -> LoadedWeights:
    """Load the model and tokenizer in ``folder`` onto ``device`` in eval mode.

    ``device`` is a device name or a :class:`~engine.placement.Placement`; with ``auto`` the
    model is split over the placement's devices up to their budgets (lowered to ``free_memory``,
    bytes free per device now) and the rest is offloaded to disk.

    transformers follows links in the folder, so every entry of it must lie, links resolved,
    inside ``roots`` (default: the folder itself; a Hugging Face cache's snapshot links to its
    blobs, so its callers pass the cache): else ``UNSAFE_PATH``, before anything is read.

    The weights are read straight onto ``device`` (``device_map``), never staged on the CPU
    and then copied. ``on_stage(name, fraction)`` is called at the start (0.0) and end (1.0)
    of the "weights" and "place" stages; an exception it raises (e.g. a cancellation) aborts
    the load and nothing stays in memory. Raises :class:`LoadError` for a quantization the
    model cannot have, so a request never silently gives an unquantized model.
    """
    report = on_stage or (lambda name, fraction: None)
    _check_request(model_type, quantization)
    confined_folder_entries(folder, roots)
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    timings: dict[str, float] = {}
    started = time.perf_counter()
    report("weights", 0.0)
    model_class = AutoModel if model_type in ENCODER_MODEL_TYPES else AutoModelForCausalLM
    placement = device if isinstance(device, Placement) else Placement(device=device)
    compute_device = placement.compute_device
    if placement.split and quantization in _BITSANDBYTES and _device_type(compute_device) != "cuda":
        # bitsandbytes quantizes only what sits on a GPU: a split load without one fails inside it.
        raise LoadError(
            "UNSUPPORTED_QUANTIZATION",
            f"A {quantization} model can be split across devices only with a GPU among them; load it "
            "in bf16 or fp16 on this worker, or on one device.",
            {"quantization": quantization, "device": placement.device},
        )
    quantization_config = quantization_config_for(quantization, compute_device, split=placement.split)
    kwargs: dict[str, Any] = {
        "use_safetensors": True,
        "trust_remote_code": False,
        "dtype": torch_dtype_for(quantization, compute_device),
        **placement.from_pretrained_arguments(free=free_memory),
    }
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        if quantization == "int8":
            _silence_int8_cast_warning()
        if placement.split:
            kwargs["device_map"] = quantized_device_map(
                model_class, folder, quantization, kwargs.get("max_memory"), kwargs["dtype"]
            )
    model = model_class.from_pretrained(str(folder), **kwargs)
    loaded = None
    try:
        tokenizer_started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        timings["tokenizer"] = time.perf_counter() - tokenizer_started
        timings["weights"] = time.perf_counter() - started
        report("weights", 1.0)

        started = time.perf_counter()
        report("place", 0.0)
        model.eval()
        quantized_modules = _count_quantized_modules(model) if quantization_config is not None else 0
        if quantization_config is not None and quantized_modules == 0:
            raise LoadError(
                "UNSUPPORTED_QUANTIZATION",
                f"bitsandbytes left every layer of this {model_type} model unquantized.",
                {"model_type": model_type, "quantization": quantization},
            )
        _return_free_heap_to_os()
        placed = bytes_by_device(model)
        loaded = LoadedWeights(
            model=model,
            tokenizer=tokenizer,
            # What the model holds in memory: a split model's disk part is read per forward.
            memory_usage_bytes=(
                sum(size for name, size in placed.items() if name != DISK)
                if placement.split
                else int(model.get_memory_footprint())
            ),
            parameter_count=int(model.num_parameters()),
            quantization=quantization,
            device=placement.device,
            bytes_by_device=placed,
            quantized_module_count=quantized_modules,
            timings=timings,
        )
        timings["place"] = time.perf_counter() - started
        report("place", 1.0)
    except BaseException:
        # Nothing of a failed or cancelled load may stay in memory.
        model = loaded = None
        _free_memory(on_cuda=_device_type(compute_device) == "cuda")
        raise
    return loaded


def _warm_up_token_id(tokenizer: Any) -> int:
    for token_id in (
        getattr(tokenizer, "bos_token_id", None),
        getattr(tokenizer, "cls_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(tokenizer, "pad_token_id", None),
    ):
        if token_id is not None:
            return int(token_id)
    return 0


def warm_up(weights: LoadedWeights, *, on_stage: StageCallback | None = None) -> None:
    """One single-token forward pass, so the first real request does not pay for lazy set-up.

    It touches every layer once: the pages of memory-mapped float32 weights are read in,
    and on a CPU with AVX512-BF16 bitsandbytes repacks every 4-bit weight into its CPU layout
    on the first call (0.1 s for GPT-2 small, far more for a 7B model). No KV cache is built.
    """
    import torch

    report = on_stage or (lambda name, fraction: None)
    started = time.perf_counter()
    report("warm-up", 0.0)
    model = weights.model
    input_ids = torch.tensor([[_warm_up_token_id(weights.tokenizer)]], device=input_device(model))
    arguments: dict[str, Any] = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if model.config.model_type not in ENCODER_MODEL_TYPES:
        arguments["use_cache"] = False
    # no_grad rather than inference_mode: state a layer caches on its first call (such as
    # bitsandbytes' repacked 4-bit weights) must not become inference tensors, which
    # autograd refuses in later gradient-based analyses.
    with torch.no_grad():
        model(**arguments)
    weights.timings["warm-up"] = time.perf_counter() - started
    report("warm-up", 1.0)


def release(holder: Any) -> None:
    """Drop the model and tokenizer ``holder`` keeps and give their memory back.

    ``holder`` is anything with ``model`` / ``tokenizer`` attributes (``LoadedWeights``, the
    worker registry's entry). The attributes are set to None; the memory is really freed once
    no other reference remains (a caller must not keep ``holder.model`` in a variable).
    Then: a full garbage collection (transformers models hold reference cycles), the CUDA
    caching allocator's free blocks back to the driver, and glibc's free heap back to the OS.
    """
    model = getattr(holder, "model", None)
    on_cuda = model is not None and any(parameter.is_cuda for parameter in model.parameters())
    del model
    for name in ("model", "tokenizer"):
        if getattr(holder, name, None) is not None:
            setattr(holder, name, None)
    _free_memory(on_cuda=on_cuda)


def _free_memory(*, on_cuda: bool) -> None:
    gc.collect()
    if on_cuda:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    _return_free_heap_to_os()
