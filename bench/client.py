"""mistudio-client against the raw HTTP calls it makes (the client's speed goals).

On a real stack (``bench/demo_stack.py``: Daphne and a worker as processes, the demo model loaded):

* **A 100 MB hook slice**: an activation cache of the demo model's ``blocks.2.mlp.hook_post``
  (width 512) over enough tokens for 100 MB of float32, read three ways, interleaved:
  ``np.asarray(cache[hook][0:rows])`` through the client; the raw download of the same rows as
  safetensors bytes (``GET …/slice?output=safetensors``, the server's per-request maximum each, one
  after another, the bytes only, with httpx); and the JSON slice of the same rows decoded into a
  numpy array. Goals: client >= 0.8x raw, >= 3x JSON.
* **Generation with capture**: ``client.generate(…, capture=[3 hooks])`` against the raw
  ``POST /api/generate`` with the same body (the JSON answer only). Goal: the client adds ≤ 10 %.

Medians of ``--repeats`` rounds after one untimed round. Runs on the embedded default in a
temporary data directory unless DATABASE_URL / REDIS_URL are set.

    .venv/bin/python bench/client.py [--repeats 5] [--megabytes 100] [--client OTHER/client]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import demo_stack  # configures Django first
import httpx
import numpy as np

# --client PATH measures another checkout's client (the one before a change) against the same server.
CLIENT_FOLDER = sys.argv[sys.argv.index("--client") + 1] if "--client" in sys.argv else None
sys.path.insert(0, CLIENT_FOLDER or str(Path(__file__).resolve().parent.parent / "client"))

from mistudio_client import Client  # noqa: E402

SLICE_HOOK = "blocks.2.mlp.hook_post"
CAPTURE = ["blocks.1.hook_resid_post", "blocks.2.mlp.hook_post", "blocks.3.hook_resid_post"]
MAX_SLICE_VALUES = 4_000_000  # the server's per-request limit (activations.selectors)
WORDS = "the a cat dog sat ran on under mat door house river light dark because function return value".split()  # noqa: SIM905


def texts(count: int, words: int = 160) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=words)) for _ in range(count)]


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=100.0)
    parser.add_argument("--client", help="the client package's folder (default: this checkout's client/)")
    arguments = parser.parse_args()
    with demo_stack.demo_stack() as stack:
        token = stack.tokens["alice"]
        client = Client(stack.base_url, token, timeout=600)
        raw = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Token {token}"}, timeout=600)
        width = 512
        rows = int(arguments.megabytes * 1e6 / (width * 4))
        dataset = client.datasets.upload(texts(rows // 100 + 20), name="bench client texts")
        started = time.perf_counter()
        job = client.extractions.start(
            stack.model_id, dataset, hooks=[SLICE_HOOK], max_length=128, batch_size=32
        )
        cache = job.wait(progress=False).cache()
        array = cache[SLICE_HOOK]
        print(f"cache {cache.id}: {array.shape} in {time.perf_counter() - started:.1f} s")
        rows = min(rows, array.shape[0])
        megabytes = rows * array.shape[1] * 4 / 1e6
        step = MAX_SLICE_VALUES // array.shape[1]

        def ranges():
            return [(start, min(rows, start + step)) for start in range(0, rows, step)]

        def raw_download() -> None:
            for start, stop in ranges():
                response = raw.get(
                    f"/api/activation-caches/{cache.id}/slice",
                    params={"hook": SLICE_HOOK, "start": start, "stop": stop, "output": "safetensors"},
                )
                response.raise_for_status()
                assert len(response.content) >= (stop - start) * width * 4

        def json_slice() -> None:
            parts = []
            for start, stop in ranges():
                response = raw.get(
                    f"/api/activation-caches/{cache.id}/slice",
                    params={"hook": SLICE_HOOK, "start": start, "stop": stop, "output": "json"},
                )
                response.raise_for_status()
                parts.append(np.asarray(response.json()["values"], dtype=np.float32))
            assert sum(len(part) for part in parts) == rows

        def through_client() -> None:
            values = np.asarray(array[0:rows])
            assert values.shape == (rows, width)

        conditions = {"client": through_client, "raw safetensors": raw_download, "JSON": json_slice}
        seconds: dict[str, list[float]] = {name: [] for name in conditions}
        for round_number in range(arguments.repeats + 1):
            order = list(conditions)[round_number % 3 :] + list(conditions)[: round_number % 3]
            for name in order:
                elapsed = timed(conditions[name])
                if round_number:
                    seconds[name].append(elapsed)
        print(f"\n{megabytes:.1f} MB ({rows} rows x {width}), {len(ranges())} requests")
        print("| read | median s | MB/s |")
        print("|---|---|---|")
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"| {name} | {median:.3f} | {megabytes / median:.0f} |")
        client_s = statistics.median(seconds["client"])
        print(f"client / raw: {statistics.median(seconds['raw safetensors']) / client_s:.2f}x (goal >= 0.8)")
        print(f"client / JSON: {statistics.median(seconds['JSON']) / client_s:.2f}x (goal >= 3)")

        body = {"model_id": stack.model_id, "prompt": "The river ran under the", "max_tokens": 32}
        extension = {"capture": CAPTURE, "store": False}

        def raw_generate() -> None:
            response = raw.post("/api/generate", json={**body, "temperature": 0, "mistudio": extension})
            response.raise_for_status()
            response.json()

        def client_generate() -> None:
            result = client.generate(stack.model_id, body["prompt"], max_tokens=32, capture=CAPTURE)
            assert all(hook in result.activations for hook in CAPTURE)

        generation = {"client": client_generate, "raw": raw_generate}
        times: dict[str, list[float]] = {name: [] for name in generation}
        for round_number in range(4 * arguments.repeats + 1):
            for name in list(generation)[round_number % 2 :] + list(generation)[: round_number % 2]:
                elapsed = timed(generation[name])
                if round_number:
                    times[name].append(elapsed)
        raw_s, client_g = statistics.median(times["raw"]), statistics.median(times["client"])
        overhead = 100 * (client_g / raw_s - 1)
        print(f"\ngenerate (32 tokens, capture {len(CAPTURE)} hooks): raw {raw_s * 1000:.1f} ms, "
              f"client {client_g * 1000:.1f} ms: {overhead:+.1f} % (goal <= +10 %)")  # fmt: skip
        client.close()
        raw.close()


if __name__ == "__main__":
    main()
