"""The sparse autoencoder itself: parameters, encode, decode, in SAELens' conventions.

Parameters and shapes are SAELens': ``W_enc`` [d_in, d_sae], ``W_dec`` [d_sae, d_in], ``b_enc``
[d_sae], ``b_dec`` [d_in], and ``threshold`` [d_sae] for JumpReLU. Encoding subtracts ``b_dec``
from the input first (SAELens' ``apply_b_dec_to_input``, on by default; off for Gemma Scope).
The activation function of ``h`` is the registered architecture's (:mod:`engine.sae_architectures`:
``standard`` ReLU, ``topk``, ``batchtopk`` and ``matryoshka_batchtopk`` in training and their
JumpReLU at inference, ``jumprelu``),
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

from engine.sae_architectures import ARCHITECTURES, Architecture, MemberKind, architecture_named, member_kind

__all__ = ["ARCHITECTURES", "SaeShape", "SparseAutoencoder"]


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
        self.kind.check_shape(k=self.k, d_sae=self.d_sae)
        _ = self.member

    @property
    def kind(self) -> Architecture:
        """The registered architecture (ValueError for an unknown name)."""
        return architecture_named(self.architecture)

    @property
    def member(self) -> MemberKind:
        """SAE, transcoder or skip transcoder."""
        return member_kind(transcoder=self.d_out is not None, skip=self.skip)

    @property
    def is_transcoder(self) -> bool:
        return self.member.transcoder

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
        self.W_skip = (
            nn.Parameter(torch.zeros(d_out, d_in)) if "W_skip" in shape.member.extra_parameters else None
        )
        # JumpReLU's threshold; for batchtopk the inference threshold (one value, repeated).
        self.threshold = nn.Parameter(torch.zeros(d_sae), requires_grad=False)

    @property
    def architecture(self) -> str:
        return self.shape.architecture

    @property
    def kind(self) -> Architecture:
        return self.shape.kind

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        sae_in = x.to(self.W_enc.dtype)
        if self.shape.apply_b_dec_to_input:
            sae_in = sae_in - self.b_dec
        return sae_in @ self.W_enc + self.b_enc

    def activate(self, hidden_pre: torch.Tensor, *, training: bool = False) -> torch.Tensor:
        """The feature activations of pre-activations ``hidden_pre`` [..., d_sae].

        ``training``: the training form where it differs (BatchTopK's batch-wide top ``k * rows``
        instead of the learnt threshold).
        """
        if training:
            return self.kind.activate_training(self, hidden_pre)
        return self.kind.activate(self, hidden_pre)

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
        names = [
            "W_enc", "W_dec", "b_enc", "b_dec",
            *(["threshold"] if self.kind.thresholded else []),
            *self.shape.member.extra_parameters,
        ]  # fmt: skip
        return {name: getattr(self, name).detach().contiguous() for name in names}
