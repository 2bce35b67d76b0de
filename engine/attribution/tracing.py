"""Attribution: the direct effect of every active transcoder feature, error and input token on
every feature and on the top logits, in circuit-tracer's conventions, through one transcoder per
layer or a cross-layer transcoder (whose features write into their layer's MLP output and every
later one's: :mod:`engine.attribution.replacement` says which vectors reach which layer).

One pass over the prompt (batch 1) records the frozen attention patterns and norm scales, the
transcoders' activations, the errors and the logits. Position 0 is the attention sink (a special
token is put there by :func:`attribution_tokens`): its features and error are zeroed, and its real
MLP output is a constant. A second pass runs ``batch_size`` copies of the prompt with gradients
on, each MLP's output cut from its input except through a transcoder's linear skip path. Then,
``batch_size`` targets at a time, one backward pass injects each target's input direction (a
feature's encoder row at its layer's MLP input, or a logit's demeaned unembedding row at the final
norm's output) into its own row of the batch, and the gradients reaching each MLP output, token
embedding are contracted with the sources' vectors (a feature's activation times its decoder row,
an error, a token's embedding): one row of the adjacency matrix per target.

Memory stays bounded: feature activations are kept sparse; targets go ``batch_size`` at a time;
``max_feature_nodes`` caps the feature rows, visiting features in order of their influence on the
logits (estimated from the rows so far and refreshed every ``update_interval`` batches, as
circuit-tracer does), so a long prompt keeps the most influential features rather than failing.
A third, cheap pass with every source at zero gives each node's bias (see
:class:`engine.attribution.graph.AttributionGraph`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from engine.attribution.frozen import FrozenRun
from engine.attribution.graph import AttributionGraph
from engine.attribution.pruning import partial_influences
from engine.attribution.replacement import Replacement, check_replacement, replacement_of
from engine.budgets import attribution_feature_rows
from engine.errors import EngineError
from engine.readout import final_logit_cap, soft_cap

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from engine.sae.clt import CrossLayerTranscoder
    from engine.sae.model import SparseAutoencoder

__all__ = ["AttributionConfig", "Transcoders", "attribute", "attribution_tokens", "check_transcoders"]

# One transcoder per layer, layer 0 first (each reads the MLP's input and predicts its output), or
# one cross-layer transcoder (:mod:`engine.sae.clt`), whose features also write into later layers.
Transcoders: TypeAlias = "Sequence[SparseAutoencoder] | CrossLayerTranscoder | Replacement"


@dataclass(frozen=True)
class AttributionConfig:
    """circuit-tracer's ``attribute`` parameters, with its defaults."""

    max_n_logits: int = 10
    desired_logit_prob: float = 0.95
    batch_size: int = 64
    max_feature_nodes: int | None = None
    update_interval: int = 4
    # Bytes the graph's matrices may take: fewer feature nodes are kept when they would not fit
    # (the graph's ``info`` says so), so a long prompt is pruned earlier rather than failing.
    matrix_limit_bytes: int | None = None
    # What the graph explains (circuit-tracer's ``attribution_targets``), one of: nothing, the top
    # logits as above; ``target_tokens``, these tokens' logits (weighted by their probabilities);
    # ``target_difference`` (a, b), the one target logit(a) - logit(b), weighted 1.
    target_tokens: tuple[int, ...] | None = None
    target_difference: tuple[int, int] | None = None


