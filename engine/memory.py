"""Keeping a long sweep's resident memory flat: give freed heap and read map pages back to the OS.

Two things make a process's RSS grow with the size of what it streams through, though nothing it
holds does:

* glibc's allocator raises its mmap threshold after a large block is freed, so the next chunk's
  large temporaries come from the heap instead, where they fragment it: the heap of a sweep over
  4M rows grew by ~250 MiB that it never returned. :func:`release_freed_heap` (``malloc_trim``)
  returns the free pages; called every few chunks it costs nothing measurable.
* pages of a memory-mapped file stay in the process's resident set once read, so a pass over a
  memory-mapped column (or random reads all over it) leaves all of it resident.
  :func:`drop_mapped_pages` drops them (``madvise(MADV_DONTNEED)``: the mapping stays, a later
  read faults the page back in from the page cache).

Both are no-ops where the platform lacks them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from typing import Any


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_heap() -> None:
    """Return the heap's free pages to the OS (glibc's ``malloc_trim(0)``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def drop_mapped_pages(array: Any) -> None:
    """Drop the resident pages of the read-only memory map under ``array`` (a numpy memmap or a
    view of one); nothing for an array in ordinary memory. (On a copy-on-write map it would
    discard the writes: the caches' maps are read-only.)"""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is not None and hasattr(mmap, "MADV_DONTNEED"):
        base.madvise(mmap.MADV_DONTNEED)
