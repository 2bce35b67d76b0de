"""A job's progress bar says where a queued job stands (its place in line from the row's ``queue``)."""

from mistudio_client.jobs import _where


def test_the_bar_says_a_queued_jobs_place_in_line():
    assert _where({"status": "queued", "queue": {"position": 3}}) == "queued, #3 in line"
    assert _where({"status": "queued", "queue": None}) == "queued"  # an event's state: no place
    assert _where({"status": "running", "queue": None}) == "running"
