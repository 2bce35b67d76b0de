"""What an SAE folder holds, read from its headers only: before any array is loaded, an import
knows the SAE's sizes and every tensor's declared size, and refuses a file that lies about them.

* SAELens: ``cfg.json`` (at most ``MAX_CFG_BYTES``, nesting at most ``MAX_CFG_DEPTH``) and the
  safetensors header of ``sae_weights.safetensors``: every tensor's dtype, shape and byte range
  must agree with each other and with the file's size.
* circuit-tracer: one ``layer_{i}.safetensors`` per layer (``W_enc`` [d_sae, d_model], ``W_dec``
  [d_sae, d_model], ``b_enc``, ``b_dec``, optionally ``W_skip`` and ``activation_function.threshold``),
  and a set's ``config.yaml`` (``model_kind: transcoder_set``), each file's header checked the same.
* Gemma Scope: the members of ``params.npz`` (a zip): each member's declared size and ``.npy``
  header (a few hundred bytes, the only part decompressed), with no member expanding more than
  ``MAX_COMPRESSION_RATIO`` times (a zip bomb).

No torch: the web process reads these. Files are read through the paths given (the caller
resolved and confined them).
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import EngineError
from engine.hooks import HOOK_EMBED
from engine.sae_architectures import circuit_tracer_form, saelens_architecture_name, saelens_form

CFG_FILENAME = "cfg.json"
WEIGHTS_FILENAME = "sae_weights.safetensors"
SPARSITY_FILENAME = "sparsity.safetensors"  # optional: log10 feature density, [d_sae]
GEMMA_SCOPE_FILENAME = "params.npz"
MAX_CFG_BYTES = 1 << 20
MAX_CFG_DEPTH = 32
MAX_HEADER_BYTES = 16 << 20  # a safetensors header (safetensors' own limit is 100 MB)
MAX_COMPRESSION_RATIO = 100  # real float weights barely compress; zeros compress 1000:1
SAFETENSORS_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
NEEDED = ("W_enc", "W_dec", "b_enc", "b_dec")
_TL_EMBED = "blocks.0.hook_resid_pre"


class SaeFormatError(EngineError):
    """A folder that is not an SAE this code can read, or whose files lie (``INVALID_SAE``,
    ``UNSUPPORTED_SAE``)."""


@dataclass(frozen=True)
class SaeFiles:
    """An SAE folder as its headers describe it."""

    format: str  # "saelens" | "gemma_scope"
    architecture: str
    d_in: int
    d_sae: int
    hook_name: str | None
    model_name: str | None
    files: tuple[Path, ...]  # what an import reads (and hashes)
    tensor_bytes: int  # the arrays as float32, as the import holds them
    # A transcoder's output width, and for a circuit-tracer set's member, its layer.
    d_out: int | None = None
    layer: int | None = None


def transformer_lens_hook_name(name: str) -> str:
    return _TL_EMBED if name == HOOK_EMBED else name


def mistudio_hook_name(name: str) -> str:
    """The miStudio name of a TransformerLens hook name (the same but for the embedding)."""
    return HOOK_EMBED if name == _TL_EMBED else name


def _invalid(message: str, details: dict[str, Any] | None = None) -> SaeFormatError:
    return SaeFormatError("INVALID_SAE", message, details)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(item) for item in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(item) for item in value), default=0)
    return 0


def read_cfg(path: Path) -> dict[str, Any]:
    """``cfg.json``, bounded in size and nesting."""
    try:
        size = path.stat().st_size
        if size > MAX_CFG_BYTES:
            raise _invalid(f"{CFG_FILENAME} is over {MAX_CFG_BYTES:,} bytes.")
        cfg = json.loads(path.read_bytes())
    except RecursionError:
        raise _invalid(f"{CFG_FILENAME} nests too deeply.") from None
    except (OSError, ValueError) as error:
        raise _invalid(f"{CFG_FILENAME} is not readable JSON ({type(error).__name__}).") from None
    if not isinstance(cfg, dict):
        raise _invalid(f"{CFG_FILENAME} is not a JSON object.")
    if _depth(cfg) > MAX_CFG_DEPTH:
        raise _invalid(f"{CFG_FILENAME} nests more than {MAX_CFG_DEPTH} levels deep.")
    return cfg


def safetensors_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each tensor's (shape, item bytes) from a safetensors header, every byte range checked
    against its dtype and shape and the file's size (``INVALID_SAE`` for a header that lies)."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _invalid(f"{name} is not a safetensors file.")
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > size:
                raise _invalid(f"{name}'s header declares {header_bytes:,} bytes; the file has {size:,}.")
            header = json.loads(handle.read(header_bytes))
    except RecursionError:
        raise _invalid(f"{name}'s header nests too deeply.") from None
    except (OSError, ValueError) as error:
        raise _invalid(f"{name}'s header is not readable ({type(error).__name__}).") from None
    if not isinstance(header, dict):
        raise _invalid(f"{name}'s header is not a JSON object.")
    data_bytes = size - 8 - header_bytes
    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    spans = []
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise _invalid(f"{name}: the entry of {tensor!r} is malformed.") from None
        if dtype not in SAFETENSORS_ITEM_BYTES:
            raise _invalid(f"{name}: {tensor!r} has dtype {dtype!r} (floats only).")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise _invalid(f"{name}: {tensor!r} has a malformed shape.")
        item = SAFETENSORS_ITEM_BYTES[dtype]
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= data_bytes):
            raise _invalid(f"{name}: {tensor!r}'s bytes lie outside the file.", {"tensor": tensor})
        if stop - start != math.prod(shape) * item:
            raise _invalid(
                f"{name}: {tensor!r} declares {math.prod(shape) * item:,} bytes of data but spans "
                f"{stop - start:,}.",
                {"tensor": tensor},
            )
        spans.append((start, stop))
        tensors[tensor] = (tuple(shape), item)
    spans.sort()
    if any(previous[1] > current[0] for previous, current in itertools.pairwise(spans)):
        raise _invalid(f"{name}: tensors overlap.")
    return tensors


def npz_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each array's (shape, item bytes) from the members of an ``.npz``, reading only each member's
    ``.npy`` header; a member's declared size must match its header, and none may expand more than
    ``MAX_COMPRESSION_RATIO`` times."""
    name = path.name
    arrays: dict[str, tuple[tuple[int, ...], int]] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                if not member.filename.endswith(".npy"):
                    continue
                if member.compress_type != zipfile.ZIP_STORED and (
                    member.file_size > MAX_COMPRESSION_RATIO * max(member.compress_size, 1)
                ):
                    raise _invalid(
                        f"{name}: {member.filename} expands {member.file_size:,} bytes from "
                        f"{member.compress_size:,} (more than {MAX_COMPRESSION_RATIO}:1, refused).",
                        {"member": member.filename},
                    )
                with archive.open(member) as handle:
                    version = np.lib.format.read_magic(handle)
                    read_header = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read_header(handle, max_header_size=10_000)
                    header_end = handle.tell()
                if dtype.hasobject or dtype.kind != "f":
                    raise _invalid(f"{name}: {member.filename} is not an array of floats.")
                if member.file_size != header_end + math.prod(shape) * dtype.itemsize:
                    raise _invalid(
                        f"{name}: {member.filename}'s header declares another size than the member has.",
                        {"member": member.filename},
                    )
                arrays[member.filename.removesuffix(".npy")] = (tuple(shape), dtype.itemsize)
    except SaeFormatError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
        raise _invalid(f"{name} is not a readable .npz ({type(error).__name__}).") from None
    return arrays