def attribution_tokens(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The prompt's ids without special tokens, behind a special token at position 0 (BOS, else
    pad, else EOS, else the first special id), unless it already starts with one: what
    circuit-tracer attributes, since position 0 is an attention sink whose features are dropped."""
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    special = list(tokenizer.all_special_ids)
    if ids and ids[0] in special:
        return ids
    candidates = [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, *special]
    first = next((candidate for candidate in candidates if candidate is not None), None)
    return ids if first is None else [int(first), *ids]


def check_transcoders(model: PreTrainedModel, transcoders: Transcoders) -> Replacement:
    """The transcoders' :class:`Replacement`, or ``INVALID_TRANSCODERS`` unless there is one
    transcoder per layer (or a CLT over every layer), as wide as the model."""
    replacement = replacement_of(transcoders)
    check_replacement(model, replacement)
    return replacement


@dataclass
class _Prompt:
    """What the recorded pass found: per layer, the sparse activations and the vectors."""

    ids: Tensor  # [1, positions]
    active: Tensor  # [n_active, 3] int64 (layer, position, feature), by layer
    values: Tensor  # [n_active]
    encoders: Tensor  # [n_active, d]
    # Per layer m: the active features writing into its MLP output, a contiguous range of
    # ``active`` (start, end), and what each writes there (activation times decoder row) [end - start, d].
    decoders: list[tuple[int, int, Tensor]]
    errors: Tensor  # [layers, positions, d]
    mlp_inputs: list[Tensor]  # per layer, [positions, d]
    mlp_outputs: list[Tensor]  # per layer, [positions, d]
    final: Tensor  # [positions, d]


def attribute(
    model: PreTrainedModel,
    transcoders: Transcoders,
    tokens: Sequence[int],
    config: AttributionConfig = AttributionConfig(),
    *,
    progress: Callable[[int, int], None] | None = None,
) -> AttributionGraph:
    """The attribution graph of ``tokens`` (see :func:`attribution_tokens`) through ``transcoders``.

    ``progress(done, total)`` is called after each batch of targets; it may raise to stop.
    """
    import torch

    transcoders = check_transcoders(model, transcoders)
    device = next(model.parameters()).device
    ids = torch.tensor([list(tokens)], device=device)
    run = FrozenRun(model)
    with _gradients_only_where_asked(model, transcoders.modules):
        prompt = _record(run, transcoders, ids)
        unembedding = model.get_output_embeddings().weight
        logits = soft_cap((prompt.final[-1] @ unembedding.T).float(), final_logit_cap(model))
        logit_ids, weights, logit_vectors, target = _targets(config, logits, unembedding)
        edges, selected = _edges(run, transcoders, prompt, logit_vectors, weights, config, progress)
        values, bias = _values_and_bias(run, transcoders, prompt, logit_vectors, selected)
    n_active = len(prompt.active)
    n_logits = len(logit_ids)
    n_positions = ids.shape[1]
    n_layers = transcoders.n_layers
    return AttributionGraph(
        tokens=[int(t) for t in tokens],
        n_layers=n_layers,
        active_features=prompt.active.cpu(),
        activation_values=prompt.values.float().cpu(),
        selected_features=selected.cpu(),
        adjacency=edges,
        logit_tokens=logit_ids.cpu(),
        logit_probabilities=weights.float().cpu(),
        bias=bias,
        values=values,
        info={
            "active_features": n_active,
            "feature_nodes": len(selected),
            "positions": n_positions,
            "logits": n_logits,
            "capped": len(selected) < n_active,
            **({"target": target} if target else {}),
        },
    )


def _targets(
    config: AttributionConfig, logits: Tensor, unembedding: Tensor
) -> tuple[Tensor, Tensor, Tensor, dict]:
    """The logit nodes: their token ids [n], weights [n] (probabilities), input directions [n, d]
    and, for targets other than the top logits, what they are (the graph's ``info["target"]``).

    The model's own probabilities (Gemma 2's soft-cap included) choose and weigh the logits; each
    is attributed before the soft-cap, where the replacement model is linear. A token's direction
    is its demeaned unembedding row; a difference's, the difference of the two rows."""
    import torch

    probabilities = torch.softmax(logits, -1)
    vocabulary = len(probabilities)
    if config.target_difference is not None:
        first, second = (int(token) for token in config.target_difference)
        _check_tokens([first, second], vocabulary)
        vectors = (unembedding[first] - unembedding[second])[None]
        ids, weights = torch.tensor([first], device=logits.device), torch.ones(1, device=logits.device)
        return ids, weights, vectors, {"kind": "difference", "tokens": [first, second]}
    if config.target_tokens is not None:
        chosen = [int(token) for token in config.target_tokens]
        _check_tokens(chosen, vocabulary)
        ids = torch.tensor(chosen, device=logits.device)
        weights, target = probabilities[ids], {"kind": "tokens", "tokens": chosen}
    else:
        top, top_ids = probabilities.topk(min(config.max_n_logits, vocabulary))
        cutoff = int(torch.searchsorted(top.cumsum(0), config.desired_logit_prob)) + 1
        ids, weights, target = top_ids[:cutoff], top[:cutoff], {}
    return ids, weights, unembedding[ids] - unembedding.mean(0, keepdim=True), target


