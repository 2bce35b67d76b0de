"""Where a model's weights live: one device, or split across devices (and disk) by accelerate.

A worker runs on one device (``cpu``, ``cuda:N``) or on ``auto``: transformers' ``device_map="auto"``
fills each device up to its ``max_memory`` budget in module order (GPUs first, then the CPU) and
puts what is left on disk (``offload_folder``; safetensors weights are read in place from the
model's own files, not copied). A split model runs its layers where they sit: accelerate's hooks
move each layer's input to the layer's device, and an offloaded layer's weights are read in for
its forward and dropped after it.

This module is what the rest of the engine needs to know about that: the worker's options
(:class:`Placement`, :func:`parse_max_memory`), the device a model's inputs go to
(:func:`input_device`) or a module computes on (:func:`execution_device`), and how many bytes
of a loaded model sit on each device (:func:`bytes_by_device`). Importable without torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError

__all__ = [
    "AUTO",
    "DISK",
    "Placement",
    "PlacementError",
    "bytes_by_device",
    "execution_device",
    "format_size",
    "input_device",
    "parse_device",
    "parse_max_memory",
    "parse_size",
]

AUTO = "auto"
DISK = "disk"
_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class PlacementError(EngineError):
    """A device or memory option that cannot be used (code ``INVALID_PLACEMENT``)."""

    def __init__(self, message: str, details: dict | None = None) -> None:
        super().__init__("INVALID_PLACEMENT", message, details or {})


def parse_device(text: str) -> str:
    """``cpu``, ``cuda:N`` or ``auto`` (split across devices); anything else is refused."""
    value = text.strip().lower()
    if value == AUTO or _DEVICE.match(value):
        return value
    raise PlacementError(f"The device must be cpu, cuda:N or auto (got {text!r}).", {"device": text})


def parse_size(text: str) -> int:
    """Bytes in ``20GiB``, ``512MB``, ``1.5 TiB`` or a plain number of bytes (GiB = 2**30, GB = 10**9)."""
    match = _SIZE.match(text)
    if match is None:
        raise PlacementError(f"Cannot read {text!r} as a size (e.g. 20GiB, 512MiB, 64GB).", {"size": text})
    number, unit = match.groups()
    size = int(float(number) * _UNITS[(unit or "b").lower()])
    if size <= 0:
        raise PlacementError(f"A memory budget must be positive (got {text!r}).", {"size": text})
    return size


def parse_max_memory(text: str) -> dict[str, int]:
    """``cuda:0=20GiB,cpu=64GiB`` as ``{"cuda:0": 21474836480, "cpu": 68719476736}``."""
    budgets: dict[str, int] = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        device, separator, size = part.partition("=")
        if not separator:
            raise PlacementError(f"Expected device=size in {part!r} (e.g. cuda:0=20GiB,cpu=64GiB).")
        device = device.strip().lower()
        if not _DEVICE.match(device):
            raise PlacementError(f"A memory budget names cpu or cuda:N (got {device!r}).", {"device": device})
        if device in budgets:
            raise PlacementError(f"{device} has two memory budgets.", {"device": device})
        budgets[device] = parse_size(size)
    if not budgets:
        raise PlacementError("--max-memory names no device (e.g. cuda:0=20GiB,cpu=64GiB).")
    return budgets


def format_size(size: int) -> str:
    """``21474836480`` as ``20GiB``: the inverse of :func:`parse_size` for whole MiB."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


@dataclass(frozen=True)
class Placement:
    """A worker's placement: ``device`` (cpu, cuda:N or auto) and, for auto, the per-device
    budgets (``max_memory``, bytes; empty: what each device has free) and the disk folder for
    what fits nowhere."""

    device: str = "cpu"
    max_memory: Mapping[str, int] = field(default_factory=dict)
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        if self.max_memory and self.device != AUTO:
            raise PlacementError("--max-memory applies to --device auto only.", {"device": self.device})

    @property
    def split(self) -> bool:
        return self.device == AUTO

    @property
    def compute_device(self) -> str:
        """The device the worker's own tensors go to (SAE training, feature encoding): the
        placement's device, or for ``auto`` the first GPU it may use, else the CPU."""
        if not self.split:
            return self.device
        gpus = sorted(name for name in self.max_memory if name.startswith("cuda:"))
        if gpus:
            return gpus[0]
        if self.max_memory:
            return "cpu"
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"

    def memory_devices(self) -> list[str]:
        """The devices whose memory the placement may fill, GPUs first."""
        if not self.split:
            return [self.device]
        if self.max_memory:
            return sorted(self.max_memory, key=lambda name: (name == "cpu", name))
        import torch

        return [f"cuda:{index}" for index in range(torch.cuda.device_count())] + ["cpu"]

    def describe(self) -> str:
        """``auto (cuda:0=20GiB, cpu=64GiB, rest on disk)``, or the device."""
        if not self.split:
            return self.device
        budgets = ", ".join(f"{name}={format_size(size)}" for name, size in self.max_memory.items())
        return f"auto ({budgets + ', ' if budgets else ''}rest on disk)"

    def from_pretrained_arguments(self, *, free: Mapping[str, int] | None = None) -> dict[str, Any]:
        """``device_map`` / ``max_memory`` / ``offload_folder`` for ``from_pretrained``.

        ``free``: bytes free now per device; a budget above it is lowered to it, so a model loaded
        beside others spills to disk instead of failing with out-of-memory.
        """
        if not self.split:
            return {"device_map": {"": self.device}}
        budgets = dict(self.max_memory) if self.max_memory else dict(free or {})
        if free:
            budgets = {name: min(size, free.get(name, size)) for name, size in budgets.items()}
        arguments: dict[str, Any] = {"device_map": AUTO, "offload_folder": self.offload_folder}
        if budgets:
            # accelerate names GPUs by index.
            arguments["max_memory"] = {
                (int(name.split(":")[1]) if name.startswith("cuda:") else name): size
                for name, size in budgets.items()
            }
        return arguments


def execution_device(module: Any) -> Any:
    """The device ``module`` computes on: where accelerate's hook brings its weights for a split
    model (an offloaded module's own weights sit on the ``meta`` device), else its parameters'."""
    import torch

    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def input_device(model: Any) -> Any:
    """The device a model's input ids go to: its input embedding's execution device."""
    return execution_device(model.get_input_embeddings())


def bytes_by_device(model: Any) -> dict[str, int]:
    """Bytes of parameters and buffers per device (``cpu``, ``cuda:0``, ``disk``), from the
    model's ``hf_device_map`` for a split model; a tied weight counts once."""
    device_map = getattr(model, "hf_device_map", None) or {}
    placed: dict[str, int] = {}
    seen: set[int] = set()
    modules = dict(model.named_modules())
    for prefix, device in device_map.items():
        name = DISK if device == DISK else (f"cuda:{device}" if isinstance(device, int) else str(device))
        module = modules[prefix] if prefix else model
        for tensor in (*module.parameters(), *module.buffers()):
            key = id(tensor)
            if key in seen:
                continue
            seen.add(key)
            placed[name] = placed.get(name, 0) + tensor.numel() * tensor.element_size()
    if not device_map:
        for tensor in (*model.parameters(), *model.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                name = str(tensor.device)
                placed[name] = placed.get(name, 0) + tensor.numel() * tensor.element_size()
    return placed