def _sizes(tensors: dict[str, tuple[tuple[int, ...], int]], *, thresholded: bool) -> tuple[int, int, int]:
    """(d_in, d_sae, float32 bytes) of the SAE's tensors, their shapes checked against each other."""
    needed = [*NEEDED, *(["threshold"] if thresholded else [])]
    missing = [tensor for tensor in needed if tensor not in tensors]
    if missing:
        raise _invalid(f"Missing tensors: {', '.join(missing)}.", {"missing": missing})
    encoder = tensors["W_enc"][0]
    if len(encoder) != 2:
        raise _invalid("W_enc must be [d_in, d_sae].")
    d_in, d_sae = encoder
    expected = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_enc": (d_sae,), "b_dec": (d_in,),
                "threshold": (d_sae,)}  # fmt: skip
    wrong = [tensor for tensor in needed if tensors[tensor][0] != expected[tensor]]
    if wrong or not d_in or not d_sae:
        raise _invalid("The tensors' shapes do not agree with each other.", {"tensors": wrong})
    return d_in, d_sae, sum(4 * math.prod(tensors[tensor][0]) for tensor in needed)


def inspect_sae_folder(entries: dict[str, Path], format: str) -> SaeFiles:
    """Describe the SAE of a folder whose top-level entries are ``entries`` (name → real path),
    ``format`` being ``saelens``, ``gemma_scope`` or ``auto``."""
    if format == "auto":
        format = "gemma_scope" if GEMMA_SCOPE_FILENAME in entries else "saelens"
    if format == "gemma_scope":
        path = entries.get(GEMMA_SCOPE_FILENAME)
        if path is None or not path.is_file():
            raise _invalid(f"No {GEMMA_SCOPE_FILENAME} in the folder.")
        d_in, d_sae, tensor_bytes = _sizes(npz_shapes(path), thresholded=True)
        return SaeFiles("gemma_scope", "jumprelu", d_in, d_sae, None, None, (path,), tensor_bytes)
    cfg_path, weights = entries.get(CFG_FILENAME), entries.get(WEIGHTS_FILENAME)
    if cfg_path is None or weights is None or not cfg_path.is_file() or not weights.is_file():
        raise _invalid(
            f"Not a SAELens folder: it needs {CFG_FILENAME} and {WEIGHTS_FILENAME} "
            "(or use format=gemma_scope).",
            {"expects": [CFG_FILENAME, WEIGHTS_FILENAME]},
        )
    cfg = read_cfg(cfg_path)
    tensors = safetensors_shapes(weights)
    architecture = saelens_architecture_name(cfg)
    form = saelens_form(architecture)
    d_in, d_sae, tensor_bytes = _sizes(tensors, thresholded=form is not None and form.thresholded)
    if any(cfg.get(key) not in (None, value) for key, value in (("d_in", d_in), ("d_sae", d_sae))):
        raise _invalid("The tensors' shapes do not agree with cfg.json.")
    if SPARSITY_FILENAME in entries:
        check_sparsity(entries[SPARSITY_FILENAME], d_sae)
    metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    hook_name, model_name = metadata.get("hook_name") or cfg.get("hook_name"), metadata.get("model_name")
    return SaeFiles(
        "saelens",
        str(architecture),
        d_in,
        d_sae,
        mistudio_hook_name(hook_name) if isinstance(hook_name, str) else None,
        (model_name or cfg.get("model_name"))
        if isinstance(model_name or cfg.get("model_name"), str)
        else None,
        (cfg_path, weights),
        tensor_bytes,
    )


