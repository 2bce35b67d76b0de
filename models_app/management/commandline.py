"""What the commands share: finding a model by id or name, an owner by username, tables, waiting
with a progress bar."""

import time
from collections.abc import Callable
from typing import Any

from django.core.management.base import CommandError

from models_app.models import LanguageModel
from models_app.selectors import models_named


def find_model(reference: str) -> LanguageModel:
    """A model by id (``m_…``) or by its unique name."""

    matches = models_named(LanguageModel.objects.all(), reference)
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise CommandError(f"More than one model is named {reference!r}: use its id.")
    raise CommandError(f"No model with id or name {reference!r} (see `manage.py list_models`).")


def find_owner(username: str | None):
    """The active user named ``username`` (None when none is named), or a ``CommandError``."""
    from django.contrib.auth import get_user_model

    if not username:
        return None
    owner = get_user_model().objects.filter(username=username, is_active=True).first()
    if owner is None:
        raise CommandError(f"No active user {username!r}.")
    return owner


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [headers, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(line.rstrip() for line in lines)


def gigabytes(size: int | None) -> str:
    return "—" if size is None else f"{size / 2**30:.2f} GB"


class ExactWriter:
    """A file for tqdm over a command's OutputWrapper, which would otherwise end every write
    with a newline and so print each redraw of the progress bar on a line of its own."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        # tqdm draws with Unicode blocks only where the file says it can take them.
        self.encoding = getattr(wrapper, "encoding", None) or "utf-8"

    def write(self, text: str) -> None:
        self.wrapper.write(text, ending="", style_func=plain)

    def flush(self) -> None:
        self.wrapper.flush()

    def isatty(self) -> bool:
        return self.wrapper.isatty()


def plain(text: str) -> str:
    """A style function that leaves text alone (Django paints everything on stderr red)."""
    return text


def wait_for_load(model: LanguageModel, *, timeout: float, stdout) -> LanguageModel:
    """Follow the row until it leaves ``loading``, drawing its progress and stage."""
    from django.core.management.base import OutputWrapper
    from tqdm import tqdm

    if isinstance(stdout, OutputWrapper):
        stdout = ExactWriter(stdout)

    deadline = time.monotonic() + timeout
    with tqdm(
        total=100, unit="%", desc=model.name, file=stdout, bar_format="{l_bar}{bar}| {n:.0f}% {postfix}"
    ) as bar:
        while True:
            model.refresh_from_db()
            bar.n = model.progress
            bar.set_postfix_str(model.status_message or model.stage)
            if model.status != LanguageModel.Status.LOADING:
                return model
            if time.monotonic() > deadline:
                raise CommandError(f"Still loading after {timeout:.0f} s; it goes on in the worker.")
            time.sleep(0.3)


def follow_job(
    row,
    *,
    stdout,
    timeout: float,
    total: float,
    done: Callable[[Any], float],
    postfix: Callable[[Any], str],
    what: str,
    **bar: Any,
) -> None:
    """Follow a job row (``mistudio.jobs.JobRow``) with a progress bar until it ends: ``done(row)`` of
    ``total`` drawn, ``postfix(row)`` beside it; a row that did not complete is a ``CommandError``
    with its code, and so is waiting past ``timeout`` (the job goes on in the worker: ``what``)."""
    from django.core.management.base import OutputWrapper
    from tqdm import tqdm

    deadline = time.monotonic() + timeout
    out = ExactWriter(stdout) if isinstance(stdout, OutputWrapper) else stdout
    with tqdm(total=total, desc=str(row.pk), file=out, **bar) as progress:
        while row.status in row.ACTIVE:
            if time.monotonic() > deadline:
                raise CommandError(f"Timed out waiting; the {what} goes on in the worker.")
            time.sleep(0.5)
            row.refresh_from_db()
            progress.n = done(row)
            progress.set_postfix_str(postfix(row))
    if row.status != row.Status.COMPLETED:
        raise CommandError(f"{row.status}: {row.error_code} {row.error_message}".strip())
