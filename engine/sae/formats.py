"""SAEs on disk in the layouts researchers use: SAELens folders and Gemma Scope ``params.npz``.

* **SAELens** (what ``SAE.save_model`` / ``SAE.load_from_disk`` read and write in SAELens 6): a
  folder with ``cfg.json`` and ``sae_weights.safetensors`` (``W_enc`` [d_in, d_sae], ``W_dec``
  [d_sae, d_in], ``b_enc``, ``b_dec``, and ``threshold`` for JumpReLU), optionally
  ``sparsity.safetensors`` (log10 feature density). A BatchTopK SAE is written as the JumpReLU
  it is at inference (SAELens does the same). Configs of SAELens 5 and earlier (``hook_name`` and
  ``model_name`` at the top level, TopK as ``activation_fn_str``) are read too.
* **Transcoders** in SAELens 6's inference classes: ``transcoder`` (ReLU), ``skip_transcoder``,
  ``jumprelu_transcoder``, ``jumprelu_skip_transcoder``; ``d_out`` in cfg, ``hook_name_out`` in
  its metadata, ``W_dec`` [d_sae, d_out], ``b_dec`` [d_out], ``W_skip`` [d_out, d_in], and
  ``apply_b_dec_to_input`` false. SAELens has no TopK transcoder: one is written as ``topk`` with
  ``d_out`` (miStudio reads it back; SAELens does not).
* **circuit-tracer** (:func:`save_circuit_tracer`, :func:`save_circuit_tracer_set`,
  :func:`load_circuit_tracer`): one ``layer_{i}.safetensors`` per transcoder, ``W_enc``
  [d_sae, d_model] (transposed), ``W_dec``, ``b_enc``, ``b_dec``, ``W_skip`` and
  ``activation_function.threshold`` for a JumpReLU, what ``circuit_tracer``'s
  ``load_relu_transcoder`` reads, and a set's ``config.yaml`` (``model_kind: transcoder_set``).
* **Gemma Scope**: ``params.npz`` with the same five arrays, a JumpReLU that does not subtract
  ``b_dec`` from its input.

Only safetensors and ``numpy.load(allow_pickle=False)`` are used: nothing is unpickled.

Hook names: miStudio's are TransformerLens' (``blocks.{i}.hook_resid_post``, ``hook_mlp_out``,
``mlp.hook_post``, ``ln_final.hook_normalized``) except ``hook_embed``, which here is what block 0
receives (token plus position embedding), i.e. TransformerLens' ``blocks.0.hook_resid_pre``;
:func:`transformer_lens_hook_name` and :func:`mistudio_hook_name` translate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engine.hooks import MLP_IN, MLP_OUT
from engine.inspection.sae_folders import (
    CFG_FILENAME,
    GEMMA_SCOPE_FILENAME,
    WEIGHTS_FILENAME,
    SaeFormatError,
    mistudio_hook_name,
    read_cfg,
    transformer_lens_hook_name,
)
from engine.sae.model import SaeShape, SparseAutoencoder
from engine.sae_architectures import (
    Architecture,
    MemberKind,
    architecture_named,
    circuit_tracer_form,
    member_kind,
    saelens_architecture_name,
    saelens_member,
)

SPARSITY_FILENAME = "sparsity.safetensors"
_TENSORS = ("W_enc", "W_dec", "b_enc", "b_dec")
__all__ = [
    "CFG_FILENAME",
    "CIRCUIT_TRACER_CONFIG",
    "GEMMA_SCOPE_FILENAME",
    "SPARSITY_FILENAME",
    "WEIGHTS_FILENAME",
    "SaeFormatError",
    "load_circuit_tracer",
    "load_circuit_tracer_layer",
    "load_gemma_scope",
    "load_saelens",
    "mistudio_hook_name",
    "save_circuit_tracer",
    "save_circuit_tracer_set",
    "save_saelens",
    "saved_architecture",
    "transformer_lens_hook_name",
]


def save_saelens(
    sae: SparseAutoencoder,
    folder: Path | str,
    *,
    hook_name: str,
    model_name: str,
    metadata: dict[str, Any] | None = None,
    log_feature_density: torch.Tensor | None = None,
    hook_name_out: str | None = None,
) -> Path:
    """Write ``sae`` as a SAELens folder (created if missing); returns it. A transcoder names the
    hook point it writes, ``hook_name_out``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shape = sae.shape
    architecture = saved_architecture(shape)
    cfg: dict[str, Any] = {
        "architecture": architecture,
        "d_in": shape.d_in,
        "d_sae": shape.d_sae,
        "dtype": str(sae.W_enc.dtype).removeprefix("torch."),
        "device": "cpu",
        "apply_b_dec_to_input": shape.apply_b_dec_to_input,
        "normalize_activations": "none",  # any scaling used in training is folded into the weights
        "reshape_activations": "none",
        "metadata": {
            "sae_lens_version": "6.0.0",  # without it SAELens 6 reads cfg as SAELens 5's, dropping metadata
            "model_name": model_name,
            "hook_name": transformer_lens_hook_name(hook_name),
            "hook_head_index": None,
            "prepend_bos": True,
            **(metadata or {}),
        },
    }
    if shape.is_transcoder:
        cfg["d_out"] = shape.d_out
        cfg["metadata"]["hook_name_out"] = transformer_lens_hook_name(hook_name_out or "")
    cfg.update(architecture_named(shape.kind.saved_as).saelens_cfg(shape))
    save_file({name: tensor.cpu() for name, tensor in sae.tensors().items()}, folder / WEIGHTS_FILENAME)
    if log_feature_density is not None:
        save_file({"sparsity": log_feature_density.detach().cpu().contiguous()}, folder / SPARSITY_FILENAME)
    (folder / CFG_FILENAME).write_text(json.dumps(cfg, indent=2))
    return folder


