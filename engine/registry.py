"""The worker's in-process map of loaded models (one per worker process)."""

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadedModel:
    model_id: str
    model: Any
    tokenizer: Any
    quantization: str
    memory_usage_bytes: int
    # Where it sits: device -> bytes ("disk" for a split model's offloaded part).
    memory_by_device: dict[str, int] = field(default_factory=dict)
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)


class ModelRegistry:
    """Thread-safe: the heartbeat thread reads it while jobs change it."""

    def __init__(self) -> None:
        self._models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()

    def add(self, loaded: LoadedModel) -> None:
        with self._lock:
            self._models[loaded.model_id] = loaded

    def get(self, model_id: str) -> LoadedModel | None:
        with self._lock:
            loaded = self._models.get(model_id)
            if loaded is not None:
                loaded.last_used = time.time()
            return loaded

    def remove(self, model_id: str) -> LoadedModel | None:
        with self._lock:
            return self._models.pop(model_id, None)

    def model_ids(self) -> list[str]:
        with self._lock:
            return list(self._models)

    def __len__(self) -> int:
        with self._lock:
            return len(self._models)

    def by_last_use(self) -> list[LoadedModel]:
        """Least recently used first: the eviction order."""
        with self._lock:
            return sorted(self._models.values(), key=lambda entry: entry.last_used)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(entry.memory_usage_bytes for entry in self._models.values())

    def summary(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "model_id": entry.model_id,
                    "quantization": entry.quantization,
                    "memory_usage_bytes": entry.memory_usage_bytes,
                    "memory_by_device": entry.memory_by_device,
                    "idle_seconds": round(time.time() - entry.last_used, 1),
                }
                for entry in self._models.values()
            ]


LOADED_MODELS = ModelRegistry()
