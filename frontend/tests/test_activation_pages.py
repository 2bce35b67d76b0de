"""The activation pages as the server renders them, over a cache made by a real extraction (tiny
GPT-2, real burst worker): the list and its empty state, the browser's charts against the store's
own numbers, a neuron's top tokens, a sample's heatmap, the fragments the page script fetches,
a generation's cache, 404s and caches that cannot be browsed (yet)."""

import re
import subprocess
import sys
from html import unescape

import numpy as np
import pytest
from django.conf import settings
from django.test import Client

from activations.models import ActivationCache, Dataset, ExtractionJob
from activations.selectors import tokenizer_for
from activations.services import dataset_create_from_texts, extraction_request
from activations.store import ActivationStore
from frontend.hook_stats import HISTOGRAM_BINS
from frontend.views.activations import CONTEXT_TOKENS, TOP_K
from mistudio.workers import run_worker
from models_app.services import model_register

pytestmark = pytest.mark.django_db(transaction=True)
HOOKS = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post", "ln_final.hook_normalized"]
TEXTS = [
    "The function returns the value of the argument.",
    "Short one.",
    "Some <b>markup</b> & a line,\nthen a tail long enough to be cut at the extraction's max_length of 32.",
    "Numbers 1 2 3 and more numbers 4 5 6.",
]


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


@pytest.fixture
def extracted(tiny_gpt2_folder, writer):
    """A completed cache from a real extraction of four hooks over four texts."""
    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gpt2", owner=writer)
    dataset = dataset_create_from_texts(
        name="four texts", texts=TEXTS, owner=writer, source=Dataset.Source.BUILTIN
    )
    job = extraction_request(
        model_id=model.id, dataset_id=dataset.id, owner=writer, hooks=HOOKS, batch_size=2, max_length=32
    )
    run_worker(name="pages-worker", device="cpu", burst=True)
    job = ExtractionJob.objects.get(pk=job.id)
    assert job.status == "completed", (job.error_code, job.error_message)
    return job.cache, ActivationStore.open(job.cache.directory)


