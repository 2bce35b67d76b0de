"""Pages: datasets (upload, list, preview, delete)."""

from django.conf import settings
from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_safe

from activations import selectors, services
from frontend.access import reader_required
from mistudio.errors import ApplicationError

# Samples the detail page renders at once; "Load more" asks for as many again (?fragment=samples).
PREVIEW_PAGE_SIZE = 20
UPLOAD_FORMATS = [
    ("", "Guess from the file name"),
    ("text_lines", "Text: one sample per line"),
    ("text_paragraphs", "Text: paragraphs split by blank lines"),
    ("jsonl", "JSON Lines"),
    ("csv", "CSV"),
    ("parquet", "Parquet"),
]


def _dataset_or_404(user, dataset_id: str):
    try:
        return selectors.dataset_get(user=user, dataset_id=dataset_id)
    except ApplicationError as error:
        raise Http404(error.message) from None


def _whole_number(raw: str) -> int:
    try:
        return max(int(raw), 0)
    except ValueError:
        raise Http404("The offset must be a whole number.") from None


@reader_required
@require_safe
def dataset_list_page(request):
    """Every dataset the user may read, with the upload panel for writers.

    Uploads and deletions go through ``/api/datasets`` from ``datasets.js``, which then asks for the
    new dataset's row (``?fragment=row&dataset=<id>``: only ``partials/dataset_row.html``).
    """
    if request.GET.get("fragment") == "row":
        dataset = _dataset_or_404(request.user, request.GET.get("dataset", ""))
        return render(request, "frontend/partials/dataset_row.html", {"dataset": dataset})
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
    """A dataset's metadata, the first samples and its caches.

    "Load more" asks for the next samples as ``?fragment=samples&offset=<n>`` (only
    ``partials/dataset_samples.html``; 404 past the end).
    """
    dataset = _dataset_or_404(request.user, dataset_id)
    offset = _whole_number(request.GET.get("offset", "0")) if request.GET.get("fragment") == "samples" else 0
    try:
        texts = services.dataset_samples(dataset, limit=offset + PREVIEW_PAGE_SIZE)[offset:]
        missing_file = False
    except FileNotFoundError:  # the row outlived its file (deleted by hand): say so, keep the page
        texts, missing_file = [], True
    samples = [{"index": offset + index, "text": text} for index, text in enumerate(texts)]
    if request.GET.get("fragment") == "samples":
        if not samples:  # past the end, or the file is gone: datasets.js stops offering more
            raise Http404("No more samples.")
        return render(request, "frontend/partials/dataset_samples.html", {"samples": samples})
    return render(
        request,
        "frontend/dataset_detail.html",
        {
            "dataset": dataset,
            "samples": samples,
            "missing_file": missing_file,
            "caches": selectors.cache_list(user=request.user, filters={"dataset": dataset.id}).select_related(
                "model"
            ),
        },
    )