def saved_architecture(shape: SaeShape) -> str:
    """The architecture SAELens loads ``shape`` as (BatchTopK and Matryoshka: the JumpReLU they
    are at inference; a transcoder: SAELens' transcoder class of that form)."""
    return shape.member.saelens_name(architecture_named(shape.kind.saved_as))


def save_circuit_tracer(sae: SparseAutoencoder, folder: Path | str, *, layer: int) -> Path:
    """Write transcoder ``sae`` as circuit-tracer's ``layer_{layer}.safetensors`` in ``folder``."""
    shape = sae.shape
    if not shape.is_transcoder or not shape.kind.circuit_tracer_form:
        raise SaeFormatError(
            "UNSUPPORTED_SAE", "circuit-tracer reads ReLU and JumpReLU transcoders (BatchTopK ones included)."
        )
    tensors = {
        "W_enc": sae.W_enc.T,
        "W_dec": sae.W_dec,
        "b_enc": sae.b_enc,
        "b_dec": sae.b_dec,
    }
    for name in shape.member.extra_parameters:
        tensors[name] = getattr(sae, name)
    if shape.kind.thresholded:
        tensors["activation_function.threshold"] = sae.threshold
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"layer_{layer}.safetensors"
    save_file({name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}, path)
    return path


CIRCUIT_TRACER_CONFIG = "config.yaml"
# circuit-tracer's names of a per-layer transcoder's input and output (TransformerLens' and its own).
_CIRCUIT_TRACER_INPUTS = ("mlp.hook_in", MLP_IN)
_CIRCUIT_TRACER_OUTPUTS = ("mlp.hook_out", MLP_OUT)


