"""A cache writer on its own thread: the forward pass of batch n+1 runs while batch n is written.

:class:`BackgroundWriter` takes extracted batches and hands them to a :class:`CacheWriter` on a
thread, at most ``depth`` batches behind (a bounded queue: when the disk is slower than the model,
:meth:`BackgroundWriter.add_extracted` waits — back-pressure, not growth). An error in the writer
(``DISK_FULL``, …) is raised in the caller at its next ``add_extracted`` or at :meth:`finish`,
so a job handles it as it did when writing inline. Nothing changes on disk: the CacheWriter still
writes whole shards and the manifest lists only durable ones, so resuming is unchanged.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from activations.store.writer import CacheWriter

_STOP = object()


class BackgroundWriter:
    def __init__(self, writer: CacheWriter, *, depth: int = 2) -> None:
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._abandon = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _STOP:
                return
            if self._error is not None or self._abandon.is_set():
                continue  # after a failure (or being abandoned) batches are dropped, not written
            try:
                self.writer.add_extracted(batch)
            except BaseException as error:  # handed to the caller
                self._error = error

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def add_extracted(self, batch: Any) -> None:
        """Queue a batch for writing (waits while ``depth`` batches are queued)."""
        self._raise_error()
        while True:
            try:
                self._queue.put(batch, timeout=0.5)
                return
            except queue.Full:
                self._raise_error()  # the writer failed while this waited

    def finish(self) -> None:
        """Wait until every queued batch is handed to the writer; raise the writer's error if any."""
        self._stop()
        self._raise_error()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def abandon(self) -> None:
        """Stop without writing what is still queued (a cancel or a failure elsewhere); a shard
        being written when this is called is finished first."""
        self._abandon.set()
        self._stop()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            self.abandon()
        else:
            self.finish()