def _check_tokens(tokens: list[int], vocabulary: int) -> None:
    if not tokens or any(not 0 <= token < vocabulary for token in tokens):
        raise EngineError("INVALID_TARGET", f"Target tokens must be 1 or more ids in [0, {vocabulary}).")


@contextlib.contextmanager
def _gradients_only_where_asked(model: PreTrainedModel, transcoders: list) -> Iterator[None]:
    """Gradients on (also under an outer inference or no-grad mode), none for the parameters of
    the model and the transcoders' modules, whose flags are restored after."""
    import torch

    modules = [model, *transcoders]
    flags = [(parameter, parameter.requires_grad) for module in modules for parameter in module.parameters()]
    try:
        for parameter, _ in flags:
            parameter.requires_grad_(False)
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for parameter, flag in flags:
            parameter.requires_grad_(flag)


def _record(run: FrozenRun, transcoders: Replacement, ids: Tensor) -> _Prompt:
    """The recorded pass over ``ids`` [1, positions]: activations, errors, encoder and decoder
    vectors, final norm output."""
    import torch

    mlp_inputs: list[Tensor] = []
    mlp_outputs: list[Tensor] = []
    final: list[Tensor] = []

    def mlp(layer: int, x_in: Tensor, out: Tensor) -> None:
        mlp_inputs.append(x_in[0].detach())
        mlp_outputs.append(out[0].detach())

    with torch.no_grad(), run.attached(mlp=mlp, final=final.append):
        run.forward(ids)
    active, values, encoders, errors, features = [], [], [], [], []
    with torch.no_grad():
        for layer in range(transcoders.n_layers):
            x_in = mlp_inputs[layer]
            activations = transcoders.encode(layer, x_in)
            activations[0] = 0  # (position 0 is constant: its features and error are dropped)
            features.append(activations)
            # The transcoders' output, from every feature reaching this layer, and its error.
            reconstruction = transcoders.reconstruct(layer, features, x_in)
            positions, indices = activations.nonzero(as_tuple=True)
            active.append(torch.stack([torch.full_like(positions, layer), positions, indices], 1))
            values.append(activations[positions, indices])
            encoders.append(transcoders.encoder_rows(layer, indices))
            error = mlp_outputs[layer].to(reconstruction.dtype) - reconstruction
            error[0] = 0
            errors.append(error)
        active_all, values_all = torch.cat(active), torch.cat(values)
        decoders = []
        bounds = torch.cumsum(torch.tensor([0] + [len(part) for part in active]), 0).tolist()
        for target in range(transcoders.n_layers):
            sources = [layer for layer in range(target + 1) if target in transcoders.targets(layer)]
            start, end = bounds[sources[0]], bounds[sources[-1] + 1]
            rows = [
                transcoders.decoder_rows(layer, target, active[layer][:, 2]) * values[layer][:, None]
                for layer in sources
            ]
            decoders.append((start, end, torch.cat(rows)))
    return _Prompt(
        ids=ids,
        active=active_all,
        values=values_all,
        encoders=torch.cat(encoders),
        decoders=decoders,
        errors=torch.stack(errors),
        mlp_inputs=mlp_inputs,
        mlp_outputs=mlp_outputs,
        final=final[0][0].detach(),
    )


