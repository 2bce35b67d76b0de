"""``{% load probes %}``: ``model|is_causal_lm``, whether a model gets the patching and logit-lens pages."""

from django import template

from frontend.views.probes import is_causal_lm as model_is_causal_lm

register = template.Library()


@register.filter
def is_causal_lm(model) -> bool:
    """True for every supported family but the encoders (they predict no next token)."""
    return model_is_causal_lm(model)
