"""``manage.py serve``: everything `make run` needs — migrate, demo, web + one worker, clean exit."""

import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

from mistudio import embedded_redis
from mistudio.redis_client import ensure_redis


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
        worker = subprocess.Popen(
            [*manage, "worker", "--name", options["worker_name"]], cwd=settings.BASE_DIR
        )
        children = [web, worker]
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
            while not stopping and all(child.poll() is None for child in children):
                time.sleep(0.5)
        finally:
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
        failed = [child for child in children if child.returncode not in (0, -signal.SIGTERM, None)]
        if failed and not stopping:
            sys.exit(1)
