"""Training checkpoints: everything :func:`engine.sae.train` carries from step to step, on disk
as safetensors + JSON (nothing pickled), written so that a save cut short leaves no checkpoint
rather than half of one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.sae.data import StreamPosition

if TYPE_CHECKING:
    from engine.sae.training import TrainingConfig

CHECKPOINT_FORMAT = 1
CHECKPOINT_TENSORS = "checkpoint.safetensors"
CHECKPOINT_DESCRIPTION = "checkpoint.json"  # written last: a checkpoint is complete once it exists
SAE_PARAMETERS: tuple[str, ...] = ("W_enc", "W_dec", "b_enc", "b_dec")


@dataclass
class TrainingCheckpoint:
    """Everything :func:`train` carries from one step to the next, so that a training stopped
    (even by SIGKILL) continues exactly and ends with the tensors an uninterrupted run gives: fed
    its batch stream opened at ``stream`` (the position of a stream that can be opened in the
    middle, :func:`engine.sae.data.resumable_batches`), or, without one, fed the same stream from
    its beginning, skipping the ``step`` batches already trained on.

    Stored as ``checkpoint.safetensors`` (the tensors) and ``checkpoint.json`` (the rest):
    nothing is pickled, so a checkpoint from elsewhere cannot run code when it is read. One
    written before stream positions has none, and resumes by skipping.
    """

    # The TrainingConfig as a dict (``dataclasses.asdict``): a resume under another is refused.
    config: dict[str, Any]
    d_in: int
    step: int
    tokens: int
    scaling: float
    # Training time before this checkpoint, over every process that trained it (downtime excluded).
    elapsed_seconds: float
    # W_enc, W_dec, b_enc, b_dec (and a skip transcoder's W_skip) as trained: in the scaled
    # space, before fold_scaling.
    parameters: dict[str, torch.Tensor]
    log_threshold: torch.Tensor | None  # jumprelu only
    # Adam's state per parameter, flattened: "<parameter>.exp_avg", ".exp_avg_sq", ".step".
    optimizer_state: dict[str, torch.Tensor]
    steps_since_fired: torch.Tensor
    history: list[dict[str, Any]]  # StepMetrics as dicts
    # A transcoder's output width and the factor its targets were scaled by.
    d_out: int | None = None
    output_scaling: float | None = None
    # Where the batch stream stood after ``step``; None for a stream that can only be replayed.
    stream: StreamPosition | None = None

    def save(self, folder: Path) -> None:
        """Write the checkpoint into ``folder`` (created if need be), replacing the one there.

        Each file is written to a temporary name, fsynced and renamed over the old one. The json
        marks a checkpoint complete: it is deleted before the tensors are replaced and written
        after them, so a save cut short leaves no checkpoint rather than half of one (or the old
        json beside the new tensors)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"sae.{name}": tensor for name, tensor in self.parameters.items()}
        tensors |= {f"adam.{name}": tensor for name, tensor in self.optimizer_state.items()}
        tensors["steps_since_fired"] = self.steps_since_fired
        if self.log_threshold is not None:
            tensors["log_threshold"] = self.log_threshold
        if self.stream is not None:
            tensors |= {f"stream.{name}": tensor for name, tensor in self.stream.buffer.items()}
        description = {
            "format": CHECKPOINT_FORMAT,
            "config": self.config,
            "d_in": self.d_in,
            "step": self.step,
            "tokens": self.tokens,
            "scaling": self.scaling,
            "elapsed_seconds": self.elapsed_seconds,
            "history": self.history,
            "d_out": self.d_out,
            "output_scaling": self.output_scaling,
        }
        if self.stream is not None:
            description["stream"] = {
                "batches": self.stream.batches,
                "rows_given": self.stream.rows_given,
                "rows_taken": self.stream.rows_taken,
            }
        (folder / CHECKPOINT_DESCRIPTION).unlink(missing_ok=True)
        fsync_directory(folder)
        metadata = {"format": str(CHECKPOINT_FORMAT), "step": str(self.step)}
        tensors = {name: tensor.detach().contiguous() for name, tensor in tensors.items()}
        replace_durably(folder / CHECKPOINT_TENSORS, lambda path: save_file(tensors, path, metadata=metadata))
        replace_durably(
            folder / CHECKPOINT_DESCRIPTION, lambda path: path.write_text(json.dumps(description))
        )

    @classmethod
    def load(cls, folder: Path) -> TrainingCheckpoint | None:
        """The checkpoint saved in ``folder``, or None when there is no complete one (no json).

        Raises ValueError for another format version or tensors that are not the json's step."""
        folder = Path(folder)
        try:
            description = json.loads((folder / CHECKPOINT_DESCRIPTION).read_text())
        except FileNotFoundError:
            return None
        found = description.get("format")
        if found != CHECKPOINT_FORMAT:
            raise ValueError(f"{folder} holds a checkpoint of format {found!r}, not {CHECKPOINT_FORMAT}")
        tensors_path = folder / CHECKPOINT_TENSORS
        with safe_open(tensors_path, framework="pt") as tensors_file:
            tensors_step = (tensors_file.metadata() or {}).get("step")
        if tensors_step != str(description["step"]):
            raise ValueError(f"{tensors_path} holds step {tensors_step}, its json step {description['step']}")
        tensors = load_file(tensors_path)
        stream = description.get("stream")  # absent from a checkpoint written before positions
        return cls(
            config=description["config"],
            d_in=description["d_in"],
            step=description["step"],
            tokens=description["tokens"],
            scaling=description["scaling"],
            elapsed_seconds=description["elapsed_seconds"],
            parameters=_prefixed(tensors, "sae."),
            log_threshold=tensors.get("log_threshold"),
            optimizer_state=_prefixed(tensors, "adam."),
            steps_since_fired=tensors["steps_since_fired"],
            history=description["history"],
            d_out=description.get("d_out"),
            output_scaling=description.get("output_scaling"),
            stream=StreamPosition(**stream, buffer=_prefixed(tensors, "stream.")) if stream else None,
        )

    def check_continues(self, config: TrainingConfig, d_in: int, d_out: int | None = None) -> None:
        """Raise ValueError unless this checkpoint was written by a training of ``config`` on
        activations of width ``d_in`` (and for a transcoder, targets of width ``d_out``)."""
        expected = json.loads(json.dumps(asdict(config)))  # tuples as the json holds them: lists
        changed = sorted(
            key for key in expected.keys() | self.config.keys() if expected.get(key) != self.config.get(key)
        )
        if changed:
            raise ValueError(
                f"the checkpoint was written with another training config (differs in: {', '.join(changed)})"
            )
        if (self.d_in, self.d_out) != (d_in, d_out):
            raise ValueError(
                f"the checkpoint was written for d_in {self.d_in} and d_out {self.d_out}, "
                f"not {d_in} and {d_out}"
            )


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors named ``<prefix><name>``, by name."""
    return {name.removeprefix(prefix): tensor for name, tensor in tensors.items() if name.startswith(prefix)}


def replace_durably(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` a temporary file beside ``path``, flush it to disk, and rename it over ``path``."""
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    with open(temporary, "rb") as written:
        os.fsync(written.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def fsync_directory(folder: Path) -> None:
    """Make the renames and deletions in ``folder`` durable (a no-op where directories can't be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
