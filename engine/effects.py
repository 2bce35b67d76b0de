"""What a steered generation did: measured on its output, not assumed from its coefficient.

* :func:`feature_on_text`: an SAE feature's activations over a token sequence, read by the model
  *without* the intervention (so it says whether the text itself carries the feature, not whether
  the intervention added its direction);
* :func:`first_token_kl`: KL(steered || unsteered) of the next-token distribution at the first
  generated position (the prompt's last), from two forward passes over the prompt;
* :func:`distinct_n`: distinct n-grams over all n-grams of the generated tokens (1.0: no repeat;
  "the the the …" goes to 0), the usual degeneration measure.

:func:`steering_effect` puts them together for one generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from engine.extraction import extract
from engine.interventions import Intervention, feature_values
from engine.patching import run_with_interventions
from engine.placement import input_device

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel

    from engine.sae.model import SparseAutoencoder


@dataclass(frozen=True)
class SteeringEffect:
    # the feature over the generated tokens, read by the unsteered model (None: nothing generated)
    activation_mean: float | None
    activation_max: float | None
    # KL(steered || unsteered) at the first generated position, in nats (None: no intervention)
    first_token_kl: float | None
    # distinct bigrams / bigrams of the generated tokens (None: fewer than two tokens)
    distinct_2: float | None
    generated_tokens: int

    def as_dict(self) -> dict[str, float | int | None]:
        """The fields as JSON values, floats rounded to 6 places (stored with the generation)."""
        return {
            name: round(value, 6) if isinstance(value, float) else value
            for name, value in asdict(self).items()
        }


def distinct_n(token_ids: Sequence[int], n: int = 2) -> float | None:
    grams = [tuple(token_ids[start : start + n]) for start in range(len(token_ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def feature_on_text(
    model: PreTrainedModel, sae: SparseAutoencoder, hook: str, feature: int, token_ids: Sequence[int]
) -> Tensor:
    """``feature``'s activation at each of ``token_ids`` [tokens] (float32, CPU), the unsteered
    model reading them at ``hook``."""
    (run,) = extract(model, [list(token_ids)], [[0]], hooks=[hook], dtype="float32")
    rows = run.activations[hook].reshape(len(token_ids), -1)
    values = feature_values(sae, rows.to(sae.W_enc.device), (feature,))
    return values[:, 0].detach().float().cpu()


def first_token_kl(
    model: PreTrainedModel, prompt_ids: Sequence[int], interventions: Sequence[Intervention]
) -> float:
    """KL(steered || unsteered) in nats of the next-token distribution after ``prompt_ids``."""
    import torch

    ids = torch.tensor([list(prompt_ids)] * 2, device=input_device(model))
    logits = run_with_interventions(model, ids, [[], list(interventions)])[:, -1].float()
    unsteered, steered = torch.log_softmax(logits, dim=-1)
    return max(0.0, float((steered.exp() * (steered - unsteered)).sum()))


def steering_effect(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    sae: SparseAutoencoder,
    hook: str,
    feature: int,
    interventions: Sequence[Intervention] = (),
) -> SteeringEffect:
    """The measured effect of one generation (``output_ids`` after ``prompt_ids``) on ``feature``."""
    mean = peak = None
    if output_ids:
        values = feature_on_text(model, sae, hook, feature, [*prompt_ids, *output_ids])[len(prompt_ids) :]
        mean, peak = float(values.mean()), float(values.max())
    return SteeringEffect(
        activation_mean=mean,
        activation_max=peak,
        first_token_kl=first_token_kl(model, prompt_ids, interventions) if interventions else None,
        distinct_2=distinct_n(list(output_ids)),
        generated_tokens=len(output_ids),
    )
