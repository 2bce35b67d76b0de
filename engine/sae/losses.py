"""The sparsity parts of the training losses: JumpReLU's straight-through functions (a rectangle
kernel's pseudo-derivative for the threshold, Rajamanoharan et al. 2024) and TopK's AuxK."""

from __future__ import annotations

import math

import torch

from engine.sae.model import SparseAutoencoder

__all__ = ["JumpReLUFunction", "StepFunction", "aux_k_loss"]


def _rectangle(x: torch.Tensor) -> torch.Tensor:
    return ((x > -0.5) & (x < 0.5)).to(x)


class JumpReLUFunction(torch.autograd.Function):
    """``x * (x > threshold)``; the threshold's gradient through a rectangle-kernel estimate."""

    @staticmethod
    def forward(ctx, x, threshold, bandwidth):
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return x * (x > threshold).to(x)

    @staticmethod
    def backward(ctx, grad_output):
        x, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        x_grad = (x > threshold).to(x) * grad_output
        threshold_grad = (
            -(threshold / bandwidth) * _rectangle((x - threshold) / bandwidth) * grad_output
        ).sum(dim=0)
        return x_grad, threshold_grad, None


class StepFunction(torch.autograd.Function):
    """``x > threshold`` as 0/1; the threshold's gradient through the same kernel estimate."""

    @staticmethod
    def forward(ctx, x, threshold, bandwidth):
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x)

    @staticmethod
    def backward(ctx, grad_output):
        x, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        threshold_grad = (-(1.0 / bandwidth) * _rectangle((x - threshold) / bandwidth) * grad_output).sum(
            dim=0
        )
        return torch.zeros_like(x), threshold_grad, None


def aux_k_loss(
    sae: SparseAutoencoder, x: torch.Tensor, recon: torch.Tensor, hidden_pre: torch.Tensor, dead: torch.Tensor
) -> torch.Tensor:
    """Dead features, ``k_aux`` of them per row, reconstruct the live ones' residual (AuxK)."""
    num_dead = int(dead.sum())
    if num_dead == 0:
        return x.new_zeros(())
    k_aux = x.shape[-1] // 2
    scale = min(num_dead / k_aux, 1.0)
    k_aux = min(k_aux, num_dead)
    masked = torch.where(dead, hidden_pre, torch.full_like(hidden_pre, -math.inf))
    values, indices = masked.topk(k_aux, dim=-1, sorted=False)
    residual = (x - recon).detach()
    aux_recon = sae.decode_sparse(values.relu(), indices) - sae.b_dec
    return scale * (aux_recon - residual).pow(2).sum(-1).mean()
