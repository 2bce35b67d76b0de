"""Throw-away Redis and PostgreSQL servers that failure tests may stop, restart and kill at will.

The machine's shared servers are never touched: each server here runs on a free port from a
temporary directory and is stopped when its context ends, also when the test fails.
PostgreSQL's ``initdb`` refuses to run as root, so as root the cluster belongs to the
``postgres`` OS user (``runuser -u postgres --``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from models_app.tests.live_stack import free_port, wait_until


def _postgres_bin() -> Path | None:
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
    )
    if versions:
        return versions[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PrivateRedis:
    """``redis-server`` on a free port, no persistence: a restart comes back empty, as after a crash."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def start(self) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            pytest.skip("redis-server is not installed")
        self.process = subprocess.Popen(
            [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(self.ping, timeout=15, what=f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


class PrivatePostgres:
    """A PostgreSQL cluster of its own (``initdb``) on a free port, with a ``mistudio`` database."""

    def __init__(self):
        self.bin = _postgres_bin()
        if self.bin is None:
            pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
        self.port = free_port()
        # Not under pytest's tmp_path: that is private to root, and the cluster's owner must reach it.
        self.root = Path(tempfile.mkdtemp(prefix="mistudio-private-pg-"))
        self.data = self.root / "data"
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.root, user="postgres", group="postgres")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/mistudio"

    def _run(self, *command: str, timeout: float = 60) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_root else []
        result = subprocess.run(
            [*prefix, *command], capture_output=True, text=True, timeout=timeout, cwd=self.root, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {result.stdout}{result.stderr}")

    def create(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8")  # fmt: skip
        self.start()
        self._run(
            str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "mistudio"
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                  "-o", options, "-w", "-t", "60", "start")  # fmt: skip

    def stop(self) -> None:
        """A fast shutdown: open sessions are cut, as when the database host goes away."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            if self.running():
                self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.create()
        yield server
    finally:
        server.destroy()


def stop_processes(processes: list[subprocess.Popen], *, timeout: float = 20) -> None:
    """Terminate, then kill what is still running after ``timeout`` seconds."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