class _SourcesByPosition:
    """The source vectors of one layer's MLP output (the activation-scaled decoder rows of the
    active features writing into it, then its error) laid out by position, [positions, most
    features at a position + 1, d], zero-padded, so that one batched matrix product contracts a
    batch's gradients with all of them: no gathered [batch, features, d] copy of the gradients."""

    def __init__(self, prompt: _Prompt, layer: int, n_positions: int) -> None:
        import torch

        start, end, decoders = prompt.decoders[layer]
        positions = prompt.active[start:end, 1]
        counts = torch.bincount(positions, minlength=n_positions)
        first = torch.cumsum(counts, 0) - counts
        # Each source's rank among those at its position (a CLT's range spans several layers,
        # each sorted by position).
        order = torch.argsort(positions, stable=True)
        ranks = torch.empty_like(positions)
        ranks[order] = torch.arange(end - start, device=positions.device) - first[positions[order]]
        self.width = int(counts.max()) if end > start else 0
        decoders = decoders.float()
        vectors = torch.zeros(n_positions, self.width + 1, decoders.shape[-1], device=decoders.device)
        vectors[positions, ranks] = decoders
        vectors[:, self.width] = prompt.errors[layer].float()
        self.vectors = vectors.transpose(1, 2)  # [positions, d, width + 1]
        self.flat = positions * self.width + ranks
        self.start, self.end = start, end

    def contract(self, gradient: Tensor, result: Tensor, *, error_offset: int) -> None:
        """Write each source's direct effect on each target (``gradient`` [targets, positions, d])
        into ``result`` [targets, sources] (float32): the features' columns and the layer's error
        columns."""
        import torch

        products = torch.bmm(
            gradient.float().transpose(0, 1), self.vectors
        )  # [positions, targets, width + 1]
        n_positions = products.shape[0]
        result[:, error_offset : error_offset + n_positions] = products[:, :, self.width].T
        if self.end > self.start:
            features = products[:, :, : self.width].permute(1, 0, 2).reshape(len(gradient), -1)
            result[:, self.start : self.end] += features[:, self.flat]


class _GradientGraph:
    """The batched pass with gradients, and the backward passes that give adjacency rows."""

    def __init__(self, run: FrozenRun, transcoders: Replacement, prompt: _Prompt, batch_size: int) -> None:
        self.prompt = prompt
        # Per layer [batch, positions, d]: the MLP inputs (where features' targets are injected)
        # and the points their outputs pass through (where sources' gradients are read).
        self.mlp_inputs: list[Tensor] = []
        self.mlp_points: list[Tensor] = []
        # One each: the token embeddings [batch, positions, d] (a leaf) and the final norm's output.
        self.embedding: list[Tensor] = []
        self.final: list[Tensor] = []

        def mlp(layer: int, x_in: Tensor, out: Tensor) -> Tensor:
            skip = transcoders.skip_path(layer, x_in)
            point = out.detach().requires_grad_(True) if skip is None else skip + (out - skip).detach()
            self.mlp_inputs.append(x_in)
            self.mlp_points.append(point)
            return point

        def embedding(tokens: Tensor) -> Tensor:
            leaf = tokens.detach().requires_grad_(True)
            self.embedding.append(leaf)
            return leaf

        with run.attached(mlp=mlp, embedding=embedding, final=self.final.append):
            run.forward(prompt.ids.expand(batch_size, -1))
        self.token_vectors = self.embedding[0][0].detach()
        n_positions = prompt.ids.shape[1]
        self.n_positions = n_positions
        self.sources_by_position = [
            _SourcesByPosition(prompt, layer, n_positions) for layer in range(transcoders.n_layers)
        ]
        self.n_sources = len(prompt.active) + (transcoders.n_layers + 1) * n_positions

    def rows(self, injections: list[tuple[int | None, int, Tensor]]) -> Tensor:
        """One adjacency row (over the sources) per ``(layer, position, vector [d])`` injection,
        [injections, sources] float32; layer None injects at the final norm's output (a logit)."""
        import torch

        outputs, gradients = [], []
        by_point: dict[int | None, list[int]] = {}
        for row, (layer, _, _) in enumerate(injections):
            by_point.setdefault(layer, []).append(row)
        for layer, rows in by_point.items():
            tensor = self.final[0] if layer is None else self.mlp_inputs[layer]
            gradient = torch.zeros_like(tensor)
            positions = torch.tensor([injections[row][1] for row in rows], device=tensor.device)
            vectors = torch.stack([injections[row][2] for row in rows]).to(tensor.dtype)
            gradient[torch.tensor(rows, device=tensor.device), positions] = vectors
            outputs.append(tensor)
            gradients.append(gradient)
        sources = [self.embedding[0], *self.mlp_points]
        grads = torch.autograd.grad(outputs, sources, gradients, retain_graph=True, allow_unused=True)
        prompt = self.prompt
        n = len(injections)
        result = torch.zeros(n, self.n_sources, dtype=torch.float32, device=prompt.errors.device)
        n_active = len(prompt.active)
        n_positions = self.n_positions
        for layer, gradient in enumerate(grads[1:]):
            if gradient is not None:
                self.sources_by_position[layer].contract(
                    gradient[:n], result, error_offset=n_active + layer * n_positions
                )
        if grads[0] is not None:
            offset = n_active + len(self.mlp_points) * n_positions
            result[:, offset:] = torch.einsum("bpd,pd->bp", grads[0][:n].float(), self.token_vectors.float())
        return result


