"""The sparse autoencoder itself: parameters, encode, decode, in SAELens' conventions.

Parameters and shapes are SAELens': ``W_enc`` [d_in, d_sae], ``W_dec`` [d_sae, d_in], ``b_enc``
[d_sae], ``b_dec`` [d_in], and ``threshold`` [d_sae] for JumpReLU. Encoding subtracts ``b_dec``
from the input first (SAELens' ``apply_b_dec_to_input``, on by default; off for Gemma Scope):

* ``standard``: ``relu(h)``;
* ``topk``: the ``k`` largest pre-activations of each row, rectified, the rest zero;
* ``batchtopk``: in training, the ``k * rows`` largest over the whole batch; for inference it is
  a JumpReLU with one threshold learnt in training (what SAELens saves it as);
* ``jumprelu``: ``relu(h) * (h > threshold)``, strictly greater;
* ``matryoshka_batchtopk``: BatchTopK whose nested prefixes of the dictionary (the first
  ``matryoshka_widths[i]`` features) are each trained to reconstruct on their own (Bussmann et
  al. 2025, Nabeshima 2024); at inference a JumpReLU like ``batchtopk``;

where ``h = (x - b_dec) @ W_enc + b_enc``. Decoding is ``f @ W_dec + b_dec``.

A **transcoder** reads one hook point and predicts another (``d_out`` wide, typically the MLP's
output from its input): ``b_dec`` lives in the output space, so it is not subtracted from the
input, and a *skip* transcoder adds a linear path ``x @ W_skip.T`` (``W_skip`` [d_out, d_in],
SAELens' ``SkipTranscoder``) to the decoded features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.sae_architectures import ARCHITECTURES, BATCH_WIDE, K_SPARSE, THRESHOLDED


@dataclass(frozen=True)
class SaeShape:
    """What fixes an SAE's parameters and activation function."""

    architecture: str
    d_in: int
    d_sae: int
    # Features kept per row (topk) or per row on average (batchtopk); None for the others.
    k: int | None = None
    apply_b_dec_to_input: bool = True
    # A transcoder's output width (None: an SAE, which reconstructs its input) and skip path.
    d_out: int | None = None
    skip: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}")
        if self.architecture in K_SPARSE and not (self.k and 0 < self.k <= self.d_sae):
            raise ValueError(f"{self.architecture} needs 0 < k <= d_sae")
        if self.skip and self.d_out is None:
            raise ValueError("a skip connection needs a transcoder (d_out)")

    @property
    def is_transcoder(self) -> bool:
        return self.d_out is not None

    @property
    def output_width(self) -> int:
        return self.d_out if self.d_out is not None else self.d_in


class SparseAutoencoder(nn.Module):
    """An SAE of any of :data:`ARCHITECTURES`, in float32 unless moved."""

    def __init__(self, shape: SaeShape) -> None:
        super().__init__()
        self.shape = shape
        d_in, d_sae, d_out = shape.d_in, shape.d_sae, shape.output_width
        self.W_enc = nn.Parameter(torch.zeros(d_in, d_sae))
        self.W_dec = nn.Parameter(torch.zeros(d_sae, d_out))
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.b_dec = nn.Parameter(torch.zeros(d_out))
        self.W_skip = nn.Parameter(torch.zeros(d_out, d_in)) if shape.skip else None
        # JumpReLU's threshold; for batchtopk the inference threshold (one value, repeated).
        self.threshold = nn.Parameter(torch.zeros(d_sae), requires_grad=False)

    @property
    def architecture(self) -> str:
        return self.shape.architecture

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        sae_in = x.to(self.W_enc.dtype)
        if self.shape.apply_b_dec_to_input:
            sae_in = sae_in - self.b_dec
        return sae_in @ self.W_enc + self.b_enc

    def activate(self, hidden_pre: torch.Tensor, *, training: bool = False) -> torch.Tensor:
        """The feature activations of pre-activations ``hidden_pre`` [..., d_sae].

        ``training`` matters for batchtopk only: the batch-wide top ``k * rows`` instead of the
        learnt threshold.
        """
        architecture = self.architecture
        if architecture == "standard":
            return hidden_pre.relu()
        if architecture == "topk":
            return topk_activations(hidden_pre, self.shape.k)
        if architecture in BATCH_WIDE and training:
            return batch_topk_activations(hidden_pre, self.shape.k)
        return jumprelu(hidden_pre, self.threshold)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.activate(self.pre_activations(x))

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.W_dec + self.b_dec

    def decode_sparse(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``decode`` of features given as the ``values`` [rows, n] at ``indices`` [rows, n] (zero
        elsewhere): ``n`` rows of ``W_dec`` gathered per row instead of a dense [rows, d_sae] product,
        which for TopK's few active features is far less work, forward and backward."""
        weights = values.to(self.W_dec.dtype)
        return (
            nn.functional.embedding_bag(indices, self.W_dec, per_sample_weights=weights, mode="sum")
            + self.b_dec
        )

    def skip_path(self, x: torch.Tensor) -> torch.Tensor | None:
        """A skip transcoder's linear term ``x @ W_skip.T``; None without one."""
        return None if self.W_skip is None else x.to(self.W_skip.dtype) @ self.W_skip.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.decode(self.encode(x))
        skip = self.skip_path(x)
        return out if skip is None else out + skip

    def tensors(self) -> dict[str, torch.Tensor]:
        """The parameters as SAELens stores them (``threshold`` only where it means something)."""
        names = ["W_enc", "W_dec", "b_enc", "b_dec"]
        if self.architecture in THRESHOLDED:
            names.append("threshold")
        if self.W_skip is not None:
            names.append("W_skip")
        return {name: getattr(self, name).detach().contiguous() for name in names}


def topk_activations(hidden_pre: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest pre-activations, rectified; zeros elsewhere (SAELens' TopK)."""
    values, indices = hidden_pre.topk(k, dim=-1, sorted=False)
    return torch.zeros_like(hidden_pre).scatter(-1, indices, values.relu())


def batch_topk_activations(hidden_pre: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k * rows`` largest rectified pre-activations over the whole batch; zeros elsewhere."""
    flat = hidden_pre.relu().reshape(-1)
    rows = hidden_pre.numel() // hidden_pre.shape[-1]
    values, indices = flat.topk(min(k * rows, flat.numel()), sorted=False)
    return torch.zeros_like(flat).scatter(0, indices, values).reshape(hidden_pre.shape)


def jumprelu(hidden_pre: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``relu(h) * (h > threshold)``: a feature fires only strictly above its threshold."""
    return hidden_pre.relu() * (hidden_pre > threshold)
