"""Automatic interpretation: an explainer model names a feature from its examples, a scorer model
checks the name on held-out examples (detection and fuzzing, as EleutherAI's delphi defines them).

- :mod:`engine.autointerp.prompts`: the versioned prompts, examples with their activating tokens
  marked, and the parsing of the explainer's answer;
- :mod:`engine.autointerp.scoring`: the scorers' samples, prompts and balanced accuracy;
- :mod:`engine.autointerp.chat`: an OpenAI-compatible chat client (bounded retries);
- :mod:`engine.autointerp.pipeline`: one feature explained and scored, many at once.

Nothing here imports Django.
"""
