"""The feature commands: analyze_sae (waiting with its progress bar on a real worker) and show_feature."""

import io
import threading
import time

import pytest
from django.core.management import CommandError, call_command

from features.models import Feature, FeatureAnalysis
from features.services import analysis_cancel
from mistudio.access import OPERATOR
from mistudio.workers import run_worker, shared_queue

pytestmark = pytest.mark.django_db(transaction=True)


def run(*arguments) -> str:
    out = io.StringIO()
    call_command(*arguments, stdout=out)
    return out.getvalue()


ENDED = ("completed", "failed", "cancelled")


def worker_until_the_analysis_ends() -> None:
    """Burst workers until the command's analysis has ended: one burst worker that found the queue
    empty just before the job arrived once left the command following forever (CI hung). Past the
    deadline the analysis is cancelled, so the command ends and the test fails plainly."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if FeatureAnalysis.objects.filter(status__in=ENDED).exists():
            return
        if shared_queue().count > 0:
            run_worker(name="feature-cli-worker", device="cpu", burst=True)
        else:
            time.sleep(0.2)
    for analysis in FeatureAnalysis.objects.exclude(status__in=ENDED):
        analysis_cancel(analysis=analysis, actor=OPERATOR)


def test_analyze_then_show_a_feature_from_the_command_line(sae_row):
    worker = threading.Thread(target=worker_until_the_analysis_ends)
    worker.start()
    output = run("analyze_sae", sae_row.id)
    worker.join(timeout=60)
    analysis = FeatureAnalysis.objects.get()
    assert analysis.status == "completed"
    assert (
        f"Analysis {analysis.id} completed: {sae_row.d_sae} features over {analysis.tokens:,} tokens"
        in output
    )

    busiest = Feature.objects.filter(analysis=analysis).order_by("-density").first()
    shown = run("show_feature", sae_row.id, str(busiest.index))
    assert shown.startswith(f"Feature {busiest.index} of {sae_row.id}")
    assert f"density {busiest.density:.3%}" in shown and "Top activations:" in shown
    assert "Promotes:" in shown and "Similar features (decoder cosine):" in shown
    assert shown.count("[") >= 10  # ten examples, each with its activating token in brackets


def test_feature_command_errors_are_clear(sae_row):
    with pytest.raises(CommandError, match="No SAE"):
        run("analyze_sae", "sae_missing")
    with pytest.raises(CommandError, match="No activation cache"):
        run("analyze_sae", sae_row.id, "--cache", "act_missing")
    with pytest.raises(CommandError, match="NO_ANALYSIS"):
        run("show_feature", sae_row.id, "0")


def test_analyze_over_a_dataset_through_the_model_from_the_command_line(sae_row, tiny_model, writer):
    from activations.services import dataset_create_from_texts

    prose = dataset_create_from_texts(
        name="prose", texts=["The cat sat on the mat.", "A dog ran home."] * 5, owner=writer, source="upload"
    )

    worker = threading.Thread(target=worker_until_the_analysis_ends)
    worker.start()
    output = run("analyze_sae", sae_row.id, "--dataset", prose.id, "--samples", "6", "--max-length", "16")
    worker.join(timeout=60)
    analysis = FeatureAnalysis.objects.get()
    assert analysis.status == "completed" and analysis.source == "model" and analysis.cache_id is None
    assert analysis.reading["sample_count"] == 6 and analysis.reading["max_length"] == 16
    assert f"{analysis.summary['tokens']:,} tokens read through the model" in output
    with pytest.raises(CommandError, match="No dataset"):
        run("analyze_sae", sae_row.id, "--dataset", "ds_missing")
