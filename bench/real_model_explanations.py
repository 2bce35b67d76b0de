"""Step 4 of bench/real_model.py: SAE features explained and scored by the model itself.

Two ways, on features of the bench's SAE picked at random (seeded) among those with 20 or more
top examples:

* **the engine's chat prompts**, the explanation job's path (``engine.autointerp.interpret_feature``
  and ``score_explanation``: delphi-style explainer, detection and fuzzing scorers), the endpoint
  being :class:`InProcessChat`, what the workbench's ``/v1`` does in this process (``render_prompt``
  then ``engine.generation.generate``). Scores are balanced accuracies; answers that do not parse
  count as failed, as in delphi. Each explained feature is scored again with another feature's
  explanation (a derangement): the random baseline.
* **completion-style few-shot prompts for a base model** (:func:`base_model_scores`): a theme for
  the list of words the feature fires most on, and detection read from the model's next-token
  log-odds of " yes" over " no" (an AUROC over held-out activating and non-activating contexts),
  which needs no answer to parse; the same with another feature's explanation as the baseline.
"""

from __future__ import annotations

import time

# Features explained through the engine's chat prompts: each request is a generation, about a
# minute a feature on a shared 2-core CPU.
ENGINE_PROMPT_FEATURES = 4


class InProcessChat:
    """The chat endpoint the workbench's ``/v1`` is, in this process: messages rendered by
    ``render_prompt`` (Gemma 3 270M's tokenizer has no chat template: the plain ``User:`` /
    ``Assistant:`` rendering), then ``engine.generation.generate``; greedy at temperature 0."""

    def __init__(self, model, tokenizer, *, seed: int = 0) -> None:
        self.model, self.tokenizer, self.seed = model, tokenizer, seed
        self.requests, self.prompt_tokens, self.completion_tokens = 0, 0, 0
        self.replies: list[str] = []  # the first few answers, to show what the model says

    def fits(self, max_tokens: int):
        from engine.generation.prompts import render_prompt

        context = min(self.model.config.max_position_embeddings, 4096)
        return lambda messages: len(render_prompt(self.tokenizer, messages=messages)) + max_tokens <= context

    def complete(self, messages, *, max_tokens: int, temperature: float = 0.0, extra=None, stop=None):
        from engine.autointerp.chat import ChatReply
        from engine.generation.decode import generate
        from engine.generation.params import SamplingParams
        from engine.generation.prompts import render_prompt

        prompt = render_prompt(self.tokenizer, messages=messages)
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            seed=self.seed,
            ignore_eos=bool((extra or {}).get("ignore_eos")),
        )
        (result,) = generate(self.model, self.tokenizer, [prompt], [params])
        self.requests += 1
        self.prompt_tokens += len(prompt)
        self.completion_tokens += len(result.token_ids)
        if len(self.replies) < 8:
            self.replies.append(result.text)
        return ChatReply(text=result.text, prompt_tokens=len(prompt), completion_tokens=len(result.token_ids))


def token_texts(tokenizer, token_ids) -> list[str]:
    return [tokenizer.decode([int(token)]) for token in token_ids]


def arrays_examples(arrays, prefix: str, feature: int, tokenizer) -> list:
    """The feature's ``prefix`` ("top" or "interval") examples as autointerp ``Example``s."""
    import numpy as np

    from engine.autointerp.prompts import Example

    examples = []
    for slot, row in enumerate(arrays[f"{prefix}_rows"][feature]):
        present = arrays[f"{prefix}_context_tokens"][feature, slot] >= 0
        if row < 0 or not present.any():
            continue
        values = np.nan_to_num(arrays[f"{prefix}_context"][feature, slot].astype(np.float32))[present]
        tokens = token_texts(tokenizer, arrays[f"{prefix}_context_tokens"][feature, slot][present])
        examples.append((int(row), Example(tokens=tuple(tokens), values=tuple(float(v) for v in values))))
    return examples


