"""The web process stays light: serving every route imports neither torch nor transformers.

import-linter cannot state this (it counts a worker function's lazy ``import torch`` like one at the
top of a module), so the test asks a fresh interpreter what the web really loads: Django set up, the
ASGI application built and every URL pattern's view resolved, as Daphne does before its first
request. Worker-side code (tasks, the engine's maths) imports torch when a worker first calls it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WEB_PROCESS = """
import json, sys
import django
django.setup()
import mistudio.asgi
from django.urls import get_resolver

def views(patterns):
    for pattern in patterns:
        if hasattr(pattern, "url_patterns"):
            yield from views(pattern.url_patterns)
        else:
            yield pattern.callback

count = sum(1 for _ in views(get_resolver().url_patterns))
loaded = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print(json.dumps({"views": count, "loaded": loaded}))
"""


def test_serving_every_route_imports_neither_torch_nor_transformers():
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "mistudio.settings_test", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", WEB_PROCESS]
    finished = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    report = json.loads(finished.stdout.strip().splitlines()[-1])
    assert report["views"] > 100  # every app's routes were resolved, not an empty URL conf
    assert report["loaded"] == [], f"the web imported {report['loaded']}: see `python -X importtime`"
