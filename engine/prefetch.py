"""Reading ahead on a thread: the next items of a loader are prepared while the caller works.

:func:`prefetched` is the reading side of the extraction pipeline (whose writing side is
``activations.store.BackgroundWriter``): SAE training reads its shuffled batches from the cache
(memory-mapped reads, concatenation, a permutation) on a thread, at most ``depth`` batches ahead,
while the training step runs. With ``pin_memory`` the batches are page-locked there (the batch of
a ``(batch, position)`` pair too), so the step's ``batch.to("cuda", non_blocking=True)`` is a real
asynchronous copy.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["prefetched"]

_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _pinned(item: Any) -> Any:
    """``item`` page-locked: a tensor, or the tensors of a tuple (a batch with its stream position)."""
    if isinstance(item, tuple):
        return tuple(_pinned(part) for part in item)
    return item.pin_memory() if hasattr(item, "pin_memory") else item


def prefetched(items: Iterable[Any], *, depth: int = 2, pin_memory: bool = False) -> Iterator[Any]:
    """The items of ``items``, produced on a thread at most ``depth`` ahead of the caller.

    Same items in the same order. An exception raised by ``items`` is raised here, at the point
    the caller would have met it. When the caller stops early (``close()``, an exception, garbage
    collection), the thread stops after the item it is producing.
    """
    if depth < 1:
        raise ValueError("depth must be at least 1")
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stopping = threading.Event()

    def put(item: Any) -> bool:
        while not stopping.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if pin_memory:
                    item = _pinned(item)
                if not put(item):
                    return
            put(_END)
        except BaseException as error:  # handed to the caller
            put(_Failed(error))

    thread = threading.Thread(target=produce, name="prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stopping.set()
        thread.join()