def count_of(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def section(page: str, element_id: str) -> str:
    """The markup from the element with this id to the end of its enclosing block (good enough for
    counting what sits inside a panel the template closes right after)."""
    start = page.index(f'id="{element_id}"')
    return page[start : page.index("</section>", start)]


def token_spans(markup: str) -> list[tuple[str, float, str]]:
    """(classes, data-value, text) of each token span."""
    spans = re.findall(
        r'<span class="(tok[^"]*)" data-alpha="[0-9.]+" title="[^"]*" data-value="([^"]+)">(.*?)</span>',
        markup,
    )
    return [(classes, float(value), unescape(text)) for classes, value, text in spans]


def test_no_caches_explains_how_to_make_one(writer):
    page = signed_in(writer).get("/activations/").content.decode()
    assert "No activation caches yet" in page
    assert 'href="/"' in page and 'href="/playground/"' in page and 'href="/datasets/"' in page
    assert "extract-activations" in page and 'id="cache-table"' not in page


def test_the_list_shows_each_cache_with_its_provenance(extracted, writer):
    cache, store = extracted
    page = signed_in(writer).get("/activations/").content.decode()
    row = page[page.index(f'data-cache-id="{cache.id}"') :]
    row = row[: row.index("</tr>")]
    assert f'href="/activations/{cache.id}/"' in row
    assert f'href="/models/{cache.model_id}/"' in row and "tiny-gpt2" in row
    assert f'href="/datasets/{cache.dataset_id}/"' in row and "four texts" in row
    assert 'data-testid="hook-count">4<' in row and f">{store.num_tokens}<" in row
    assert "float32" in row and 'class="badge status-completed"' in row
    assert "No activation caches yet" not in page
    # A filter that matches nothing says so, and links back to everything.
    filtered = signed_in(writer).get("/activations/?status=failed").content.decode()
    assert "No cache matches these filters" in filtered and cache.id not in filtered.split("<section")[1]


def test_the_browser_charts_are_the_stores_numbers(extracted, writer):
    cache, store = extracted
    response = signed_in(writer).get(f"/activations/{cache.id}/?hook=blocks.0.hook_resid_post")
    assert response.status_code == 200
    page = response.content.decode()

    # Histogram: one bar per bin (in the linear and the log chart), the bars count every value.
    linear = page[page.index('class="chart-linear"') : page.index('class="chart-log"')]
    counts = [int(count) for count in re.findall(r'class="bar-fill"[^>]*data-count="(\d+)"', linear)]
    tokens, width = store.shape("blocks.0.hook_resid_post")
    assert len(counts) == HISTOGRAM_BINS and sum(counts) == tokens * width
    assert counts == store.histogram("blocks.0.hook_resid_post", bins=HISTOGRAM_BINS)["counts"].tolist()
    assert count_of('class="bar-fill"', page) == 2 * HISTOGRAM_BINS

    # Norm chart: one point per hook, in layer order, at the store's mean L2 norm.
    norm = page[page.index('id="norm-chart"') :]
    points = re.findall(r'data-hook="([^"]+)" data-value="([^"]+)"', norm[: norm.index("</svg>")])
    assert [hook for hook, _ in points] == HOOKS
    for hook, value in points:
        assert float(value) == pytest.approx(store.stats(hook)["mean_l2_norm"], rel=1e-12)
    assert 'class="dot current"' in norm and 'data-hook="blocks.0.hook_resid_post"' in norm

    # Provenance and exports.
    assert f'href="/models/{cache.model_id}/"' in page and f'href="/datasets/{cache.dataset_id}/"' in page
    assert f'href="/api/activation-caches/{cache.id}/download"' in page
    assert "?file=blocks.0.hook_resid_post%2F00000.safetensors" in page
    for hook in HOOKS:
        assert f"<code>{hook}</code>" in page and f"[{tokens}, {store.shape(hook)[1]}]" in page


def test_the_neuron_panel_lists_the_stores_top_k_with_context_values(extracted, writer):
    cache, store = extracted
    hook, neuron = "blocks.1.mlp.hook_post", 7
    page = signed_in(writer).get(f"/activations/{cache.id}/?hook={hook}&neuron={neuron}").content.decode()
    panel = section(page, "neuron-panel")
    expected = store.top_k(hook, neuron, TOP_K, context=CONTEXT_TOKENS)
    shown = [float(value) for value in re.findall(r'<span class="value" data-value="([^"]+)"', panel)]
    assert shown == [row["value"] for row in expected] and len(shown) == TOP_K

    tokenizer = tokenizer_for(str(cache.model.identifier))
    items = panel.split("<li ")[1:]
    activations = store.get(hook)[:, neuron]
    for item, row in zip(items, expected, strict=True):
        spans = token_spans(item)
        assert len(spans) == len(row["context_token_ids"])
        center = [index for index, (classes, _, _) in enumerate(spans) if "center" in classes.split()]
        assert center == [row["center"]]
        # Each context token is coloured by this neuron's own value at that token.
        first = row["row"] - row["center"]
        assert [value for _, value, _ in spans] == pytest.approx(
            activations[first : first + len(spans)].tolist()
        )
        text = "".join(text for _, _, text in spans)
        assert text == tokenizer.decode(row["context_token_ids"]).replace("\n", "↵")
    # The quick picks are the neurons with the highest max.
    maxima = store.stats(hook)["max"]
    picks = [int(index) for index in re.findall(r'class="pick" data-neuron="(\d+)"', page)]
    assert picks == np.argsort(-maxima, kind="stable")[:10].tolist()


def test_the_sample_heatmap_has_one_token_per_stored_token(extracted, writer):
    cache, store = extracted
    hook, neuron, sample = "hook_embed", 3, 2
    page = signed_in(writer).get(f"/activations/{cache.id}/?hook={hook}&neuron={neuron}&sample={sample}")
    panel = section(page.content.decode(), "sample-panel")
    spans = token_spans(panel)
    token_ids, _positions = store.sample_tokens(sample)
    assert len(spans) == len(token_ids)
    assert [value for _, value, _ in spans] == pytest.approx(store.sample(hook, sample)[:, neuron].tolist())
    text = "".join(text for _, _, text in spans)
    assert text == tokenizer_for(cache.model.identifier).decode(token_ids).replace("\n", "↵")
    assert text.startswith("Some <b>markup</b> & a line,↵then a tail")  # Ġ as a space, Ċ as ↵
    assert len(token_ids) == 32 and not TEXTS[sample].startswith(text)  # only the stored tokens
    assert "<b>" not in panel and "&lt;" in panel  # token text is escaped
    signs = {classes.split()[1] for classes, _, _ in spans}
    assert signs <= {"pos", "neg"} and not any("generated" in classes for classes, _, _ in spans)


def test_fragments_for_the_page_script(extracted, writer):
    cache, store = extracted
    browser = signed_in(writer)
    url = f"/activations/{cache.id}/"
    sample = browser.get(url, {"hook": "hook_embed", "neuron": 5, "sample": 1, "fragment": "sample"})
    assert sample.status_code == 200 and b"<html" not in sample.content
    assert len(token_spans(sample.content.decode())) == len(store.sample_tokens(1)[0])
    neuron = browser.get(url, {"hook": "hook_embed", "neuron": 5, "fragment": "neuron"})
    assert neuron.status_code == 200 and neuron.content.decode().count('<span class="value"') == TOP_K
    width = store.shape("hook_embed")[1]
    wrong = browser.get(url, {"hook": "hook_embed", "neuron": width, "fragment": "neuron"})
    assert wrong.status_code == 400 and f"out of range: 0 to {width - 1}" in wrong.content.decode()
    beyond = browser.get(url, {"hook": "hook_embed", "sample": len(TEXTS), "fragment": "sample"})
    assert beyond.status_code == 400 and 'role="alert"' in beyond.content.decode()
    # On the full page a bad choice is named, and the defaults are shown instead.
    page = browser.get(url, {"hook": "no.such.hook", "neuron": "x"}).content.decode()
    assert "The cache has no hook &#x27;no.such.hook&#x27;" in page and "must be a whole number" in page
    assert 'aria-selected="true" aria-current="page" title="hook_embed' in page


def test_the_python_snippet_reads_the_cache(extracted, writer, tmp_path):
    cache, store = extracted
    page = signed_in(writer).get(f"/activations/{cache.id}/?hook=blocks.0.hook_resid_post").content.decode()
    snippet = unescape(
        re.search(r'<pre class="snippet" id="snippet" tabindex="0"><code>(.*?)</code>', page, re.S)[1]
    )
    # As a user would after unpacking the tar: the cache folder in the working directory.
    (tmp_path / cache.id).symlink_to(cache.directory)
    check = "\nassert activations.shape == tuple(store.shape(hook['name']))\nprint(activations.sum())\n"
    result = subprocess.run(
        [sys.executable, "-c", snippet + check],
        cwd=tmp_path,
        env={"PYTHONPATH": str(settings.BASE_DIR), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) == pytest.approx(float(store.get("blocks.0.hook_resid_post").sum()), rel=1e-4)


def test_a_generation_cache_marks_generated_tokens(tiny_gpt2_folder, writer):
    from generation.models import Generation
    from generation.services import SamplingRequest, generation_request
    from mistudio.access import OPERATOR
    from models_app.services import model_load_request

    model = model_register(source="local", identifier=str(tiny_gpt2_folder), name="tiny-gen", owner=writer)
    model_load_request(model_id=model.id, actor=OPERATOR)
    run_worker(name="pages-gen-worker", device="cpu", burst=True)
    generation_request(
        model_id=model.id,
        owner=writer,
        prompts=["The function returns"],
        sampling=SamplingRequest(temperature=0, max_tokens=5, ignore_eos=True, max_tokens_explicit=True),
        capture=["blocks.0.hook_resid_post"],
        interface=Generation.Interface.API,
    )
    run_worker(name="pages-gen-worker", device="cpu", burst=True)
    cache = ActivationCache.objects.get(source="generation")
    store = ActivationStore.open(cache.directory)
    page = signed_in(writer).get(f"/activations/{cache.id}/").content.decode()
    spans = token_spans(section(page, "sample-panel"))
    generated = store.tokens()["generated"].tolist()
    assert len(spans) == len(generated) and sum(generated) == 5
    assert ["generated" in classes.split() for classes, _, _ in spans] == [bool(flag) for flag in generated]
    assert "captured during a generation" in page and "5 generated" in page
    listing = signed_in(writer).get("/activations/").content.decode()
    assert 'class="chip source-generation">generation<' in listing


def test_unknown_and_unreadable_caches(extracted, writer):
    cache, _store = extracted
    browser = signed_in(writer)
    assert browser.get("/activations/act_doesnotexist/").status_code == 404
    assert browser.get("/activations/act_doesnotexist/?fragment=neuron").status_code == 404

    # Still being written: its status, no charts; with its job in flight, the job's progress, which
    # the page script then follows (extraction.<id> events, or polling) until it reloads.
    ActivationCache.objects.filter(pk=cache.pk).update(status="writing")
    page = browser.get(f"/activations/{cache.id}/").content.decode()
    assert "still being written" in page and "<svg" not in page and 'id="download-tar"' not in page
    assert 'id="writing"' not in page  # no job is writing it
    job = ExtractionJob.objects.create(
        model=cache.model, dataset=cache.dataset, cache=cache, hooks=HOOKS, status="running",
        progress=37.5, samples_processed=3, total_samples=8, owner=writer,
    )  # fmt: skip
    page = browser.get(f"/activations/{cache.id}/").content.decode()
    assert f'id="writing" data-extraction-id="{job.id}"' in page
    assert 'aria-valuenow="38"' in page and "3 / 8 samples" in page and "38 %" in page
    job.delete()
    # Failed: the error, no charts.
    ActivationCache.objects.filter(pk=cache.pk).update(
        status="failed", error_code="CACHE_CORRUPT", error_message="A shard is missing."
    )
    page = browser.get(f"/activations/{cache.id}/").content.decode()
    assert "A shard is missing." in page and "<svg" not in page
    # Completed on paper, but its files are gone: said plainly, not a server error.
    ActivationCache.objects.filter(pk=cache.pk).update(status="completed")
    (cache.directory / "manifest.json").unlink()
    response = browser.get(f"/activations/{cache.id}/")
    assert response.status_code == 200 and "The cache cannot be read." in response.content.decode()


def test_signed_out_visitors_are_sent_to_sign_in(extracted):
    cache, _store = extracted
    response = Client().get(f"/activations/{cache.id}/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
