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

    def summary(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "model_id": m.model_id,
                    "quantization": m.quantization,
                    "memory_usage_bytes": m.memory_usage_bytes,
                }
                for m in self._models.values()
            ]


LOADED_MODELS = ModelRegistry()