def feature_examples(arrays, feature: int, config, tokenizer, quiet_windows, fires) -> object:
    """As the explanation job picks them (features/explanation_tasks.py): the strongest top
    examples shown, interval examples held out for the scorers, contexts where it never fires."""
    import numpy as np

    from engine.autointerp.pipeline import FeatureExamples
    from engine.autointerp.prompts import Example

    top = arrays_examples(arrays, "top", feature, tokenizer)
    shown = top[: min(config.explain_examples, (len(top) + 1) // 2)]
    seen = {row for row, _ in shown}
    intervals = [
        (row, ex) for row, ex in arrays_examples(arrays, "interval", feature, tokenizer) if row not in seen
    ]
    if len(intervals) > config.test_examples:
        picks = np.linspace(0, len(intervals) - 1, config.test_examples).round().astype(int)
        intervals = [intervals[pick] for pick in picks]
    picked = {row for row, _ in intervals}
    rest = [(row, ex) for row, ex in top[len(shown) :] if row not in picked]
    quiet = [
        Example(tokens=tuple(tokens), values=(0.0,) * len(tokens))
        for tokens, fired in zip(quiet_windows, fires[:, feature], strict=True)
        if not fired
    ][: config.non_activating]
    return FeatureExamples(
        index=feature,
        train=[ex for _, ex in shown],
        test=[ex for _, ex in (intervals + rest)[: config.test_examples]],
        non_activating=quiet,
    )


def explain_features(model, tokenizer, sae, rows, tokenized, arrays, count: int, *, seed: int) -> dict:
    """``count`` live features (seeded pick among those with 20+ examples) explained and scored
    by the model itself; each scored again with another feature's explanation (a derangement)."""
    import numpy as np
    import torch

    from engine.autointerp.pipeline import (
        Endpoints,
        InterpretationConfig,
        interpret_feature,
        score_explanation,
    )
    from engine.features.analysis import TokenTable

    # Small prompts for a 270M base model: 6 shown, 6 + 6 scored, 3 a request.
    config = InterpretationConfig(
        explain_examples=6,
        test_examples=6,
        non_activating=6,
        per_prompt=3,
        explain_max_tokens=32,
        score_max_tokens=16,
        ignore_eos=True,
    )
    client = InProcessChat(model, tokenizer, seed=seed)
    endpoints = Endpoints(
        explainer=client,
        scorer=client,
        explainer_fits=client.fits(config.explain_max_tokens),
        scorer_fits=client.fits(config.score_max_tokens),
    )
    # Contexts for the non-activating examples: random windows, encoded once.
    token_ids = np.concatenate([np.asarray(ids) for ids in tokenized])
    sample_index = np.repeat(np.arange(len(tokenized)), [len(ids) for ids in tokenized])
    position = np.concatenate([np.arange(len(ids)) for ids in tokenized])
    table = TokenTable(token_ids, sample_index, position)
    rng = np.random.default_rng(seed)
    windows = table.windows(rng.choice(len(table), size=200, replace=False), 8, 3)
    with torch.no_grad():
        fires = np.stack(
            [
                (sae.encode(rows[torch.as_tensor(window[window >= 0])]) > 0).any(0).numpy()
                for window in windows
            ]
        )
    quiet_windows = [token_texts(tokenizer, table.ids(window[window >= 0])) for window in windows]
    live = np.flatnonzero((arrays["top_rows"] >= 0).sum(1) >= 20)
    chosen = sorted(
        np.random.default_rng(seed).choice(live, size=min(count, len(live)), replace=False).tolist()
    )
    features = [
        feature_examples(arrays, feature, config, tokenizer, quiet_windows, fires) for feature in chosen
    ]
    # The engine's chat prompts (the explanation job's path) on the first few: each request is a
    # generation, about a minute a feature on this machine.
    results = []
    for feature in features[:ENGINE_PROMPT_FEATURES]:
        started = time.perf_counter()
        result = interpret_feature(feature, endpoints, config)
        results.append(result)
        print(
            f"   engine prompts, feature {feature.index}: {result.explanation or result.error_code!r} "
            f"score {result.score} ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    explained = [result for result in results if result.explanation]
    baseline = []
    for number, result in enumerate(explained):
        if result.score is None:  # no scorer answer parsed: a baseline would not parse either
            continue
        other = explained[(number + 1) % len(explained)].explanation if len(explained) > 1 else "Random text."
        feature = next(item for item in features if item.index == result.index)
        scores = score_explanation(feature, other, endpoints, config)
        values = [score.balanced_accuracy for score in scores.values() if score.balanced_accuracy is not None]
        baseline.append(
            {name: score.balanced_accuracy for name, score in scores.items()}
            | {"mean": sum(values) / len(values) if values else None}
        )
    engine_prompts = {
        "features": [
            {
                "index": result.index,
                "explanation": result.explanation,
                "error": result.error_code,
                **{name: score.balanced_accuracy for name, score in result.scores.items()},
                "confusion": {name: score.as_dict() for name, score in result.scores.items()},
            }
            for result in results
        ],
        "explained": len(explained),
        "mean_score": mean_of([result.score for result in explained]),
        "random_baseline": baseline,
        "random_mean_score": mean_of([row["mean"] for row in baseline]),
        "sample_replies": client.replies,
        "requests": client.requests,
        "prompt_tokens": client.prompt_tokens,
        "completion_tokens": client.completion_tokens,
    }
    return {
        "engine_prompts": engine_prompts,
        "base_model_prompts": base_model_scores(model, tokenizer, features),
    }


def mean_of(values):
    values = [value for value in values if value is not None]
    return sum(values) / len(values) if values else None


# A completion-style few-shot prompt, which a base model continues where it copies the chat
# prompt's worked answer: the word where the feature fires most in each shown example, then
# "Theme:", three solved lists first. (Marked contexts, <<like this>>, made the 270M model repeat
# a solved case's theme for every feature.)
BASE_EXPLAIN_PROMPT = """Each list of words has a theme.

Words: wider, smaller, deeper, taller
Theme: comparative adjectives

Words: Paris, New York, Berlin, Rome
Theme: names of cities

Words: apple, bread, cheese, soup
Theme: food

Words: {words}
Theme:"""
BASE_DETECT_PROMPT = """Does the text match the description?

Description: names of cities
Text: she flew from Paris to Rome
Answer: yes

Description: names of cities
Text: the cat sat quietly on the mat
Answer: no

Description: {explanation}
Text: {text}
Answer:"""


def base_model_scores(model, tokenizer, features) -> dict:
    """Each feature explained by a completion-style prompt (greedy, to the end of the line), then
    detection without parsing: the model's log-odds of " yes" over " no" for each held-out
    activating and non-activating context, as an AUROC; the same with another feature's
    explanation (a derangement) as the random baseline."""
    import torch

    from engine.generation.decode import generate
    from engine.generation.params import SamplingParams

    yes, no = (tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in (" yes", " no"))

    def explain(feature) -> str:
        peaks = [
            example.tokens[max(range(len(example.values)), key=example.values.__getitem__)].strip()
            for example in feature.train
        ]
        prompt = tokenizer(BASE_EXPLAIN_PROMPT.format(words=", ".join(peaks)))["input_ids"]
        params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=("\n",))
        (result,) = generate(model, tokenizer, [prompt], [params])
        return result.text.strip()

    def log_odds(explanation: str, text: str) -> float:
        prompt = BASE_DETECT_PROMPT.format(explanation=explanation, text=text.replace("\n", " ").strip())
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1].float()
        return float(logits[yes] - logits[no])

    def auroc(explanation: str, feature) -> float | None:
        positives = [log_odds(explanation, example.text) for example in feature.test]
        negatives = [log_odds(explanation, example.text) for example in feature.non_activating]
        if not positives or not negatives:
            return None
        wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
        return wins / (len(positives) * len(negatives))

    rows = []
    for feature in features:
        started = time.perf_counter()
        rows.append({"index": feature.index, "explanation": explain(feature)})
        rows[-1]["detection_auroc"] = auroc(rows[-1]["explanation"], feature)
        rows[-1]["seconds"] = time.perf_counter() - started
    for number, row in enumerate(rows):
        other = rows[(number + 1) % len(rows)]["explanation"]
        row["random_explanation"] = other
        row["random_detection_auroc"] = auroc(other, features[number])
        print(
            f"   base-model prompt, feature {row['index']}: {row['explanation']!r} AUROC "
            f"{row['detection_auroc']} (random explanation {row['random_detection_auroc']})",
            flush=True,
        )
    return {
        "features": rows,
        "mean_detection_auroc": mean_of([row["detection_auroc"] for row in rows]),
        "random_mean_detection_auroc": mean_of([row["random_detection_auroc"] for row in rows]),
    }
