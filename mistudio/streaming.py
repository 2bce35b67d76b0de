"""Streaming responses that neither buffer nor block under ASGI.

Django's ``StreamingHttpResponse`` and ``FileResponse`` serve a synchronous iterator to an ASGI
server by reading it whole into a list first (``sync_to_async(list)``): a multi-gigabyte cache
download would sit in the web process's memory, and the one thread every synchronous view shares
would be busy producing it. These subclasses hand over one chunk at a time, each produced in a
worker thread of its own, so memory stays at a chunk and other requests keep answering. Synchronous
consumers (WSGI, the test client, the CLI) iterate them exactly as Django's own.
"""

import tarfile
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

from asgiref.sync import sync_to_async
from django.http import FileResponse, StreamingHttpResponse

_END = object()


class _ChunkByChunk:
    async def __aiter__(self) -> AsyncIterator[bytes]:
        iterator = iter(self.streaming_content)
        next_chunk = sync_to_async(next, thread_sensitive=False)
        while (chunk := await next_chunk(iterator, _END)) is not _END:
            yield chunk


class ChunkedStreamingResponse(_ChunkByChunk, StreamingHttpResponse):
    """``StreamingHttpResponse`` over a synchronous iterator, streamed chunk by chunk under ASGI."""


class ChunkedFileResponse(_ChunkByChunk, FileResponse):
    """``FileResponse``, streamed chunk by chunk under ASGI."""


TAR_CHUNK_BYTES = 1 << 20


def tar_stream(entries: Iterable[tuple[str, Path, bytes | None]]) -> Iterator[bytes]:
    """A tar archive of ``(name in the archive, file, replacement bytes or None)`` entries, produced
    chunk by chunk (memory flat whatever the file sizes); a replacement is sent instead of the
    file's content (a download's manifest as the user may read it)."""
    for name, path, replaced in entries:
        info = tarfile.TarInfo(name)
        info.size = len(replaced) if replaced is not None else path.stat().st_size
        info.mtime = int(path.stat().st_mtime)
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        if replaced is not None:
            yield replaced
        else:
            with open(path, "rb") as handle:
                while chunk := handle.read(TAR_CHUNK_BYTES):
                    yield chunk
        if remainder := info.size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - remainder)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
