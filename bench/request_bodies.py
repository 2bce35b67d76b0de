"""Oversize request bodies against the web process: time to the answer, its memory, /healthz meanwhile.

The attacks a security review found (an anonymous 100 MiB multipart POST to /api/datasets, a 20 MiB urlencoded
POST to /login/, a signed-in 150 MiB upload over the 100 MiB limit, a chunked 100 MiB body), each
against plain Daphne (``--server daphne``, before) and miStudio's bounded Daphne (``--server
bounded``, what production runs). Uses the database and Redis the settings name (the embedded
default when DATABASE_URL / REDIS_URL are unset).

    .venv/bin/python bench/request_bodies.py --server daphne
    .venv/bin/python bench/request_bodies.py --server bounded
"""

import argparse
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mistudio.settings")

import django  # noqa: E402

django.setup()

import psutil  # noqa: E402
from django.contrib.auth.models import Group, User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from rest_framework.authtoken.models import Token  # noqa: E402

from mistudio.tests.raw_http import HealthProbe, send_body  # noqa: E402
from models_app.tests.live_stack import free_port  # noqa: E402

MiB = 2**20
SERVERS = {"daphne": ["-m", "daphne"], "bounded": ["-m", "mistudio.web_server"]}


def writer_token() -> str:
    call_command("migrate", interactive=False, verbosity=0)
    user, _ = User.objects.get_or_create(username="bench-body-writer")
    user.groups.add(Group.objects.get(name="model:write"))
    return Token.objects.get_or_create(user=user)[0].key


def peak_rss(process: psutil.Process, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.02):
        peak[0] = max(peak[0], process.memory_info().rss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=SERVERS, default="bounded")
    args = parser.parse_args()
    token = {"Authorization": f"Token {writer_token()}"}
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, *SERVERS[args.server], "-v", "0", "-b", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen([*command, "mistudio.asgi:application"], cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base_url}/healthz", timeout=2).read()  # noqa: S310 (http only)
                break
            except OSError as error:
                if getattr(error, "code", None) == 503:
                    break
                time.sleep(0.1)
        process = psutil.Process(server.pid)
        attacks = [
            ("anonymous 100 MiB multipart /api/datasets", "/api/datasets", "multipart", 100 * MiB, {}),
            ("anonymous 20 MiB urlencoded /login/", "/login/", "urlencoded", 20 * MiB, {}),
            ("anonymous 100 MiB chunked /login/", "/login/", "urlencoded", 100 * MiB, {"chunked": True}),
            ("signed-in 150 MiB multipart /api/datasets", "/api/datasets", "multipart", 150 * MiB,
             {"headers": token}),
        ]  # fmt: skip
        print(f"server: {args.server}   (RSS growth = peak during the request - RSS before it)")
        print(f"{'request':<44} {'status':>6} {'answer s':>9} {'RSS +MB':>8} {'healthz p50/max ms':>19}")
        for what, path, kind, size, options in attacks:
            time.sleep(1.0)
            before = process.memory_info().rss
            stop, peak = threading.Event(), [before]
            sampler = threading.Thread(target=peak_rss, args=(process, stop, peak), daemon=True)
            sampler.start()
            with HealthProbe(base_url, interval=0.05) as health:
                answer = send_body(base_url, path, kind=kind, size=size, timeout=300, **options)
                time.sleep(0.5)
            stop.set()
            sampler.join()
            latencies = [seconds * 1000 for seconds in health.latencies]
            print(
                f"{what:<44} {answer.status!s:>6} {answer.seconds:>9.2f} {(peak[0] - before) / MiB:>8.1f} "
                f"{median(latencies):>9.0f}/{max(latencies):<9.0f}"
            )
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