def check_sparsity(path: Path, d_sae: int) -> None:
    """A SAELens ``sparsity.safetensors`` is what its name says: a safetensors file (its header
    checked as the weights' is) holding one tensor, ``sparsity``, of shape [d_sae]. Any other
    bytes under that name (a pickle, say) are refused, not stored."""
    if not path.is_file():
        raise _invalid(f"{SPARSITY_FILENAME} is not a file.")
    tensors = safetensors_shapes(path)
    if set(tensors) != {"sparsity"} or tensors["sparsity"][0] != (d_sae,):
        raise _invalid(
            f"{SPARSITY_FILENAME} must hold one tensor, sparsity, of shape [{d_sae}] (d_sae).",
            {"file": SPARSITY_FILENAME, "tensors": sorted(tensors)[:10]},
        )


CIRCUIT_TRACER_CONFIG = "config.yaml"
CIRCUIT_TRACER_THRESHOLD = "activation_function.threshold"


def inspect_circuit_tracer_folder(entries: dict[str, Path]) -> list[SaeFiles]:
    """The per-layer transcoders of a circuit-tracer folder (``layer_0.safetensors`` …, from 0, none
    missing; or the files its ``config.yaml`` lists, which must be top-level entries of the folder),
    each described from its header: a JumpReLU when it has a threshold, a ReLU otherwise. A
    ``config.yaml`` that names another kind (cross-layer transcoders) is ``UNSUPPORTED_SAE``."""
    config = _circuit_tracer_config(entries)
    names = _circuit_tracer_files(config, entries)
    return [
        _circuit_tracer_layer(name, entries[name], layer, config.get("model_name"))
        for layer, name in enumerate(names)
    ]


def _circuit_tracer_config(entries: dict[str, Path]) -> dict[str, Any]:
    """The folder's ``config.yaml`` (empty without one), refused unless a per-layer set's."""
    import yaml

    config: dict[str, Any] = {}
    config_path = entries.get(CIRCUIT_TRACER_CONFIG)
    if config_path is not None:
        if config_path.stat().st_size > MAX_CFG_BYTES:
            raise _invalid(f"{CIRCUIT_TRACER_CONFIG} is over {MAX_CFG_BYTES:,} bytes.")
        try:
            config = yaml.safe_load(config_path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError, OSError):
            raise _invalid(f"{CIRCUIT_TRACER_CONFIG} is not readable YAML.") from None
        if not isinstance(config, dict):
            raise _invalid(f"{CIRCUIT_TRACER_CONFIG} is not a mapping.")
    if config.get("model_kind", "transcoder_set") != "transcoder_set":
        raise SaeFormatError(
            "UNSUPPORTED_SAE",
            f"circuit-tracer {config['model_kind']!r} folders are not supported (per-layer sets are).",
        )
    return config