def save_circuit_tracer_set(
    transcoders: list[SparseAutoencoder], folder: Path | str, *, model_name: str, scan: str
) -> Path:
    """Write one transcoder per layer as circuit-tracer's ``layer_{i}.safetensors`` plus the
    ``config.yaml`` of a ``transcoder_set`` (what its loaders read), in ``folder``."""
    import yaml

    folder = Path(folder)
    for layer, transcoder in enumerate(transcoders):
        save_circuit_tracer(transcoder, folder, layer=layer)
    config = {
        "model_name": model_name,
        "model_kind": "transcoder_set",
        "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "mlp.hook_out",
        "scan": scan,
        "transcoders": [f"layer_{layer}.safetensors" for layer in range(len(transcoders))],
    }
    (folder / CIRCUIT_TRACER_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def load_circuit_tracer(folder: Path | str) -> tuple[list[SparseAutoencoder], dict[str, Any]]:
    """The per-layer transcoders of a circuit-tracer folder, layer 0 first, and what its
    ``config.yaml`` says (``model_name``, ``scan``; empty without one).

    The files are ``layer_{i}.safetensors`` (from 0, none missing), or those the config's
    ``transcoders`` list names, which must lie inside ``folder`` (no ``hf://`` downloads, no paths
    out). Each holds ``W_enc`` [d_sae, d_model], ``W_dec``, ``b_enc``, ``b_dec``, and optionally
    ``W_skip`` and ``activation_function.threshold`` (a JumpReLU; a ReLU without). Cross-layer
    transcoders are refused with ``UNSUPPORTED_SAE``.
    """
    import yaml

    folder = Path(folder).resolve()
    config: dict[str, Any] = {}
    config_path = folder / CIRCUIT_TRACER_CONFIG
    if config_path.is_file():
        if config_path.stat().st_size > 1 << 20:
            raise SaeFormatError("INVALID_SAE", f"{CIRCUIT_TRACER_CONFIG} is over 1 MiB.")
        try:
            config = yaml.safe_load(config_path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError):
            raise SaeFormatError("INVALID_SAE", f"{CIRCUIT_TRACER_CONFIG} is not readable YAML.") from None
        if not isinstance(config, dict):
            raise SaeFormatError("INVALID_SAE", f"{CIRCUIT_TRACER_CONFIG} is not a mapping.")
    kind = config.get("model_kind", "transcoder_set")
    if kind != "transcoder_set":
        raise SaeFormatError(
            "UNSUPPORTED_SAE",
            f"circuit-tracer {kind!r} folders are not supported (per-layer transcoder sets are).",
        )
    for key, names in (
        ("feature_input_hook", _CIRCUIT_TRACER_INPUTS),
        ("feature_output_hook", _CIRCUIT_TRACER_OUTPUTS),
    ):
        if config.get(key, names[0]) not in names:
            raise SaeFormatError(
                "UNSUPPORTED_SAE",
                f"{key} {config[key]!r}: only MLP-input to MLP-output transcoders are read.",
            )
    if "transcoders" in config:
        names = config["transcoders"]
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise SaeFormatError("INVALID_SAE", "transcoders must be a list of file names.")
        paths = [(folder / name).resolve() for name in names]
        if any(
            name.startswith("hf://") or not path.is_relative_to(folder)
            for name, path in zip(names, paths, strict=True)
        ):
            raise SaeFormatError("INVALID_SAE", "The transcoder files must lie inside the folder.")
    else:
        count = len(list(folder.glob("layer_*.safetensors")))
        paths = [folder / f"layer_{layer}.safetensors" for layer in range(count)]
    missing = [path.name for path in paths if not path.is_file()]
    if not paths or missing:
        raise SaeFormatError(
            "INVALID_SAE",
            "Not a circuit-tracer transcoder folder: layer_0.safetensors, layer_1.safetensors, ...",
            {"missing": missing[:8]},
        )  # fmt: skip
    transcoders = [load_circuit_tracer_layer(path) for path in paths]
    return transcoders, {"model_name": config.get("model_name"), "scan": config.get("scan")}


def load_circuit_tracer_layer(path: Path | str) -> SparseAutoencoder:
    """One per-layer transcoder file of circuit-tracer's layout (see :func:`load_circuit_tracer`)."""
    path = Path(path)
    try:
        tensors = load_file(path)
    except (OSError, ValueError) as error:
        raise SaeFormatError(
            "INVALID_SAE", f"{path.name} is not safetensors: {type(error).__name__}."
        ) from None
    if "W_enc" in tensors:
        tensors["W_enc"] = tensors["W_enc"].T
    threshold = tensors.pop("activation_function.threshold", None)
    if threshold is not None:
        tensors["threshold"] = threshold
    return _from_tensors(
        tensors,
        architecture=circuit_tracer_form(thresholded=threshold is not None).name,
        k=None,
        apply_b_dec_to_input=False,
        expected=(None, None),
        transcoder=True,
        skip="W_skip" in tensors,
    )


def load_saelens(folder: Path | str) -> tuple[SparseAutoencoder, dict[str, Any]]:
    """The SAE in a SAELens folder and what it says of itself: ``hook_name`` (miStudio's name),
    ``model_name`` and the whole ``cfg``."""
    folder = Path(folder)
    cfg = read_cfg(folder / CFG_FILENAME)
    try:
        tensors = load_file(folder / WEIGHTS_FILENAME)
    except (OSError, ValueError) as error:
        raise SaeFormatError(
            "INVALID_SAE",
            f"Not a SAELens folder: {type(error).__name__}.",
            {"expects": [CFG_FILENAME, WEIGHTS_FILENAME]},
        ) from None
    member, form = _saelens_member(cfg, tensors)
    sae = _from_tensors(
        tensors,
        architecture=form.name,
        k=form.k_from_saelens(cfg),
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)) and not member.transcoder,
        expected=(cfg.get("d_in"), cfg.get("d_sae")),
        transcoder=member.transcoder,
        skip=member.skip,
    )
    if cfg.get("rescale_acts_by_decoder_norm"):
        _fold_decoder_norms(sae)
    metadata = cfg.get("metadata") or {}
    hook_name = metadata.get("hook_name") or cfg.get("hook_name")
    hook_name_out = metadata.get("hook_name_out")
    return sae, {
        "hook_name": mistudio_hook_name(hook_name) if hook_name else None,
        "hook_name_out": mistudio_hook_name(hook_name_out) if hook_name_out else None,
        "model_name": metadata.get("model_name") or cfg.get("model_name"),
        "cfg": cfg,
    }


