"""``manage.py serve``: everything `make run` needs — migrate, demo, web + one worker, clean exit.

The demo step also registers Gemma 3 270M from its packages (``install_gemma3``), ready to load.

A worker that dies (killed for memory, crashed) is started again with a backoff (1 s, doubling to
``RESTART_MAX_SECONDS``, back to 1 s once one has run a minute) while the web server stays up; the
new worker takes back the jobs the dead one was running (``mistudio.jobs``). The web server
ending ends everything.
"""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from mistudio import embedded_redis
from mistudio.redis_client import ensure_redis

RESTART_MAX_SECONDS = 30.0
STEADY_SECONDS = 60.0  # a worker that ran this long resets the backoff


@dataclass
class WorkerProcess:
    """The one worker ``serve`` keeps running: restarted with a backoff when it dies."""

    command: list[str]
    cwd: str
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = None
    started: float = 0.0
    backoff: float = 1.0
    restart_at: float | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.command, cwd=self.cwd, env=self.env)
        self.started, self.restart_at = time.monotonic(), None

    def watch(self, write) -> None:
        """Restart a worker that ended, once its backoff has passed."""
        now = time.monotonic()
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.start()
            return
        if self.process is None or self.process.poll() is None:
            return
        if now - self.started >= STEADY_SECONDS:
            self.backoff = 1.0
        code = self.process.returncode
        write(f"The worker stopped (exit code {code}); starting it again in {self.backoff:.0f} s.")
        self.restart_at = now + self.backoff
        self.backoff = min(self.backoff * 2, RESTART_MAX_SECONDS)


class Command(BaseCommand):
    help = "Migrate, bootstrap the demo, then run Daphne (web) and one worker until Ctrl-C."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-demo", action="store_true", help="Skip building and registering the demo.")
        parser.add_argument("--worker-name", default="worker-1")

    def handle(self, *args, **options):
        ensure_redis()
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        if not options["no_demo"]:
            call_command("bootstrap_demo")
            # About a second (assemble and register); its conversion waits for its first load.
            try:
                call_command("install_gemma3")
            except CommandError as error:  # an optional model: miStudio starts without it
                self.stderr.write(f"Gemma 3 270M is not available: {error}")
        manage = [sys.executable, str(settings.BASE_DIR / "manage.py")]
        web = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mistudio.web_server",  # Daphne, with request bodies bounded before they are read
                "-v",  # our access line (mistudio.requests, with the request id) replaces Daphne's
                "0",
                "-b",
                options["host"],
                "-p",
                str(options["port"]),
                "mistudio.asgi:application",
            ],
            cwd=settings.BASE_DIR,
        )
        # The worker reaches this web server's /v1 there (an explanation job's explainer).
        local = "127.0.0.1" if options["host"] in ("0.0.0.0", "::") else options["host"]  # noqa: S104
        api_url = os.environ.get("MISTUDIO_API_URL") or f"http://{local}:{options['port']}"
        worker = WorkerProcess(
            command=[*manage, "worker", "--name", options["worker_name"]],
            cwd=str(settings.BASE_DIR),
            env={**os.environ, "MISTUDIO_API_URL": api_url},
        )
        worker.start()
        url = f"http://{options['host']}:{options['port']}"
        self.stdout.write(
            self.style.SUCCESS(f"\nmiStudio is starting at {url}  (admin: {url}/admin/, API: {url}/api/)")
        )
        credentials = settings.DATA_DIR / "demo-credentials.txt"
        if credentials.exists():
            self.stdout.write(f"Sign in with: {credentials.read_text().strip()}")
        self.stdout.write("Press Ctrl-C to stop.\n")

        stopping = False

        def stop(signum, frame):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            while not stopping and web.poll() is None:
                worker.watch(lambda line: self.stderr.write(line))
                time.sleep(0.5)
        finally:
            children = [child for child in (web, worker.process) if child is not None]
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in children:
                try:
                    child.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    child.kill()
            if settings.EMBEDDED_REDIS:
                embedded_redis.stop(settings.EMBEDDED_REDIS_SOCKET)
            self.stdout.write("miStudio stopped.")
        if web.returncode not in (0, -signal.SIGTERM, None) and not stopping:
            sys.exit(1)
