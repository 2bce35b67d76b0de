"""Pages: datasets (upload, list, preview, delete)."""

from django.conf import settings
from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_safe

from activations import selectors, services
from frontend.access import reader_required
from mistudio.errors import ApplicationError

# Samples the detail page renders at once; "Load more" pages on through the samples API (≤ 100).
PREVIEW_PAGE_SIZE = 20
UPLOAD_FORMATS = [
    ("", "Guess from the file name"),
    ("text_lines", "Text: one sample per line"),
    ("text_paragraphs", "Text: paragraphs split by blank lines"),
    ("jsonl", "JSON Lines"),
    ("csv", "CSV"),
]


@reader_required
@require_safe
def dataset_list_page(request):
    """Every dataset the user may read, with the upload panel for writers.

    Uploads and deletions go through ``/api/datasets`` from ``datasets.js``.
    """
    datasets = selectors.dataset_list(user=request.user)
    return render(
        request,
        "frontend/datasets.html",
        {
            "datasets": datasets,
            "formats": UPLOAD_FORMATS,
            "max_upload_bytes": settings.DATASET_MAX_UPLOAD_BYTES,
        },
    )


@reader_required
@require_safe
def dataset_detail_page(request, dataset_id: str):
    """A dataset's metadata, the first samples (more through the samples API) and its caches."""
    try:
        dataset = selectors.dataset_get(user=request.user, dataset_id=dataset_id)
    except ApplicationError as error:
        raise Http404(error.message) from None
    try:
        samples = services.dataset_samples(dataset, limit=PREVIEW_PAGE_SIZE)
        missing_file = False
    except FileNotFoundError:  # the row outlived its file (deleted by hand): say so, keep the page
        samples, missing_file = [], True
    return render(
        request,
        "frontend/dataset_detail.html",
        {
            "dataset": dataset,
            "samples": [{"index": index, "text": text} for index, text in enumerate(samples)],
            "page_size": PREVIEW_PAGE_SIZE,
            "missing_file": missing_file,
            "caches": selectors.cache_list(user=request.user, filters={"dataset": dataset.id}).select_related(
                "model"
            ),
        },
    )