def _saelens_member(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[MemberKind, Architecture]:
    """The kind and inference form a SAELens ``cfg.json`` describes, or ``UNSUPPORTED_SAE`` for
    settings and architectures miStudio does not read."""
    architecture = saelens_architecture_name(cfg)
    for key, supported in (("normalize_activations", "none"), ("reshape_activations", "none")):
        if cfg.get(key, "none") not in (supported, None):
            raise SaeFormatError(
                "UNSUPPORTED_SAE",
                f"{key} = {cfg[key]!r} is not supported (only {supported!r}).",
                {key: cfg[key]},
            )
    found = saelens_member(architecture, has_d_out=cfg.get("d_out") is not None, has_skip="W_skip" in tensors)
    if found is None:
        raise SaeFormatError("UNSUPPORTED_SAE", f"Architecture {architecture!r} is not supported.")
    if cfg.get("rescale_acts_by_decoder_norm") and not found[1].reads_decoder_norm_rescale:
        raise SaeFormatError("UNSUPPORTED_SAE", f"Architecture {found[1].name!r} is not supported.")
    return found


def _fold_decoder_norms(sae: SparseAutoencoder) -> None:
    """SAELens' TopK scales h by the decoder rows' norms and the features by their inverse, as if
    the decoder were unit-norm (its inference save folds them already): fold them here."""
    with torch.no_grad():
        norms = sae.W_dec.norm(dim=1)
        sae.W_enc.mul_(norms)
        sae.b_enc.mul_(norms)
        sae.W_dec.div_(norms[:, None])


def load_gemma_scope(folder: Path | str) -> SparseAutoencoder:
    """The JumpReLU SAE in a Gemma Scope folder's ``params.npz`` (no ``b_dec`` on the input)."""
    path = Path(folder) / GEMMA_SCOPE_FILENAME
    try:
        with np.load(path, allow_pickle=False) as arrays:
            tensors = {
                name: torch.from_numpy(np.array(arrays[name], dtype=np.float32)) for name in arrays.files
            }
    except (OSError, ValueError) as error:
        raise SaeFormatError(
            "INVALID_SAE", f"Not a Gemma Scope {GEMMA_SCOPE_FILENAME}: {type(error).__name__}."
        ) from None
    return _from_tensors(
        tensors, architecture="jumprelu", k=None, apply_b_dec_to_input=False, expected=(None, None)
    )


def _from_tensors(
    tensors: dict[str, torch.Tensor],
    *,
    architecture: str,
    k: int | None,
    apply_b_dec_to_input: bool,
    expected: tuple[Any, Any],
    transcoder: bool = False,
    skip: bool = False,
) -> SparseAutoencoder:
    needed = [
        *_TENSORS,
        *(["threshold"] if architecture_named(architecture).thresholded else []),
        *member_kind(transcoder=transcoder, skip=skip).extra_parameters,
    ]
    missing = [name for name in needed if name not in tensors]
    if missing:
        raise SaeFormatError("INVALID_SAE", f"Missing tensors: {', '.join(missing)}.", {"missing": missing})
    if tensors["W_enc"].dim() != 2 or tensors["b_dec"].dim() != 1:
        raise SaeFormatError("INVALID_SAE", "W_enc must be [d_in, d_sae] and b_dec a vector.")
    d_in, d_sae = tensors["W_enc"].shape
    d_out = int(tensors["b_dec"].shape[0]) if transcoder else d_in
    shapes = {
        "W_enc": (d_in, d_sae),
        "W_dec": (d_sae, d_out),
        "b_enc": (d_sae,),
        "b_dec": (d_out,),
        "threshold": (d_sae,),
        "W_skip": (d_out, d_in),
    }
    wrong = [name for name in needed if tuple(tensors[name].shape) != shapes[name]]
    if wrong or any(
        value is not None and value != actual for value, actual in zip(expected, (d_in, d_sae), strict=True)
    ):
        raise SaeFormatError(
            "INVALID_SAE",
            "The tensors' shapes do not agree with each other or with cfg.json.",
            {"tensors": wrong},
        )
    infinite = [name for name in needed if not bool(torch.isfinite(tensors[name].float()).all())]
    if infinite:
        raise SaeFormatError(
            "INVALID_SAE",
            f"Non-finite weights (NaN or infinity) in {', '.join(infinite)}.",
            {"tensors": infinite},
        )
    try:
        sae = SparseAutoencoder(
            SaeShape(
                architecture, d_in, d_sae, k, apply_b_dec_to_input=apply_b_dec_to_input,
                d_out=d_out if transcoder else None, skip=skip,
            )
        )  # fmt: skip
    except ValueError as error:
        raise SaeFormatError("INVALID_SAE", str(error)) from None
    with torch.no_grad():
        for name in needed:
            getattr(sae, name).copy_(tensors[name].float())
    return sae
