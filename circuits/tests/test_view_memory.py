"""The web process's memory budget for graph views (``circuits.view_memory``): a view reserves what
its prune and JSON take before it starts; one over the budget alone is a 400 that says what would
fit, one that finds the budget taken is a 503 with Retry-After, and neither leaves anything held;
a graph's view is sized by the worker so that its widest prune fits the budget alone."""

import pytest

from circuits.tests.conftest import computed_graph, transcoder_rows
from circuits.view_memory import (
    MAX_LINKS,
    budget_bytes,
    held_bytes,
    stored_nodes_cap,
    view_memory,
    view_memory_bytes,
)
from engine.attribution.prunable import PRUNE_BASE_BYTES
from mistudio.errors import ApplicationError
from models_app.tests.burst_worker import load_on_burst_worker

pytestmark = pytest.mark.django_db(transaction=True)
WORKER = "view-memory-worker"
PROMPT = "The cat sat on the mat"


@pytest.fixture
def graph(tiny_gpt2_folder, writer, client_for):
    model = load_on_burst_worker(tiny_gpt2_folder, writer, worker=WORKER)
    transcoders = transcoder_rows(model, tiny_gpt2_folder, writer)
    return computed_graph(client_for(writer), model, transcoders, worker=WORKER, prompt=PROMPT)


def test_a_view_over_the_budget_or_into_a_full_one_is_refused(graph, writer, client_for, settings):
    api = client_for(writer)
    url = f"/api/graphs/{graph.id}/nodes"
    assert api.get(url).status_code == 200

    # The same view again is served as rendered (nothing to reserve): any other is checked.
    settings.GRAPH_VIEW_MEMORY_MB = 16  # less than what torch takes on its first calls: every view is over it
    assert api.get(url).status_code == 200
    # Only the row's own view is kept rendered: the same view at other thresholds is computed anew
    # each time (a client spelling thresholds could otherwise fill Redis with renders).
    settings.GRAPH_VIEW_MEMORY_MB = 512
    other = {"edge_threshold": 0.9}
    assert api.get(url, other).status_code == 200
    settings.GRAPH_VIEW_MEMORY_MB = 16
    assert api.get(url, other).status_code == 400
    too_large = api.get(url, {"edge_threshold": 0.97})
    assert too_large.status_code == 400, too_large.content
    error = too_large.json()["error"]
    assert error["code"] == "GRAPH_VIEW_TOO_LARGE" and "GRAPH_VIEW_MEMORY_MB" in error["message"]
    assert error["details"]["estimate_bytes"] > error["details"]["limit_bytes"] == 16 * 2**20

    # Others' views hold all but a little of the budget: refused at once with Retry-After, then served.
    settings.GRAPH_VIEW_MEMORY_MB = 512
    settings.GRAPH_VIEW_WAIT_SECONDS = 0
    with view_memory(budget_bytes() - 2**20, what="others' views", advice=""):
        busy = api.get(url, {"node_threshold": 0.5})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "GRAPH_VIEWS_BUSY"
        assert busy["Retry-After"] == "2"
    assert held_bytes() == 0
    assert api.get(url, {"node_threshold": 0.5}).status_code == 200
    assert held_bytes() == 0


def test_a_view_is_sized_so_that_its_widest_prune_fits_the_budget_alone(settings):
    for memory_mb, fixed in ((512, 60), (512, 2100), (128, 60), (128, 1100)):  # (128: the least allowed)
        settings.GRAPH_VIEW_MEMORY_MB = memory_mb
        cap = stored_nodes_cap(fixed)
        assert 100 < cap <= settings.GRAPH_VIEW_MAX_NODES
        assert view_memory_bytes(fixed + cap) <= budget_bytes()
        if cap < settings.GRAPH_VIEW_MAX_NODES:  # as many as the budget allows
            assert view_memory_bytes(fixed + cap + 1) > budget_bytes()
    settings.GRAPH_VIEW_MEMORY_MB = 512
    assert stored_nodes_cap(60) == settings.GRAPH_VIEW_MAX_NODES == 2000
    assert view_memory_bytes(1000) >= PRUNE_BASE_BYTES + MAX_LINKS * 512


def test_one_users_views_run_one_at_a_time_and_others_are_not_held_up(settings):
    """A user's parallel views wait for each other (429 past ``GRAPH_VIEW_WAIT_SECONDS``): a loop of
    views on several connections takes one thread's worth of the web process; another user's view
    goes on meanwhile."""
    import threading

    settings.GRAPH_VIEW_WAIT_SECONDS = 0.3
    inside, release = threading.Event(), threading.Event()

    def mallorys_first_view():
        with view_memory(2**20, what="a view", advice="", viewer="mallory"):
            inside.set()
            release.wait(5)

    first = threading.Thread(target=mallorys_first_view)
    first.start()
    assert inside.wait(5)
    with (
        pytest.raises(ApplicationError) as refused,
        view_memory(2**20, what="a view", advice="", viewer="mallory"),
    ):
        pass
    assert refused.value.status == 429 and refused.value.details["scope"] == "graph_views"
    with view_memory(2**20, what="a view", advice="", viewer="bob"):  # at once
        assert held_bytes() == 2 * 2**20
    release.set()
    first.join(5)
    with view_memory(2**20, what="a view", advice="", viewer="mallory"):  # hers again, now hers ended
        pass
    assert held_bytes() == 0


def test_graph_views_share_one_rate_per_user(graph, writer, model_admin, client_for, settings):
    """Views served as rendered still take the web process's CPU: /nodes and /export share one
    rate per user (a loop of views on four connections took a core); another user goes on."""
    rates = {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "graph_view": "3/minute"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}
    api = client_for(writer)
    for path in ("nodes", "nodes", "export"):
        assert api.get(f"/api/graphs/{graph.id}/{path}").status_code == 200
    refused = api.get(f"/api/graphs/{graph.id}/nodes")
    assert refused.status_code == 429, refused.content
    error = refused.json()["error"]
    assert error["code"] == "RATE_LIMITED" and error["details"]["scope"] == "graph_view"
    assert refused["Retry-After"] == str(error["details"]["retry_after_seconds"])
    assert client_for(model_admin).get(f"/api/graphs/{graph.id}/nodes").status_code != 429