def _circuit_tracer_files(config: dict[str, Any], entries: dict[str, Path]) -> list[str]:
    """The transcoder files, layer 0 first: those the config lists, or ``layer_{i}.safetensors``."""
    names = config.get("transcoders")
    if names is None:
        names = [
            f"layer_{layer}.safetensors"
            for layer in range(sum(name.startswith("layer_") for name in entries))
        ]
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        raise _invalid("Not a circuit-tracer transcoder folder: layer_0.safetensors, layer_1.safetensors, …")
    missing = [name for name in names if name not in entries]
    if missing:
        raise _invalid(
            "The folder lacks transcoder files (they must be in it, not elsewhere).", {"missing": missing[:8]}
        )
    return names


def _circuit_tracer_layer(name: str, path: Path, layer: int, model_name: Any) -> SaeFiles:
    """One layer's transcoder, described from its file's header, its shapes checked."""
    tensors = safetensors_shapes(path)
    if "W_enc" not in tensors or len(tensors["W_enc"][0]) != 2:
        raise _invalid(f"{name}: W_enc must be [d_sae, d_model].")
    d_sae, d_model = tensors["W_enc"][0]
    expected = {
        "W_enc": (d_sae, d_model), "W_dec": (d_sae, d_model), "b_enc": (d_sae,), "b_dec": (d_model,),
        "W_skip": (d_model, d_model), CIRCUIT_TRACER_THRESHOLD: (d_sae,),
    }  # fmt: skip
    needed = [*NEEDED, *(tensor for tensor in ("W_skip", CIRCUIT_TRACER_THRESHOLD) if tensor in tensors)]
    wrong = [tensor for tensor in needed if tensor not in tensors or tensors[tensor][0] != expected[tensor]]
    if wrong or not d_sae or not d_model:
        raise _invalid(f"{name}: the tensors' shapes do not agree with each other.", {"tensors": wrong})
    return SaeFiles(
        "circuit_tracer",
        circuit_tracer_form(thresholded=CIRCUIT_TRACER_THRESHOLD in tensors).name,
        d_model,
        d_sae,
        None,
        model_name,
        (path,),
        sum(4 * math.prod(tensors[tensor][0]) for tensor in needed),
        d_out=d_model,
        layer=layer,
    )


def inspect_clt_folder(entries: dict[str, Path]) -> SaeFiles:
    """A cross-layer transcoder in circuit-tracer's layout (``W_enc_{l}.safetensors`` and
    ``W_dec_{l}.safetensors`` per layer, from 0, none missing), described from its headers:
    ``d_sae`` features per layer, ``layer`` holding the number of layers, a JumpReLU when it has
    thresholds. What :func:`engine.sae.clt.load_clt` reads."""
    n_layers = sum(name.startswith("W_enc_") and name.endswith(".safetensors") for name in entries)
    names = [f"W_{kind}_{layer}.safetensors" for layer in range(n_layers) for kind in ("enc", "dec")]
    missing = [name for name in names if name not in entries]
    if not n_layers or missing:
        raise _invalid(
            "Not a cross-layer transcoder folder: W_enc_0.safetensors, W_dec_0.safetensors, W_enc_1…",
            {"missing": missing[:8]},
        )
    first = safetensors_shapes(entries["W_enc_0.safetensors"])
    if len(first.get("W_enc_0", ((),))[0]) != 2:
        raise _invalid("W_enc_0.safetensors: W_enc_0 must be [d_sae, d_model].")
    d_sae, d_model = first["W_enc_0"][0]
    thresholded = "threshold_0" in first
    total = 0
    for layer in range(n_layers):
        expected = {
            f"W_enc_{layer}": (d_sae, d_model), f"b_enc_{layer}": (d_sae,), f"b_dec_{layer}": (d_model,),
            **({f"threshold_{layer}": (d_sae,)} if thresholded else {}),
        }  # fmt: skip
        decoder = {f"W_dec_{layer}": (d_sae, n_layers - layer, d_model)}
        for name, wanted in (
            (f"W_enc_{layer}.safetensors", expected),
            (f"W_dec_{layer}.safetensors", decoder),
        ):
            tensors = safetensors_shapes(entries[name])
            wrong = [tensor for tensor, shape in wanted.items() if tensors.get(tensor, ((),))[0] != shape]
            if wrong:
                raise _invalid(
                    f"{name}: the tensors' shapes do not agree with each other.", {"tensors": wrong}
                )
            total += sum(4 * math.prod(shape) for shape in wanted.values())
    if not d_sae or not d_model:
        raise _invalid("W_enc_0.safetensors: empty tensors.")
    return SaeFiles(
        "clt",
        circuit_tracer_form(thresholded=thresholded).name,
        d_model,
        d_sae,
        None,
        None,
        tuple(entries[name] for name in names),
        total,
        d_out=d_model,
        layer=n_layers,
    )
