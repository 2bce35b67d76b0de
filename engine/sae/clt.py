"""Cross-layer transcoders (CLTs): features that read one layer's MLP input and write into that
layer's MLP output and every later one's, in circuit-tracer's conventions.

Per layer ``l`` of ``n_layers``: ``W_enc[l]`` [d_model, d_sae] (miStudio's orientation, as
:class:`engine.sae.model.SparseAutoencoder`), ``b_enc[l]`` [d_sae], ``threshold[l]`` [d_sae] for
a JumpReLU, and ``W_dec[l]`` [d_sae, n_layers - l, d_model]: its decoders into layers
``l, l + 1, ...``. ``b_dec[m]`` [d_model] is layer ``m``'s output bias, and an optional
``W_skip[m]`` [d_model, d_model] adds ``x_m @ W_skip[m]`` (circuit-tracer's orientation).

Layer ``m``'s MLP output is predicted as ``sum over l <= m of f_l @ W_dec[l][:, m - l] + b_dec[m]``
(+ the skip term), where ``f_l = act(x_l @ W_enc[l] + b_enc[l])``: ReLU, or JumpReLU's
``h * (h > threshold)``. The encoder does not subtract ``b_dec`` (a transcoder's ``b_dec`` lives in
the output space).

Files: circuit-tracer's ``W_enc_{l}.safetensors`` (``W_enc_{l}`` [d_sae, d_model], ``b_enc_{l}``,
``b_dec_{l}``, ``threshold_{l}``) and ``W_dec_{l}.safetensors`` (``W_dec_{l}``), which its
``load_clt`` reads; and Gemma Scope 2's per-layer files (``w_enc`` [d_model, d_sae], ``w_dec``
[d_sae, n_layers, d_model], ``b_enc``, ``b_dec``, ``threshold``, ``affine_skip_connection``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from engine.errors import EngineError

__all__ = ["CltShape", "CrossLayerTranscoder", "load_clt", "load_gemma_scope_2_clt", "save_clt"]

ACTIVATIONS = ("relu", "jumprelu")


@dataclass(frozen=True)
class CltShape:
    n_layers: int
    d_model: int
    d_sae: int  # features per layer
    activation: str = "relu"
    skip: bool = False

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}")
        if min(self.n_layers, self.d_model, self.d_sae) < 1:
            raise ValueError("n_layers, d_model and d_sae must be positive")

    @property
    def total_features(self) -> int:
        return self.n_layers * self.d_sae


class CrossLayerTranscoder(nn.Module):
    """A CLT in float32 unless moved (see the module's docstring for the parameters)."""

    def __init__(self, shape: CltShape) -> None:
        super().__init__()
        self.shape = shape
        n, d, f = shape.n_layers, shape.d_model, shape.d_sae
        self.W_enc = nn.Parameter(torch.zeros(n, d, f))
        self.b_enc = nn.Parameter(torch.zeros(n, f))
        self.W_dec = nn.ParameterList([nn.Parameter(torch.zeros(f, n - layer, d)) for layer in range(n)])
        self.b_dec = nn.Parameter(torch.zeros(n, d))
        self.threshold = nn.Parameter(torch.zeros(n, f), requires_grad=False)
        self.W_skip = nn.Parameter(torch.zeros(n, d, d)) if shape.skip else None

    @property
    def n_layers(self) -> int:
        return self.shape.n_layers

    def pre_activations(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_enc[layer] + b_enc[layer]`` for layer ``layer``'s MLP inputs ``x`` [..., d_model]."""
        return x.to(self.W_enc.dtype) @ self.W_enc[layer] + self.b_enc[layer]

    def activate(self, layer: int, hidden_pre: torch.Tensor) -> torch.Tensor:
        if self.shape.activation == "jumprelu":
            return hidden_pre * (hidden_pre > self.threshold[layer])
        return torch.relu(hidden_pre)

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s features [..., d_sae] from its MLP input ``x``."""
        return self.activate(layer, self.pre_activations(layer, x))

    def decode_to(self, source: int, target: int, features: torch.Tensor) -> torch.Tensor:
        """What layer ``source``'s ``features`` [..., d_sae] write into layer ``target``'s MLP
        output (no bias; zero before ``source``)."""
        if target < source:
            return features.new_zeros(*features.shape[:-1], self.shape.d_model)
        return features.to(self.W_enc.dtype) @ self.W_dec[source][:, target - source]

    def skip_path(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.W_skip is None else x.to(self.W_skip.dtype) @ self.W_skip[layer]

    def reconstruct(self, layer: int, features: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s predicted MLP output from every layer's ``features`` so far (index
        ``l`` for layer ``l``, at least up to ``layer``) and its own MLP input ``x``."""
        out = self.b_dec[layer] + sum(
            self.decode_to(source, layer, features[source]) for source in range(layer + 1)
        )
        skip = self.skip_path(layer, x)
        return out if skip is None else out + skip

    def tensors(self) -> dict[str, torch.Tensor]:
        """The parameters by name (``W_dec.{layer}`` for each layer's decoders)."""
        return {name: tensor.detach() for name, tensor in self.state_dict().items() if tensor is not None}

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every layer's predicted MLP output from every layer's MLP input (lists, layer 0 first)."""
        features = [self.encode(layer, x) for layer, x in enumerate(inputs)]
        return [self.reconstruct(layer, features, x) for layer, x in enumerate(inputs)]


def save_clt(clt: CrossLayerTranscoder, folder: Path | str) -> Path:
    """Write ``clt`` in circuit-tracer's layout (what its ``load_clt`` reads) in ``folder``."""
    if clt.W_skip is not None:
        raise EngineError("UNSUPPORTED_SAE", "circuit-tracer's CLT files have no skip connection.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    thresholded = clt.shape.activation == "jumprelu"
    for layer in range(clt.n_layers):
        encoder = {
            f"W_enc_{layer}": clt.W_enc[layer].T,
            f"b_enc_{layer}": clt.b_enc[layer],
            f"b_dec_{layer}": clt.b_dec[layer],
        }
        if thresholded:
            encoder[f"threshold_{layer}"] = clt.threshold[layer]
        save_file(_plain(encoder), folder / f"W_enc_{layer}.safetensors")
        save_file(_plain({f"W_dec_{layer}": clt.W_dec[layer]}), folder / f"W_dec_{layer}.safetensors")
    return folder


def _plain(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}


def _numbered(folder: Path, pattern: str) -> list[Path]:
    """``folder``'s files named by ``pattern`` (one ``{}`` for the layer), layers 0..n-1, or
    ``INVALID_SAE`` when one is missing."""
    regex = re.compile(re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")
    layers = sorted(int(match[1]) for path in folder.iterdir() if (match := regex.match(path.name)))
    if not layers or layers != list(range(len(layers))):
        raise EngineError(
            "INVALID_SAE", f"Not a CLT folder: {pattern.format(0)}, {pattern.format(1)}, ... (none missing)."
        )
    return [folder / pattern.format(layer) for layer in layers]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(path, framework="pt") as file:
            return {name: file.get_tensor(name).float() for name in file.keys()}  # noqa: SIM118
    except (OSError, ValueError, SafetensorError) as error:
        raise EngineError("INVALID_SAE", f"{path.name} is not safetensors: {type(error).__name__}.") from None


def _built(
    *,
    W_enc: list[torch.Tensor],
    b_enc: list[torch.Tensor],
    W_dec: list[torch.Tensor],
    b_dec: list[torch.Tensor],
    threshold: list[torch.Tensor] | None,
    W_skip: list[torch.Tensor] | None,
) -> CrossLayerTranscoder:
    n_layers = len(W_enc)
    d_model, d_sae = W_enc[0].shape
    expected = {
        "W_enc": (W_enc, lambda layer: (d_model, d_sae)),
        "b_enc": (b_enc, lambda layer: (d_sae,)),
        "W_dec": (W_dec, lambda layer: (d_sae, n_layers - layer, d_model)),
        "b_dec": (b_dec, lambda layer: (d_model,)),
        "threshold": (threshold or [], lambda layer: (d_sae,)),
        "W_skip": (W_skip or [], lambda layer: (d_model, d_model)),
    }
    for name, (tensors, shape_of) in expected.items():
        for layer, tensor in enumerate(tensors):
            if tuple(tensor.shape) != shape_of(layer):
                raise EngineError(
                    "INVALID_SAE",
                    f"{name} of layer {layer} is {list(tensor.shape)}, not {list(shape_of(layer))}.",
                )
    clt = CrossLayerTranscoder(
        CltShape(
            n_layers=n_layers, d_model=d_model, d_sae=d_sae,
            activation="relu" if threshold is None else "jumprelu", skip=W_skip is not None,
        )
    )  # fmt: skip
    with torch.no_grad():
        clt.W_enc.copy_(torch.stack(W_enc))
        clt.b_enc.copy_(torch.stack(b_enc))
        clt.b_dec.copy_(torch.stack(b_dec))
        for layer, decoder in enumerate(W_dec):
            clt.W_dec[layer].copy_(decoder)
        if threshold is not None:
            clt.threshold.copy_(torch.stack(threshold))
        if W_skip is not None:
            clt.W_skip.copy_(torch.stack(W_skip))
    return clt


def load_clt(folder: Path | str) -> CrossLayerTranscoder:
    """The CLT in a folder of circuit-tracer's layout (what :func:`save_clt` writes)."""
    folder = Path(folder)
    encoders = [_tensors(path) for path in _numbered(folder, "W_enc_{}.safetensors")]
    decoders = _numbered(folder, "W_dec_{}.safetensors")
    if len(decoders) != len(encoders):
        raise EngineError("INVALID_SAE", f"{len(encoders)} encoder files and {len(decoders)} decoder files.")
    try:
        return _built(
            W_enc=[tensors[f"W_enc_{layer}"].T for layer, tensors in enumerate(encoders)],
            b_enc=[tensors[f"b_enc_{layer}"] for layer, tensors in enumerate(encoders)],
            b_dec=[tensors[f"b_dec_{layer}"] for layer, tensors in enumerate(encoders)],
            W_dec=[_tensors(path)[f"W_dec_{layer}"] for layer, path in enumerate(decoders)],
            threshold=(
                [tensors[f"threshold_{layer}"] for layer, tensors in enumerate(encoders)]
                if "threshold_0" in encoders[0] else None
            ),
            W_skip=None,
        )  # fmt: skip
    except KeyError as error:
        raise EngineError("INVALID_SAE", f"A CLT file lacks {error.args[0]}.") from None


def load_gemma_scope_2_clt(paths: list[Path | str]) -> CrossLayerTranscoder:
    """The CLT in Gemma Scope 2's per-layer files (layer 0 first): ``w_enc`` [d_model, d_sae],
    ``w_dec`` [d_sae, n_layers, d_model] (zero into earlier layers), ``b_enc``, ``b_dec`` (this
    layer's output bias), ``threshold`` and, optionally, ``affine_skip_connection``."""
    layers = [_tensors(Path(path)) for path in paths]
    try:
        skip = (
            [tensors["affine_skip_connection"] for tensors in layers]
            if "affine_skip_connection" in layers[0]
            else None
        )
        return _built(
            W_enc=[tensors["w_enc"] for tensors in layers],
            b_enc=[tensors["b_enc"] for tensors in layers],
            W_dec=[tensors["w_dec"][:, layer:] for layer, tensors in enumerate(layers)],
            b_dec=[tensors["b_dec"] for tensors in layers],
            threshold=[tensors["threshold"] for tensors in layers],
            W_skip=skip,
        )
    except KeyError as error:
        raise EngineError("INVALID_SAE", f"A Gemma Scope 2 CLT file lacks {error.args[0]}.") from None
