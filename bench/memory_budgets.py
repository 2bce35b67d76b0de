"""Memory of the second review's examples, measured on the processes that hold it.

On the demo stack (``bench/demo_stack.py``: demo-gpt2, d_model 128, loaded on a real worker; a
real Daphne; the demo cache of ``blocks.2.hook_resid_post``), each scenario samples the resident
memory of the worker or web process every 50 ms (psutil) from just before its request to its end:

* **S1 training**: TopK k 32, d_sae 65,536, batch 4,096, 30 steps. Its estimate against the
  worker's growth; then the same at d_sae 196,608 (the size of the review's 11 GB example), which
  the budget must refuse before anything is allocated.
* **S2 mean ablation**: ``/api/generate`` ablating 100 features of an 8,192-feature SAE to their
  means over the cache (the first such call on the worker: it computes the means).
* **S3 zip bomb**: ``/api/saes/import`` of a Gemma Scope ``params.npz`` of 2 GB of zeros
  compressed to about 2 MB: the web's growth.
* **S4 re-import**: the same small SAE folder imported three times: rows made, bytes written.

    .venv/bin/python bench/memory_budgets.py
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from demo_stack import HOOK, demo_stack, wait_for  # first: it configures Django

MiB = 2**20


class PeakMemory:
    """The peak resident memory of a process (and its children) while the ``with`` block runs."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.before = self.peak = 0
        self._stop = threading.Event()

    def rss(self) -> int:
        processes = [self.process, *self.process.children(recursive=True)]
        return sum(process.memory_info().rss for process in processes)

    def __enter__(self) -> PeakMemory:
        self.before = self.peak = self.rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.before) / MiB


def call(stack, method: str, path: str, body: dict | None = None, *, user: str = "alice") -> tuple[int, dict]:
    request = urllib.request.Request(  # noqa: S310  (the stack's own http://127.0.0.1 address)
        f"{stack.base_url}{path}", data=json.dumps(body).encode() if body is not None else None,
        method=method, headers=stack.headers(user),
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=600) as response:  # noqa: S310
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def until_done(stack, sae_id: str, *, timeout: float = 1800) -> dict:
    def done():
        state = call(stack, "GET", f"/api/saes/{sae_id}")[1]
        return state if state["status"] in ("completed", "failed", "cancelled") else None

    return wait_for(done, timeout=timeout, what=f"SAE {sae_id}", interval=0.5)


