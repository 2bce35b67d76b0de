"""What attribution and interventions ask of the transcoders that replace a model's MLPs, for one
transcoder per layer and for a cross-layer transcoder (CLT) alike.

A feature of layer ``l`` reads layer ``l``'s MLP input and writes into the MLP outputs of
:meth:`Replacement.targets` ``(l)``: layer ``l`` alone for a per-layer transcoder, layers
``l..n_layers-1`` for a CLT. Everything else (the recorded pass, the adjacency rows, node values,
interventions) is written once against this interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.errors import EngineError

if TYPE_CHECKING:
    from torch import Tensor, nn
    from transformers import PreTrainedModel

    from engine.sae.clt import CrossLayerTranscoder
    from engine.sae.model import SparseAutoencoder

__all__ = ["CrossLayerReplacement", "PerLayerReplacement", "Replacement", "replacement_of"]


class Replacement:
    """The shared interface (see the module's docstring); ``features`` are feature indices."""

    n_layers: int
    modules: list[nn.Module]

    def d_sae(self, layer: int) -> int:
        raise NotImplementedError

    def width(self) -> tuple[int, int]:
        """(input width, output width) every layer reads and writes."""
        raise NotImplementedError

    def encode(self, layer: int, x: Tensor) -> Tensor:
        raise NotImplementedError

    def pre_activations(self, layer: int, x: Tensor, features: Tensor) -> Tensor:
        """Rows ``x`` [n, d]'s pre-activation of ``features`` [n] (one feature per row)."""
        raise NotImplementedError

    def encoder_rows(self, layer: int, features: Tensor) -> Tensor:
        """[n, d]: what each feature reads."""
        raise NotImplementedError

    def targets(self, layer: int) -> range:
        """The layers whose MLP outputs a feature of ``layer`` writes into."""
        raise NotImplementedError

    def decoder_rows(self, source: int, target: int, features: Tensor) -> Tensor:
        """[n, d]: what each feature of layer ``source`` writes into layer ``target``."""
        raise NotImplementedError

    def reconstruct(self, layer: int, features: Sequence[Tensor], x: Tensor) -> Tensor:
        """Layer ``layer``'s predicted MLP output from every layer's features so far and its input."""
        raise NotImplementedError

    def decode_change(self, layer: int, changes: Sequence[Tensor | None]) -> Tensor | None:
        """What changed features (``changes[l]`` for layer ``l`` up to ``layer``; None: none
        changed) add to layer ``layer``'s MLP output, or None when nothing reaches it."""
        total = None
        for source in range(layer + 1):
            change = changes[source]
            if change is not None and layer in self.targets(source):
                part = self.decode_dense(source, layer, change)
                total = part if total is None else total + part
        return total

    def decode_dense(self, source: int, target: int, features: Tensor) -> Tensor:
        raise NotImplementedError

    def skip_path(self, layer: int, x: Tensor) -> Tensor | None:
        raise NotImplementedError

    def problems(self, n_layers: int, width: int) -> list[str]:
        """What keeps it from replacing every MLP of a model of ``n_layers`` layers, ``width`` wide."""
        raise NotImplementedError


class PerLayerReplacement(Replacement):
    """One transcoder per layer, layer 0 first (circuit-tracer's ``TranscoderSet``)."""

    def __init__(self, transcoders: Sequence[SparseAutoencoder]) -> None:
        self.transcoders = list(transcoders)
        self.n_layers = len(self.transcoders)
        self.modules = list(self.transcoders)

    def d_sae(self, layer: int) -> int:
        return self.transcoders[layer].shape.d_sae

    def width(self) -> tuple[int, int]:
        return (self.transcoders[0].shape.d_in, self.transcoders[0].shape.output_width)

    def encode(self, layer: int, x: Tensor) -> Tensor:
        return self.transcoders[layer].encode(x)

    def pre_activations(self, layer: int, x: Tensor, features: Tensor) -> Tensor:
        transcoder = self.transcoders[layer]
        encoder = transcoder.W_enc[:, features]
        pre = (x.to(encoder.dtype) * encoder.T).sum(-1)
        if transcoder.shape.apply_b_dec_to_input:
            pre = pre - transcoder.b_dec @ encoder
        return pre + transcoder.b_enc[features]

    def encoder_rows(self, layer: int, features: Tensor) -> Tensor:
        return self.transcoders[layer].W_enc[:, features].T

    def targets(self, layer: int) -> range:
        return range(layer, layer + 1)

    def decoder_rows(self, source: int, target: int, features: Tensor) -> Tensor:
        return self.transcoders[source].W_dec[features]

    def decode_dense(self, source: int, target: int, features: Tensor) -> Tensor:
        return features @ self.transcoders[source].W_dec

    def reconstruct(self, layer: int, features: Sequence[Tensor], x: Tensor) -> Tensor:
        transcoder = self.transcoders[layer]
        out = transcoder.decode(features[layer])
        skip = transcoder.skip_path(x)
        return out if skip is None else out + skip

    def skip_path(self, layer: int, x: Tensor) -> Tensor | None:
        return self.transcoders[layer].skip_path(x)

    def problems(self, n_layers: int, width: int) -> list[str]:
        problems = []
        if self.n_layers != n_layers:
            problems.append(f"the model has {n_layers} layers and {self.n_layers} transcoders were given")
        for layer, transcoder in enumerate(self.transcoders):
            shape = transcoder.shape
            if not shape.is_transcoder or shape.d_in != width or shape.output_width != width:
                problems.append(f"layer {layer}: not a {width}-wide transcoder")
        return problems


class CrossLayerReplacement(Replacement):
    """One cross-layer transcoder (:mod:`engine.sae.clt`)."""

    def __init__(self, clt: CrossLayerTranscoder) -> None:
        self.clt = clt
        self.n_layers = clt.n_layers
        self.modules = [clt]

    def d_sae(self, layer: int) -> int:
        return self.clt.shape.d_sae

    def width(self) -> tuple[int, int]:
        return (self.clt.shape.d_model, self.clt.shape.d_model)

    def encode(self, layer: int, x: Tensor) -> Tensor:
        return self.clt.encode(layer, x)

    def pre_activations(self, layer: int, x: Tensor, features: Tensor) -> Tensor:
        encoder = self.clt.W_enc[layer][:, features]
        return (x.to(encoder.dtype) * encoder.T).sum(-1) + self.clt.b_enc[layer][features]

    def encoder_rows(self, layer: int, features: Tensor) -> Tensor:
        return self.clt.W_enc[layer][:, features].T

    def targets(self, layer: int) -> range:
        return range(layer, self.n_layers)

    def decoder_rows(self, source: int, target: int, features: Tensor) -> Tensor:
        return self.clt.W_dec[source][features, target - source]

    def decode_dense(self, source: int, target: int, features: Tensor) -> Tensor:
        return self.clt.decode_to(source, target, features)

    def reconstruct(self, layer: int, features: Sequence[Tensor], x: Tensor) -> Tensor:
        return self.clt.reconstruct(layer, list(features), x)

    def skip_path(self, layer: int, x: Tensor) -> Tensor | None:
        return self.clt.skip_path(layer, x)

    def problems(self, n_layers: int, width: int) -> list[str]:
        problems = []
        if self.n_layers != n_layers:
            problems.append(f"the model has {n_layers} layers and the CLT {self.n_layers}")
        if self.width() != (width, width):
            problems.append(f"the CLT is {self.width()[0]} wide, the model {width}")
        return problems


def replacement_of(
    transcoders: Sequence[SparseAutoencoder] | CrossLayerTranscoder | Replacement,
) -> Replacement:
    """The :class:`Replacement` of one transcoder per layer, or of a CLT."""
    from engine.sae.clt import CrossLayerTranscoder  # (torch: imported where the work is done)

    if isinstance(transcoders, Replacement):
        return transcoders
    if isinstance(transcoders, CrossLayerTranscoder):
        return CrossLayerReplacement(transcoders)
    return PerLayerReplacement(transcoders)


def check_replacement(model: PreTrainedModel, replacement: Replacement) -> None:
    """``INVALID_TRANSCODERS`` unless the replacement covers every layer, as wide as the model."""
    from engine.attribution.frozen import model_parts

    problems = replacement.problems(model_parts(model).n_layers, int(model.config.hidden_size))
    if problems:
        raise EngineError(
            "INVALID_TRANSCODERS",
            "Attribution needs one transcoder per layer or a cross-layer transcoder over every layer: "
            + "; ".join(problems),
        )
