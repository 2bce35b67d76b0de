"""A sparse autoencoder with random weights, for tests that need one whose features fire."""

from __future__ import annotations

from engine.sae import SaeShape, SparseAutoencoder


def random_sae(
    width: int, architecture: str = "standard", *, k: int | None = None, expansion: int = 4, seed: int = 7
) -> SparseAutoencoder:
    """An SAE of ``expansion * width`` features whose weights and biases are all drawn from
    N(0, 0.3²) with ``seed`` (large enough biases that many features fire on any input)."""
    import torch

    sae = SparseAutoencoder(SaeShape(architecture, width, expansion * width, k=k))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            parameter = getattr(sae, name)
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return sae.eval()


def random_transcoders(
    model,
    architecture: str = "standard",
    *,
    skip: bool = False,
    k: int | None = None,
    expansion: int = 4,
    seed: int = 0,
) -> list[SparseAutoencoder]:
    """One random transcoder per layer of ``model`` (MLP input to MLP output, ``expansion`` times
    the hidden size), weights N(0, 1/width) and encoder biases shifted down by 0.5, so that a fair
    share of features fire: JumpReLU thresholds at 0.05."""
    import math

    import torch

    width = int(model.config.hidden_size)
    transcoders = []
    for layer in range(int(model.config.num_hidden_layers)):
        shape = SaeShape(
            architecture, width, expansion * width, k, apply_b_dec_to_input=False, d_out=width, skip=skip
        )
        transcoder = SparseAutoencoder(shape)
        generator = torch.Generator().manual_seed(seed * 1000 + layer)
        with torch.no_grad():
            for parameter in transcoder.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(width))
            transcoder.b_enc.sub_(0.5)
            transcoder.threshold.fill_(0.05)
        transcoders.append(transcoder.eval())
    return transcoders


def random_clt(model, *, activation: str = "relu", skip: bool = False, expansion: int = 2, seed: int = 0):
    """A random cross-layer transcoder over every layer of ``model`` (``expansion`` times the
    hidden size per layer), drawn as :func:`random_transcoders` draws its transcoders, each decoder
    into a later layer scaled by 1/2 per layer it skips."""
    import math

    import torch

    from engine.sae.clt import CltShape, CrossLayerTranscoder

    width = int(model.config.hidden_size)
    n_layers = int(model.config.num_hidden_layers)
    clt = CrossLayerTranscoder(
        CltShape(n_layers=n_layers, d_model=width, d_sae=expansion * width, activation=activation, skip=skip)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in clt.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(width))
        for decoder in clt.W_dec:
            decoder.mul_(0.5 ** torch.arange(decoder.shape[1])[None, :, None])
        clt.b_enc.sub_(0.5)
        clt.threshold.fill_(0.05)
    return clt.eval()


def trained_transcoders(
    model,
    token_batches,
    *,
    architecture: str = "jumprelu",
    k: int | None = None,
    expansion: int = 4,
    steps: int = 200,
    skip: bool = False,
) -> list[SparseAutoencoder]:
    """One transcoder per layer of ``model`` trained for ``steps`` steps on the MLP inputs and
    outputs of ``token_batches`` (lists of [batch, tokens] id tensors, unpadded); ``k`` for the
    k-sparse architectures (a BatchTopK one is a JumpReLU at inference, which circuit-tracer reads)."""
    import torch

    from engine.sae.clt_training import mlp_rows
    from engine.sae.training import SaeTrainer, TrainingConfig

    every_input, every_output = mlp_rows(model, token_batches)
    width = int(model.config.hidden_size)
    transcoders = []
    for layer in range(every_input.shape[1]):
        inputs, outputs = every_input[:, layer], every_output[:, layer]
        config = TrainingConfig(architecture=architecture, d_sae=expansion * width, k=k, batch_size=256,
                                total_tokens=256 * steps, warmup_steps=10, lr=3e-3, skip=skip)  # fmt: skip
        trainer = SaeTrainer(config, d_in=width, sample=inputs, d_out=width, sample_out=outputs)
        generator = torch.Generator().manual_seed(layer)
        for _ in range(steps):
            picked = torch.randint(len(inputs), (256,), generator=generator)
            trainer.step(inputs[picked], outputs[picked])
        transcoders.append(trainer.finish(inputs).sae.eval())
    return transcoders