def gemma_scope_folder(folder: Path, *, d_in: int, features: int, zeros: bool) -> int:
    """Write a Gemma Scope ``params.npz`` (compressed): zeros (a zip bomb) or small random weights."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)

    def array(*shape):
        return (
            np.zeros(shape, dtype=np.float32) if zeros else generator.normal(0, 0.1, shape).astype(np.float32)
        )

    np.savez_compressed(
        folder / "params.npz", W_enc=array(d_in, features), W_dec=array(features, d_in),
        b_enc=array(features), b_dec=array(d_in), threshold=np.abs(array(features)),
    )  # fmt: skip
    return (folder / "params.npz").stat().st_size


def bytes_under(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> None:
    from django.conf import settings

    from mistudio.budgets import memory_budget
    from saes.models import SparseAutoencoder

    with demo_stack() as stack:
        worker, web = stack.processes["worker"].pid, stack.processes["web"].pid
        print(f"budget of one job on the worker now: {memory_budget(worker_name=None) / 2**30:.2f} GiB")
        rows = []

        # S1: a wide training, then three times as wide.
        body = {"cache_id": stack.cache_id, "hook": HOOK, "architecture": "topk", "k": 32, "d_sae": 65536,
                "batch_size": 4096, "total_tokens": 4096 * 30}  # fmt: skip
        with PeakMemory(worker) as memory:
            status, state = call(stack, "POST", "/api/saes", body)
            if status == 202:
                state = until_done(stack, state["id"])
        estimate = state.get("memory_estimate_bytes") or state.get("error", {}).get("details", {}).get(
            "estimate_bytes"
        )
        rows.append(("S1 training d_sae 65,536", "worker", memory, f"{status} {state.get('status', '')}",
                     f"estimate {estimate / MiB:,.0f} MiB"))  # fmt: skip
        with PeakMemory(worker) as memory:
            status, answer = call(stack, "POST", "/api/saes", {**body, "d_sae": 196608})
        details = answer.get("error", {}).get("details", {})
        code = answer.get("error", {}).get("code", "")
        numbers = f"estimate {details.get('estimate_bytes', 0) / MiB:,.0f} MiB"
        numbers += f", limit {details.get('limit_bytes', 0) / MiB:,.0f} MiB"
        rows.append(("S1b training d_sae 196,608", "worker", memory, f"{status} {code}", numbers))

        # S2: the first mean ablation of an 8,192-feature SAE on this worker.
        narrow = {"cache_id": stack.cache_id, "hook": HOOK, "architecture": "topk", "k": 32, "d_sae": 8192}
        status, sae = call(stack, "POST", "/api/saes", narrow)
        sae = until_done(stack, sae["id"])
        ablate = {
            "type": "ablate",
            "hook": HOOK,
            "sae": sae["id"],
            "features": list(range(100)),
            "mean_from": stack.cache_id,
        }
        generate = {"model_id": stack.model_id, "prompt": "The function returns", "max_tokens": 8,
                    "temperature": 0, "mistudio": {"interventions": [ablate]}}  # fmt: skip
        with PeakMemory(worker) as memory:
            started = time.monotonic()
            status, answer = call(stack, "POST", "/api/generate", generate)
            took = time.monotonic() - started
        rows.append(("S2 mean ablation, 8,192 features", "worker", memory, str(status), f"{took:.2f} s"))

        # S3: a zip bomb under LOCAL_MODEL_ROOTS.
        bomb = settings.LOCAL_MODEL_ROOTS[0] / "bench-bomb"
        size = gemma_scope_folder(bomb, d_in=128, features=1_937_984, zeros=True)
        importing = {
            "local_path": str(bomb),
            "format": "gemma_scope",
            "model_id": stack.model_id,
            "hook": HOOK,
        }
        with PeakMemory(web) as memory:
            started = time.monotonic()
            status, answer = call(stack, "POST", "/api/saes/import", importing)
            took = time.monotonic() - started
        code = answer.get("error", {}).get("code", answer.get("status", ""))
        name = f"S3 import of a {size / MiB:.1f} MiB npz of 2 GB zeros"
        rows.append((name, "web", memory, f"{status} {code}", f"{took * 1000:.0f} ms"))

        # S4: the same small folder three times.
        small = settings.LOCAL_MODEL_ROOTS[0] / "bench-small"
        gemma_scope_folder(small, d_in=128, features=256, zeros=False)
        before_rows, before_bytes = SparseAutoencoder.objects.count(), bytes_under(settings.SAE_DIR)
        answers = [
            call(stack, "POST", "/api/saes/import", {**importing, "local_path": str(small)}) for _ in range(3)
        ]
        for _, state in answers:
            until_done(stack, state["id"])
        made = SparseAutoencoder.objects.count() - before_rows
        written = bytes_under(settings.SAE_DIR) - before_bytes
        statuses = ", ".join(str(status) for status, _ in answers)
        print()
        print(f"{'scenario':38} {'process':8} {'before':>9} {'peak':>9} {'growth':>9}   answer   notes")
        for name, process, memory, answer_text, note in rows:
            print(f"{name:38} {process:8} {memory.before / MiB:8.0f}M {memory.peak / MiB:8.0f}M "
                  f"{memory.growth_mib:+8.0f}M   {answer_text:8} {note}")  # fmt: skip
        print(
            f"S4 the same small folder imported 3 times: answers {statuses}; {made} row(s), "
            f"{written:,} bytes written"
        )


if __name__ == "__main__":
    main()
