"""Seconds from `manage.py serve` on an empty data directory to /healthz showing one worker.

Includes migrations, training the demo model and registering the demo. (The virtualenv and
install time of a first `make run` come on top; time a fresh clone's `make run` for that.)

    .venv/bin/python bench/time_to_healthy.py [--training-seconds 90]
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--training-seconds", type=float, default=None)
    args = parser.parse_args()
    data_dir = tempfile.mkdtemp(prefix="mistudio-bench-")
    env = {key: value for key, value in os.environ.items() if key not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(DJANGO_SETTINGS_MODULE="mistudio.settings", MISTUDIO_DATA_DIR=data_dir)
    port = free_port()
    command = [sys.executable, "manage.py", "serve", "--port", str(port)]
    started = time.monotonic()
    if args.training_seconds is not None:
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
        subprocess.run(
            [sys.executable, "manage.py", "bootstrap_demo", "--training-seconds", str(args.training_seconds)],
            cwd=ROOT, env=env, check=True,
        )  # fmt: skip
    server = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                    if json.loads(response.read())["dependencies"]["workers"] == "up":
                        break
            except OSError:
                pass
            if server.poll() is not None:
                raise SystemExit("serve exited before becoming healthy")
            time.sleep(0.5)
        print(f"\nhealthy with one worker after {time.monotonic() - started:.1f} s (data dir {data_dir})")
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
