"""The datasets pages as the server renders them: the list, the empty state, the sample preview, 404s,
and what a reader (no model:write) is not offered."""

import re

import pytest
from django.test import Client

from activations.models import Dataset
from activations.services import dataset_create_from_texts
from frontend.views.datasets import PREVIEW_PAGE_SIZE

pytestmark = pytest.mark.django_db


def signed_in(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


def make_dataset(owner, name="pile-sample", texts=("first sample", "second sample", "third")):
    return dataset_create_from_texts(
        name=name,
        texts=list(texts),
        owner=owner,
        source="upload",
        original_name=f"{name}.txt",
        format="text_lines",
    )


def test_the_list_shows_each_dataset_with_its_counts_and_a_link(writer):
    dataset = make_dataset(writer)
    other = make_dataset(writer, name="wiki", texts=["only one"])
    page = signed_in(writer).get("/datasets/").content.decode()
    for row in (dataset, other):
        assert f'href="/datasets/{row.id}/"' in page and f'<code class="id">{row.id}</code>' in page
        assert row.content_hash[:12] in page
    assert 'data-testid="sample-count">3<' in page and 'data-testid="sample-count">1<' in page
    assert "2 datasets" in page
    # A writer gets the upload panel (a real button over the hidden file input) and delete buttons.
    assert 'id="upload-form"' in page and '<button type="button" class="dropzone"' in page
    assert page.count('data-action="delete"') == 2
    assert 'id="dataset-empty" hidden' in page  # the empty state waits for the last delete


def test_no_datasets_shows_how_to_add_one(writer):
    page = signed_in(writer).get("/datasets/").content.decode()
    assert "No datasets yet" in page
    assert 'id="dataset-table-wrap"' in page and 'hidden id="dataset-table-wrap"' in page
    for hint in (
        "one text per line",
        '<code>"text"</code> field',
        "<code>text</code> column",
        "manage.py add_dataset",
    ):
        assert hint in page


def test_a_reader_sees_the_datasets_but_no_upload_or_delete(reader, writer):
    dataset = make_dataset(writer)
    Dataset.objects.filter(pk=dataset.pk).update(shared=True)  # another user's: visible once shared
    browser = signed_in(reader)
    listing = browser.get("/datasets/").content.decode()
    assert dataset.name in listing
    assert 'id="upload-form"' not in listing and 'data-action="delete"' not in listing
    detail = browser.get(f"/datasets/{dataset.id}/").content.decode()
    assert "second sample" in detail and 'id="delete-dataset"' not in detail


def test_the_detail_page_previews_the_first_samples_escaped_with_index_and_length(writer):
    texts = ["<b>not bold</b> & more"] + [f"sample number {index}" for index in range(1, 30)]
    dataset = make_dataset(writer, texts=texts)
    page = signed_in(writer).get(f"/datasets/{dataset.id}/").content.decode()
    assert "&lt;b&gt;not bold&lt;/b&gt; &amp; more" in page and "<b>not bold</b>" not in page
    assert f'<span class="sample-index">#0</span><span class="muted small">{len(texts[0])} characters' in page
    assert f"sample number {PREVIEW_PAGE_SIZE - 1}<" in page
    assert f"sample number {PREVIEW_PAGE_SIZE}<" not in page  # the rest comes through "Load more"
    assert 'id="load-more"' in page and f"Showing 1\u2013{PREVIEW_PAGE_SIZE} of 30" in page
    assert dataset.content_hash in page and 'id="delete-dataset"' in page


def items(markup: str) -> list[str]:
    return re.findall(r'<li class="sample".*?</li>', markup, flags=re.S)


def test_load_more_fetches_the_next_samples_as_the_page_renders_them(writer):
    texts = [f"sample number {index}" for index in range(PREVIEW_PAGE_SIZE + 5)] + ["<i>last</i>"]
    dataset = make_dataset(writer, texts=texts)
    browser = signed_in(writer)
    page = browser.get(f"/datasets/{dataset.id}/").content.decode()
    first = browser.get(f"/datasets/{dataset.id}/", {"fragment": "samples", "offset": 0}).content.decode()
    assert items(first) and items(first) == items(page)  # the same items as the page's
    more = browser.get(f"/datasets/{dataset.id}/", {"fragment": "samples", "offset": PREVIEW_PAGE_SIZE})
    html = more.content.decode()
    assert more.status_code == 200 and "<html" not in html
    assert html.count('<li class="sample"') == 6
    assert f'data-index="{PREVIEW_PAGE_SIZE}"' in html and f"sample number {PREVIEW_PAGE_SIZE}<" in html
    assert "&lt;i&gt;last&lt;/i&gt;" in html and '<span class="muted small">11 characters' in html
    past_the_end = browser.get(f"/datasets/{dataset.id}/", {"fragment": "samples", "offset": len(texts)})
    assert past_the_end.status_code == 404
    assert browser.get(f"/datasets/{dataset.id}/", {"fragment": "samples", "offset": "x"}).status_code == 404


def test_the_row_fragment_is_the_row_the_list_renders(writer, reader):
    dataset = make_dataset(writer, name="fresh-upload")
    browser = signed_in(writer)
    page = browser.get("/datasets/").content.decode()
    response = browser.get("/datasets/", {"fragment": "row", "dataset": dataset.id})
    assert response.status_code == 200
    row = response.content.decode().strip()
    assert row.startswith(f'<tr data-dataset-id="{dataset.id}" data-name="fresh-upload">') and row in page
    assert 'data-testid="sample-count">3<' in row and 'data-action="delete"' in row
    # Another user's private dataset has no row; a reader's row has no delete button.
    assert signed_in(reader).get("/datasets/", {"fragment": "row", "dataset": dataset.id}).status_code == 404
    Dataset.objects.filter(pk=dataset.pk).update(shared=True)
    reader_row = signed_in(reader).get("/datasets/", {"fragment": "row", "dataset": dataset.id})
    assert reader_row.status_code == 200 and 'data-action="delete"' not in reader_row.content.decode()


def test_a_short_dataset_has_no_load_more(writer):
    dataset = make_dataset(writer)
    page = signed_in(writer).get(f"/datasets/{dataset.id}/").content.decode()
    assert "third<" in page and 'id="load-more"' not in page


def test_a_missing_samples_file_is_said_not_raised(writer):
    dataset = make_dataset(writer)
    dataset.storage_path.unlink()
    response = signed_in(writer).get(f"/datasets/{dataset.id}/")
    assert response.status_code == 200 and "missing on disk" in response.content.decode()


def test_unknown_datasets_are_404_and_a_user_without_a_role_is_told_so(writer, django_user_model):
    dataset = make_dataset(writer)
    assert signed_in(writer).get("/datasets/ds_nope/").status_code == 404
    no_role = django_user_model.objects.create_user(username="no-role", password="x")
    refused = signed_in(no_role).get(f"/datasets/{dataset.id}/")
    assert refused.status_code == 403 and "Your account has no role yet" in refused.content.decode()
    assert dataset.name not in refused.content.decode()


def test_anonymous_visitors_are_sent_to_sign_in():
    for path in ("/datasets/", "/datasets/ds_x/"):
        response = Client().get(path)
        assert response.status_code == 302 and response["Location"].startswith("/login/")