def _edges(
    run: FrozenRun,
    transcoders: Replacement,
    prompt: _Prompt,
    logit_vectors: Tensor,
    logit_probabilities: Tensor,
    config: AttributionConfig,
    progress: Callable[[int, int], None] | None,
) -> tuple[Tensor, Tensor]:
    """The adjacency matrix [nodes, nodes] (CPU, float32) and the selected features' indices
    [n_selected] (int64), from the logits' demeaned unembedding rows ``logit_vectors`` [n_logits,
    d] and their probabilities [n_logits]."""
    import torch

    batch_size = config.batch_size
    graph = _GradientGraph(run, transcoders, prompt, batch_size)
    n_active = len(prompt.active)
    n_logits = len(logit_vectors)
    n_positions = prompt.ids.shape[1]
    logit_offset = graph.n_sources
    n_nodes = logit_offset + n_logits
    max_features = min(config.max_feature_nodes or n_active, n_active)
    if config.matrix_limit_bytes is not None:
        fitting = attribution_feature_rows(
            limit=config.matrix_limit_bytes, active=n_active, tokens=n_positions,
            layers=transcoders.n_layers, logits=n_logits,
        )  # fmt: skip
        max_features = min(max_features, fitting)
    total_batches = -(-n_logits // batch_size) + -(-max_features // batch_size)
    done = 0
    capped = max_features < n_active
    # Without a cap every row goes straight to its place in the square matrix (a node's row is its
    # index); with one, the rows computed so far rank the features still to visit, and only the
    # chosen features' columns are kept at the end.
    matrix = torch.zeros(max_features + n_logits, n_nodes) if capped else torch.zeros(n_nodes, n_nodes)
    row_nodes = torch.zeros(max_features + n_logits, dtype=torch.long)
    filled = 0

    def store(nodes: Tensor, rows: Tensor) -> None:
        nonlocal filled, done
        where = slice(filled, filled + len(nodes)) if capped else nodes
        matrix[where, :logit_offset] = rows.cpu()
        row_nodes[filled : filled + len(nodes)] = nodes
        filled += len(nodes)
        done += 1
        if progress:
            progress(done, total_batches)

    last = n_positions - 1
    for start in range(0, n_logits, batch_size):
        batch = logit_vectors[start : start + batch_size]
        store(
            torch.arange(start, start + len(batch)) + logit_offset,
            graph.rows([(None, last, v) for v in batch]),
        )
    visited = torch.zeros(n_active, dtype=torch.bool)
    probabilities = logit_probabilities.float().cpu()
    while int(visited.sum()) < max_features:
        if not capped:
            pending = torch.arange(n_active)
        else:
            influence = partial_influences(matrix[:filled], probabilities, row_nodes[:filled])
            ranking = torch.argsort(influence[:n_active], descending=True)
            queue_size = min(config.update_interval * batch_size, max_features - int(visited.sum()))
            pending = ranking[~visited[ranking]][:queue_size]
        for start in range(0, len(pending), batch_size):
            indices = pending[start : start + batch_size]
            device_indices = indices.to(prompt.active.device)
            layers = prompt.active[device_indices, 0].tolist()
            positions = prompt.active[device_indices, 1].tolist()
            store(
                indices,
                graph.rows(list(zip(layers, positions, prompt.encoders[device_indices], strict=True))),
            )
            visited[indices] = True
    del graph
    selected = torch.where(visited)[0]
    if not capped:
        return matrix, selected
    # Features in index order, then the errors, tokens and logits; rows where their nodes are.
    columns = torch.cat([selected, torch.arange(n_active, n_nodes)])
    rank = torch.full((n_active,), -1, dtype=torch.long)
    rank[selected] = torch.arange(len(selected))
    targets = torch.where(
        row_nodes < n_active, rank[row_nodes.clamp(max=n_active - 1)], row_nodes - n_active + max_features
    )
    adjacency = torch.zeros(len(columns), len(columns))
    for start in range(0, len(targets), 1024):  # the kept columns a block of rows at a time
        adjacency[targets[start : start + 1024]] = matrix[start : start + 1024][:, columns]
    return adjacency, selected


def _values_and_bias(
    run: FrozenRun, transcoders: Replacement, prompt: _Prompt, logit_vectors: Tensor, selected: Tensor
) -> tuple[Tensor, Tensor]:
    """Each feature and logit node's value (pre-activation; logit minus the mean logit) and bias
    (its value with every source node at zero: token embeddings, the selected features' decodes
    and errors; features left out by a cap stay, as constants like the biases): two [nodes]
    float32 tensors, zero for the other nodes. ``logit_vectors`` [n_logits, d], ``selected``
    [n_selected] indices into ``prompt.active``."""
    import torch

    n_layers = transcoders.n_layers
    inputs: list[Tensor] = []  # per layer, the MLP input [positions, d] with every source at zero
    final: list[Tensor] = []
    is_node = torch.zeros(len(prompt.active), dtype=torch.bool, device=prompt.active.device)
    is_node[selected.to(prompt.active.device)] = True

    def mlp(layer: int, x_in: Tensor, out: Tensor) -> Tensor:
        real_in = prompt.mlp_inputs[layer]
        real_skip = transcoders.skip_path(layer, real_in)
        sources = prompt.errors[layer].clone()
        start, end, decoders = prompt.decoders[layer]
        writing = is_node[start:end]
        sources.index_add_(0, prompt.active[start:end][writing, 1], decoders[writing].to(sources.dtype))
        constant = prompt.mlp_outputs[layer] - sources - (0 if real_skip is None else real_skip)
        skip = transcoders.skip_path(layer, x_in[0])
        inputs.append(x_in[0])
        return (constant + (0 if skip is None else skip))[None].to(out.dtype)

    with torch.no_grad(), run.attached(mlp=mlp, embedding=torch.zeros_like, final=final.append):
        run.forward(prompt.ids)
    chosen = prompt.active[selected.to(prompt.active.device)]
    n_positions = prompt.ids.shape[1]
    n_features = len(chosen)
    n_nodes = n_features + (n_layers + 1) * n_positions + len(logit_vectors)
    values = torch.zeros(n_nodes, dtype=torch.float64)
    bias = torch.zeros(n_nodes, dtype=torch.float64)
    for layer in range(n_layers):
        nodes = (chosen[:, 0] == layer).nonzero(as_tuple=True)[0]
        positions, features = chosen[nodes, 1], chosen[nodes, 2]
        for out, x_in in ((values, prompt.mlp_inputs[layer]), (bias, inputs[layer])):
            pre = transcoders.pre_activations(layer, x_in[positions], features)
            out[nodes.cpu()] = pre.double().cpu()
    logit_start = n_nodes - len(logit_vectors)
    last = n_positions - 1
    values[logit_start:] = (logit_vectors.double() @ prompt.final[last].double()).cpu()
    bias[logit_start:] = (logit_vectors.double() @ final[0][0, last].double()).cpu()
    return values.float(), bias.float()
