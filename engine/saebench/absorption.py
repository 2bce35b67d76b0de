"""SAEBench's feature absorption (``sae_bench.evals.absorption`` 0.6.0): first-letter tasks built
from the model's own vocabulary, so it runs offline.

1. **Words**: the vocabulary's tokens made only of ASCII letters (a leading space allowed), as
   SAEBench's ``get_alpha_tokens`` finds them, in token-id order.
2. **Prompts**: the words are shuffled and split 80/20; each word gets a prompt of ten in-context
   examples from its own side (``"\\nword has the first letter: W\\n…\\nword has the first letter:"``),
   drawn as SAEBench's ``create_icl_prompt`` draws them (Python's ``random``, seeded).
3. **The model's probe**: a 26-way one-against-the-rest logistic probe on the activation at the
   word's token (SAEBench's ``train_linear_probe_for_task``: Adam, BCE weighted by class balance,
   50 epochs, the learning rate decaying from 1e-2 to 1e-5, the batches shuffled as a torch
   DataLoader shuffles them).
4. **k-sparse probes** on the SAE's features: an L1-penalised probe on all features ranks them for
   each letter; for k = 1..10 a balanced scikit-learn logistic regression on the top k. The letter's
   main features are the top k up to the last k whose test F1 rose by more than 0.03.
5. **Absorption**: for each test word the model's probe gets right, prompted again (ten examples
   from the whole vocabulary), the probe's projection is split among the SAE's features
   (activation times the cosine of the decoder row with the probe). The absorption fraction is the
   share that up to three other probe-aligned features carry where the main features fall short;
   full absorption is a single aligned feature carrying it while no main feature fires.

Per letter: ``mean_absorption_fraction`` and ``full_absorption_rate`` (over the probe's true
positives) and ``num_split_features``; the SAE's scores are their means over the letters whose
probe reaches an F1 of 0.6, when at least 20 letters do.

The model's probe depends on the model and the hook point only: it is trained once for a run's
SAEs at a hook. Each SAE then starts from the random states that follow it, so every SAE gets the
result SAEBench gives for it alone in a fresh process seeded with the run's seed.

Two deliberate differences: the model reads each prompt unpadded (SAEBench pads a batch's prompts
on the right and reads a fixed position from the end, which is a padding position for a prompt
shorter than its batch's longest), and the word's position defaults to the one the template puts
it at under this tokenizer (SAEBench's -6 is right for templates whose tail is five tokens).

Importing this module imports torch; scikit-learn is imported when probes are fitted.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.hooks import hook_sites
from engine.runtime import grad_free_mode
from engine.sae.evaluation import EvaluationCancelled, EvaluationError
from engine.sae.model import SparseAutoencoder
from engine.saebench.probe_training import train_multi_probe
from engine.saebench.sparse_probing import value_at_hook

__all__ = [
    "LETTERS",
    "AbsorptionConfig",
    "absorption",
    "absorption_plan",
    "alpha_words",
    "spelling_prompt",
]

LETTERS = "abcdefghijklmnopqrstuvwxyz"
ALPHA = set(LETTERS + LETTERS.upper())
# SAEBench's thresholds (feature_absorption.py).
FULL_ABSORPTION_PROBE_COS = 0.025
ABSORPTION_FRACTION_PROBE_COS = 0.1
PROJECTION_PROPORTION = 0.4
MAX_ABSORBING_LATENTS = 3
TOP_PROJECTION_FEATURES = 10
ACTIVE = 1e-8  # a main feature below this did not fire
# SAEBench's scores (its name, the per-letter column it averages).
SCORES = (
    ("absorption_fraction_score", "mean_absorption_fraction"),
    ("full_absorption_score", "full_absorption_rate"),
    ("num_split_features", "num_split_features"),
)


@dataclass(frozen=True)
class AbsorptionConfig:
    """SAEBench's defaults (``AbsorptionEvalConfig`` and the functions' own), and ``max_words``: at
    most that many words, drawn with the seed (None: all, as SAEBench)."""

    prompt_template: str = "{word} has the first letter:"
    prompt_token_pos: int | None = None  # None: the word's position under this tokenizer
    max_icl_examples: int = 10
    train_fraction: float = 0.8
    probe_epochs: int = 50
    probe_batch_size: int = 64
    probe_lr: float = 1e-2
    probe_weight_decay: float = 1e-4
    k_sparse_l1_decay: float = 0.01
    k_sparse_batch_size: int = 4096
    k_sparse_epochs: int = 50
    max_k: int = 10
    f1_jump_threshold: float = 0.03
    min_probe_f1: float = 0.6
    min_letters: int = 20
    max_words: int | None = None
    batch_size: int = 64
    seed: int = 42

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- words and prompts ------------------------------------------------------------------------


def token_text(tokenizer: Any, token: str) -> str:
    """SAEBench's ``convert_tokens_to_string``: a token's text, its leading "▁" a space."""
    converted = tokenizer.convert_tokens_to_string([token])
    if token and token[0] == "▁" and (not converted or converted[0] != " "):
        converted = " " + converted
    return converted


def alpha_words(tokenizer: Any) -> list[str]:
    """The texts of the vocabulary's tokens made only of ASCII letters after an optional leading
    space (SAEBench's ``get_alpha_tokens``), in token-id order."""
    words = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        text = token_text(tokenizer, token)
        bare = text[1:] if text.startswith(" ") else text
        if bare and all(char in ALPHA for char in bare):
            words.append(text)
    return words


def first_letter(word: str) -> str:
    """The answer: a space and the word's first letter, capitalised (``first_letter_formatter``)."""
    return " " + next(char for char in word.strip() if char.isalpha()).upper()


def letter_class(word: str) -> int:
    return LETTERS.index(first_letter(word).strip().lower())


def spelling_prompt(
    word: str, examples: Sequence[str], rng: random.Random, *, template: str, count: int
) -> str:
    """SAEBench's ``create_icl_prompt`` (separator "\\n", also before the first example): ``count``
    examples drawn from ``examples`` without ``word`` among them, each with its answer, then
    ``word``'s question."""
    for _ in range(1000):
        chosen = rng.sample(examples, count)
        if word not in chosen:
            break
    else:
        raise EvaluationError("INVALID_SETTINGS", f"No {count} examples without {word!r} in 1000 draws.")
    shown = [template.format(word=example) + first_letter(example) for example in chosen]
    return "\n" + "\n".join(shown) + "\n" + template.format(word=word)


def question(word: str, examples: Sequence[str], rng: random.Random, config: AbsorptionConfig) -> str:
    """:func:`spelling_prompt` with the run's template and number of examples."""
    return spelling_prompt(
        word, examples, rng, template=config.prompt_template, count=config.max_icl_examples
    )


def word_position(tokenizer: Any, template: str) -> int:
    """The word's position from the prompt's end: before the template's tail's tokens."""
    tail = template.split("{word}", 1)[1]
    return -(1 + len(tokenizer(tail, add_special_tokens=False)["input_ids"]))


def chosen_words(tokenizer: Any, config: AbsorptionConfig) -> list[str]:
    """:func:`alpha_words`, or ``max_words`` of them drawn with the seed (in the same order)."""
    vocabulary = alpha_words(tokenizer)
    if config.max_words is None or config.max_words >= len(vocabulary):
        return vocabulary
    kept = set(random.Random(config.seed).sample(range(len(vocabulary)), config.max_words))  # noqa: S311
    return [word for index, word in enumerate(vocabulary) if index in kept]


def prompts_read(words: int, config: AbsorptionConfig, saes: int) -> int:
    """The prompts the model reads for ``saes`` SAEs at one hook: each word's once for the model's
    probe, then for each SAE the probe's true positives again (at most the test words)."""
    return words + saes * (words - int(words * config.train_fraction))


def absorption_plan(tokenizer: Any, config: AbsorptionConfig, *, saes: int = 1) -> dict[str, Any]:
    """What judging ``saes`` SAEs at one hook costs, before it runs: the words, the prompts the
    model reads (each word once for the model's probe; for each SAE, the probe's true positives
    again, at most the test words), their tokens, and the work of the probes in floating-point
    operations (the L1 probe reads every training word's features each epoch)."""
    words = len(chosen_words(tokenizer, config))
    examples = ["example", "other"] * config.max_icl_examples
    rng = random.Random(0)  # noqa: S311  (any examples: only the prompt's length is wanted)
    example = spelling_prompt(
        "word", examples, rng, template=config.prompt_template, count=config.max_icl_examples
    )
    per_prompt = len(tokenizer(example, add_special_tokens=False)["input_ids"]) + 1
    train = int(words * config.train_fraction)
    prompts = prompts_read(words, config, saes)
    return {
        "words": words,
        "prompts": prompts,
        "tokens_per_prompt": per_prompt,
        "tokens": prompts * per_prompt,
        # forward and backward through a [26, features] probe, per training word and epoch
        "probe_flops_per_feature": saes * 6 * len(LETTERS) * train * config.k_sparse_epochs,
        "regressions": saes * len(LETTERS) * config.max_k,
    }


# ---- the model's activations at the word --------------------------------------------------------


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt's ids with the BOS token first, as TransformerLens' ``to_tokens`` makes them."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids if bos is None else [bos, *ids]


def word_activations(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    hook_name: str,
    position: int,
    batch_size: int,
    should_cancel: Callable[[], bool] | None = None,
    progress: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """[prompts, d]: the activation at ``hook_name`` at ``position`` (from each prompt's own end),
    prompts of one length run together, unpadded; ``progress`` is told each batch's size."""
    sites = hook_sites(model, [hook_name])
    device = next(model.parameters()).device
    ids = [prompt_ids(tokenizer, prompt) for prompt in prompts]
    by_length: dict[int, list[int]] = {}
    for index, row in enumerate(ids):
        by_length.setdefault(len(row), []).append(index)
    rows: list[torch.Tensor | None] = [None] * len(ids)
    with grad_free_mode(model)(), torch.no_grad():
        for indices in by_length.values():
            for start in range(0, len(indices), batch_size):
                if should_cancel is not None and should_cancel():
                    raise EvaluationCancelled
                chosen = indices[start : start + batch_size]
                batch = torch.tensor([ids[index] for index in chosen], device=device)
                values = value_at_hook(model, sites, batch, hook_name)[:, position, :].float().cpu()
                for index, value in zip(chosen, values, strict=True):
                    rows[index] = value
                if progress is not None:
                    progress(len(chosen))
    return torch.stack(rows) if rows else torch.zeros(0, 0)  # type: ignore[arg-type]


# ---- probes -------------------------------------------------------------------------------------


def _f1(truth: Any, predicted: Any) -> float:
    from sklearn.metrics import f1_score

    return float(f1_score(truth, predicted))


def read_back(tokenizer: Any, words: list[str], labels: list[int]) -> list[tuple[str, int]]:
    """The words as SAEBench reads them back from its saved split: each passed through the
    tokenizer's ``convert_tokens_to_string`` as if it were a token (words of letters only, so none
    is skipped for a digit or ``<>``). The absorption prompts are built from these."""
    return [
        (tokenizer.convert_tokens_to_string([word]), label) for word, label in zip(words, labels, strict=True)
    ]


def check_words(sides: dict[str, list[str]], config: AbsorptionConfig) -> None:
    """:class:`EvaluationError` (``NOT_ENOUGH_WORDS``) unless each side has more words than a
    prompt's examples and every letter begins a training word (the 26 probes need one each)."""
    smallest = min(len(words) for words in sides.values())
    more = "more words: raise max_words, or use a model with a larger vocabulary"
    if smallest <= config.max_icl_examples:
        raise EvaluationError(
            "NOT_ENOUGH_WORDS", f"A side of the split has {smallest} words; a prompt's "
            f"{config.max_icl_examples} examples need {config.max_icl_examples + 1} or more ({more}).",
        )  # fmt: skip
    missing = sorted(set(LETTERS) - {LETTERS[letter_class(word)] for word in sides["train"]})
    if missing:
        raise EvaluationError(
            "NOT_ENOUGH_WORDS",
            f"No training word begins with {', '.join(missing)}: the first-letter probes need all 26 "
            f"letters ({more}).",
        )


@dataclass
class ModelProbe:
    """What a hook's SAEs share: the words, the model's activations and its 26-way probe, and the
    random states that follow its training."""

    train_words: list[tuple[str, int]]
    test_words: list[tuple[str, int]]
    train_x: torch.Tensor
    test_x: torch.Tensor
    probe: torch.nn.Linear
    vocabulary: list[str]
    torch_state: torch.Tensor
    python_state: Any
    position: int


def model_probe(
    model: Any,
    tokenizer: Any,
    vocabulary: list[str],
    *,
    hook_name: str,
    config: AbsorptionConfig,
    should_cancel: Callable[[], bool] | None = None,
    progress: Callable[[int], None] | None = None,
) -> ModelProbe:
    """``vocabulary``'s words (:func:`chosen_words`) split, their prompts' activations and the
    model's first-letter probe (SAEBench's ``train_and_save_probes``, then ``load_probe_data_split``)."""
    rng = random.Random(config.seed)  # noqa: S311  (SAEBench's draws, not a secret)
    shuffled = rng.sample(vocabulary, len(vocabulary))
    split = int(len(shuffled) * config.train_fraction)
    sides = {"train": shuffled[:split], "test": shuffled[split:]}
    check_words(sides, config)
    prompts = {side: [question(word, words, rng, config) for word in words] for side, words in sides.items()}
    position = (
        config.prompt_token_pos
        if config.prompt_token_pos is not None
        else word_position(tokenizer, config.prompt_template)
    )
    activations = {}
    for side in ("train", "test"):
        activations[side] = word_activations(
            model, tokenizer, prompts[side], hook_name=hook_name, position=position,
            batch_size=config.batch_size, should_cancel=should_cancel, progress=progress,
        )  # fmt: skip
    labels = {side: [letter_class(word) for word in words] for side, words in sides.items()}
    generator = torch.Generator().manual_seed(config.seed)
    with torch.enable_grad():
        probe = train_multi_probe(
            activations["train"],
            torch.nn.functional.one_hot(torch.tensor(labels["train"]), num_classes=len(LETTERS)),
            generator=generator, epochs=config.probe_epochs, batch_size=config.probe_batch_size,
            lr=config.probe_lr, weight_decay=config.probe_weight_decay,
        )  # fmt: skip
    return ModelProbe(
        train_words=read_back(tokenizer, sides["train"], labels["train"]),
        test_words=read_back(tokenizer, sides["test"], labels["test"]),
        train_x=activations["train"],
        test_x=activations["test"],
        probe=probe,
        vocabulary=vocabulary,
        torch_state=generator.get_state(),
        python_state=rng.getstate(),
        position=position,
    )  # fmt: skip


# ---- one SAE ------------------------------------------------------------------------------------


def _encoded(sae: SparseAutoencoder, rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """The SAE's features of ``rows``, ``chunk`` rows at a time, as float32 on the CPU."""
    device, dtype = sae.W_enc.device, sae.W_enc.dtype
    with torch.no_grad():
        parts = [sae.encode(part.to(device, dtype)).float().cpu() for part in rows.split(chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, sae.W_enc.shape[1])


@dataclass
class KSparse:
    """The model probe's test scores, and per letter its F1 and the letter's main features."""

    probe_scores: torch.Tensor
    probe_f1: dict[int, float]
    split: dict[int, list[int]]


def k_sparse_probing(sae: SparseAutoencoder, shared: ModelProbe, config: AbsorptionConfig,
                     generator: torch.Generator) -> KSparse:  # fmt: skip
    """SAEBench's ``run_k_sparse_probing_experiment`` with ``precalc_k_sparse_probe_sae_acts``:
    the L1 probe on the SAE's features of the training words, a balanced logistic regression on
    each letter's top k, each scored on the test words; the main features (``split_feats``)."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    train_labels = torch.tensor([label for _, label in shared.train_words])
    features = _encoded(sae, shared.train_x, config.k_sparse_batch_size)
    with torch.enable_grad():
        l1_probe = train_multi_probe(
            features, torch.nn.functional.one_hot(train_labels), generator=generator,
            epochs=config.k_sparse_epochs, batch_size=config.k_sparse_batch_size, lr=0.01, weight_decay=1e-6,
            l1_decay=config.k_sparse_l1_decay,
        )  # fmt: skip
    weights = l1_probe.weight.detach().float().cpu()
    test_features = torch.cat([_encoded(sae, part, 4096) for part in shared.test_x.split(24)])
    probe = shared.probe
    with torch.no_grad():
        probe_scores = torch.cat(
            [probe(part.to(probe.weight.device)).float().cpu() for part in shared.test_x.split(24)]
        )
    test_labels = np.array([label for _, label in shared.test_words])
    train_y = train_labels.numpy()
    chosen: dict[int, dict[int, list[int]]] = {letter: {} for letter in range(len(LETTERS))}
    f1: dict[int, dict[int, float]] = {letter: {} for letter in range(len(LETTERS))}
    for k in range(1, config.max_k + 1):
        for letter in sorted(set(train_y.tolist())):
            ids = weights[letter].topk(k).indices
            fitted = LogisticRegression(max_iter=500, class_weight="balanced").fit(
                features[:, ids].numpy(), (train_y == letter).astype(np.int64)
            )
            weight = torch.tensor(fitted.coef_[0]).float()
            bias = torch.tensor(fitted.intercept_[0]).float()
            scores = test_features[:, ids] @ weight + bias
            chosen[letter][k] = ids.tolist()
            f1[letter][k] = _f1(test_labels == letter, (scores > 0).numpy())
    probe_f1 = {
        letter: _f1(test_labels == letter, (probe_scores[:, letter] > 0).numpy()) for letter in chosen
    }
    split = {}
    for letter in chosen:
        best = -100.0
        for k in range(1, config.max_k + 1):
            if f1[letter][k] > best + config.f1_jump_threshold:
                best, split[letter] = f1[letter][k], chosen[letter][k]
            else:
                break
    return KSparse(probe_scores=probe_scores, probe_f1=probe_f1, split=split)


def word_absorption(
    acts: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, direction: torch.Tensor, main: list[int]
) -> tuple[float, bool]:
    """SAEBench's ``FeatureAbsorptionCalculator.calculate_absorption`` for one word: its absorption
    fraction and whether it is fully absorbed by one feature."""
    probe_projection = float((acts @ direction.to(acts.dtype)).item())
    projections = features * cos
    main_projection = float(torch.sum(projections[main]).item())
    absorbers = torch.ones(projections.size(0), dtype=torch.bool)
    absorbers[main] = False
    absorbers &= cos >= ABSORPTION_FRACTION_PROBE_COS
    absorbers &= projections > 0
    candidates = projections[absorbers]
    top = candidates.topk(k=min(MAX_ABSORBING_LATENTS, candidates.numel())).values
    absorbed = float(torch.sum(top).item())
    proportion = absorbed / probe_projection if probe_projection else math.inf
    if main_projection >= probe_projection or proportion < PROJECTION_PROPORTION:
        fraction = 0.0
    elif main_projection <= 0.0:
        fraction = 1.0
    else:
        carried = min(absorbed, probe_projection - main_projection)
        fraction = float(min(max(carried / (carried + main_projection), 0.0), 1.0))
    top_feature = int(projections.topk(TOP_PROJECTION_FEATURES).indices[0])
    full = (
        all(float(features[feature]) < ACTIVE for feature in main)
        and float(cos[top_feature]) >= FULL_ABSORPTION_PROBE_COS
        and probe_projection >= 0
        and float(features[top_feature] * cos[top_feature]) / probe_projection >= PROJECTION_PROPORTION
    )
    return fraction, full


def sae_absorption(
    model: Any,
    tokenizer: Any,
    sae: SparseAutoencoder,
    shared: ModelProbe,
    *,
    hook_name: str,
    config: AbsorptionConfig,
    should_cancel: Callable[[], bool] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """One SAE's absorption, from the random states that follow the model's probe."""
    generator = torch.Generator()
    generator.set_state(shared.torch_state)
    rng = random.Random()  # noqa: S311  (SAEBench's draws, not a secret)
    rng.setstate(shared.python_state)
    probing = k_sparse_probing(sae, shared, config, generator)
    weights = shared.probe.weight.detach().float().cpu()
    letters = []
    for letter, name in enumerate(LETTERS):
        scores = probing.probe_scores[:, letter]
        words = [
            word
            for (word, label), score in zip(shared.test_words, scores, strict=True)
            if label == letter and score > 0
        ]
        prompts = [question(word, shared.vocabulary, rng, config) for word in words]
        row = {
            "first_letter": name,
            "probe_f1": probing.probe_f1[letter],
            "num_probe_true_positives": len(words),
            "num_split_features": len(probing.split[letter]),
            "split_features": probing.split[letter],
            "mean_absorption_fraction": None,
            "full_absorption_rate": None,
            "num_full_absorption": 0,
        }
        if words:
            acts = word_activations(model, tokenizer, prompts, hook_name=hook_name, position=shared.position,
                                    batch_size=config.batch_size, should_cancel=should_cancel,
                                    progress=progress)  # fmt: skip
            features = _encoded(sae, acts, 10)
            direction = weights[letter] / weights[letter].norm()
            cos = torch.nn.functional.cosine_similarity(
                direction.to(sae.W_dec.device), sae.W_dec.detach(), dim=-1
            )
            cos = cos.float().cpu()
            results = [word_absorption(acts[index], features[index], cos, direction, probing.split[letter])
                       for index in range(len(words))]  # fmt: skip
            row["mean_absorption_fraction"] = sum(fraction for fraction, _ in results) / len(words)
            row["num_full_absorption"] = sum(full for _, full in results)
            row["full_absorption_rate"] = row["num_full_absorption"] / len(words)
        letters.append(row)
    return summarised(letters, config)


def summarised(letters: list[dict[str, Any]], config: AbsorptionConfig) -> dict[str, Any]:
    """SAEBench's ``run_eval`` aggregate: the means (and standard deviations) over the letters whose
    probe's F1 is above ``min_probe_f1`` and that had true positives, when ``min_letters`` letters
    pass; otherwise no scores, and why."""
    passing = [row for row in letters if row["probe_f1"] > config.min_probe_f1]
    counted = [row for row in passing if row["mean_absorption_fraction"] is not None]
    for row in letters:
        row["counted"] = row in counted
    metrics: dict[str, float | None] = {}
    scored = len(passing) >= config.min_letters and counted
    for name, column in SCORES:
        values = [float(row[column]) for row in counted] if scored else []
        metrics[f"mean_{name}"] = statistics.mean(values) if values else None
        metrics[f"std_dev_{name}"] = statistics.stdev(values) if len(values) > 1 else None
    reason = (
        ""
        if scored
        else (
            f"{len(passing)} of 26 letters have a first-letter probe with F1 > {config.min_probe_f1}; "
            f"absorption needs {config.min_letters}: the model does not know its words' first letters "
            "well enough at this hook."
        )
    )
    return {
        "metrics": {"mean": metrics},
        "letters": letters,
        "letters_passing": len(passing),
        "not_scored": reason,
    }


def absorption(
    model: Any,
    tokenizer: Any,
    saes: Sequence[SparseAutoencoder],
    *,
    hook_name: str,
    config: AbsorptionConfig,
    should_cancel: Callable[[], bool] | None = None,
    progress: Callable[[float], None] | None = None,
) -> list[dict[str, Any]]:
    """Feature absorption of each of ``saes`` (all reading ``hook_name``): the model's probe
    trained once, then each SAE's k-sparse probes and absorption (see the module's docstring)."""
    vocabulary = chosen_words(tokenizer, config)
    expected = prompts_read(len(vocabulary), config, len(saes))
    read = {"prompts": 0}

    def reading(count: int) -> None:
        read["prompts"] += count
        if progress is not None:
            progress(min(read["prompts"] / expected, 0.99))

    shared = model_probe(model, tokenizer, vocabulary, hook_name=hook_name, config=config,
                         should_cancel=should_cancel, progress=reading)  # fmt: skip
    results = []
    for sae in saes:
        if should_cancel is not None and should_cancel():
            raise EvaluationCancelled
        result = sae_absorption(model, tokenizer, sae, shared, hook_name=hook_name, config=config,
                                should_cancel=should_cancel, progress=reading)  # fmt: skip
        result["words"] = {"train": len(shared.train_words), "test": len(shared.test_words)}
        result["word_position"] = shared.position
        results.append(result)
    if progress is not None:
        progress(1.0)
    return results
