"""Worker processes: identity, queues and heartbeats.

A worker is an ``rq.SimpleWorker`` (no fork per job: the loaded models live in this process,
and CUDA cannot be used after fork) that consumes its own queue plus the shared queue. Every
``WORKER_HEARTBEAT_SECONDS`` a thread writes its heartbeat — device, memory, loaded models —
to Redis with a time-to-live, so a worker that dies simply disappears from ``/healthz``.
"""

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError, connections, transaction
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.timeouts import TimerDeathPenalty

from engine.registry import LOADED_MODELS
from mistudio.redis_client import get_redis
from mistudio.structured_logging import job_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerIdentity:
    name: str
    device: str


# Set once by ``run_worker`` in a worker process; None in the web process.
CURRENT_WORKER: WorkerIdentity | None = None


def worker_queue_name(worker_name: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}.worker.{worker_name}"


def heartbeat_key(worker_name: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:worker:{worker_name}"


def shared_queue() -> Queue:
    return Queue(settings.SHARED_QUEUE, connection=get_redis())


def worker_queue(worker_name: str) -> Queue:
    return Queue(worker_queue_name(worker_name), connection=get_redis())


# How long each task may run before RQ stops it.
TASK_TIMEOUT_SECONDS = {
    "models_app.tasks.load_model": 6 * 3600,  # a large hub download is part of the load
    "models_app.tasks.unload_model": 300,
    "activations.tasks.run_extraction": 24 * 3600,
    "generation.tasks.run_generation": 3600,
}


def enqueue(queue: Queue, task: str, *args: Any, **options: Any) -> None:
    """Put ``task`` on ``queue`` once the current transaction commits (at once outside one), so the
    worker finds the rows the caller saved, with the task's timeout (``TASK_TIMEOUT_SECONDS``).
    The one way any code queues a job."""
    timeout = TASK_TIMEOUT_SECONDS[task]
    transaction.on_commit(lambda: queue.enqueue(task, *args, job_timeout=timeout, **options))


def device_memory(device: str) -> tuple[int, int]:
    """(total, free) bytes of the device's memory: the GPU's for cuda:N, the machine's for cpu."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(total), int(free)
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


def memory_limit_bytes() -> int:
    """MODEL_MEMORY_LIMIT_GB as bytes; 0 means no budget beyond the device's own memory."""
    return int(settings.MODEL_MEMORY_LIMIT_GB * 2**30)


def available_memory(device: str) -> int:
    """Bytes a new model may take now: free device memory, capped by what the budget leaves."""
    free = device_memory(device)[1]
    if limit := memory_limit_bytes():
        free = min(free, limit - LOADED_MODELS.total_bytes())
    return free


def default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def heartbeat_payload(identity: WorkerIdentity, started_at: float) -> dict:
    total, free = device_memory(identity.device)
    return {
        "name": identity.name,
        "device": identity.device,
        "memory_total_bytes": total,
        "memory_free_bytes": free,
        "memory_limit_bytes": memory_limit_bytes(),
        "loaded_models": LOADED_MODELS.summary(),
        "queues": [worker_queue_name(identity.name), settings.SHARED_QUEUE],
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": started_at,
        "last_heartbeat": time.time(),
    }


def write_heartbeat(identity: WorkerIdentity, started_at: float) -> None:
    ttl = max(int(settings.WORKER_LOST_AFTER_SECONDS), 1)
    get_redis().set(heartbeat_key(identity.name), json.dumps(heartbeat_payload(identity, started_at)), ex=ttl)


def read_heartbeats() -> list[dict]:
    """Heartbeats of the workers alive now (expired ones are gone from Redis)."""
    connection = get_redis()
    keys = sorted(connection.scan_iter(match=heartbeat_key("*"), count=100))
    beats = [json.loads(raw) for raw in connection.mget(keys) if raw] if keys else []
    return sorted(beats, key=lambda beat: beat["name"])


def redis_restarted_recently() -> bool:
    """True while a restarted Redis may not yet hold the heartbeats of workers that are alive.

    A Redis that restarts empty loses every heartbeat; live workers write theirs again within a
    beat or two. Until ``WORKER_LOST_AFTER_SECONDS`` have passed, a missing heartbeat proves
    nothing, so ``worker_lost_reconcile`` waits rather than unload the models of live workers.
    """
    uptime = get_redis().info("server").get("uptime_in_seconds", 0)
    return uptime < settings.WORKER_LOST_AFTER_SECONDS


class MiStudioWorker(SimpleWorker):
    """SimpleWorker that can also be driven from a non-main thread (tests, embedded tools).

    Signal handlers can only be installed in the main thread; elsewhere the caller owns shutdown.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if threading.current_thread() is not threading.main_thread():
            self.death_penalty_class = TimerDeathPenalty  # SIGALRM needs the main thread

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            super()._install_signal_handlers()

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Run the job with its id on every log record written meanwhile (``job_id`` in the logs)."""
        with job_context(job_id=job.id):
            super().execute_job(job, queue)


class HeartbeatThread(threading.Thread):
    """Writes the heartbeat and, every few beats, fails models whose host worker vanished."""

    def __init__(self, identity: WorkerIdentity):
        super().__init__(name=f"heartbeat-{identity.name}", daemon=True)
        self.identity = identity
        self.started_at = time.time()
        self.stopped = threading.Event()
        self.unloads_queued: set[str] = set()

    def run(self) -> None:
        from activations.services import cache_cleanup_daily
        from models_app.services import worker_lost_reconcile

        beats = 0
        while not self.stopped.is_set():
            try:
                write_heartbeat(self.identity, self.started_at)
                self.unload_idle_models()
                if beats % 6 == 0:
                    if not redis_restarted_recently():
                        worker_lost_reconcile()
                    cache_cleanup_daily()
            except (redis.RedisError, OSError):
                logger.warning("heartbeat failed; retrying", exc_info=True)
            except (OperationalError, InterfaceError) as error:
                # The database went away (or restarted): drop this thread's dead connection so
                # the next beat connects afresh instead of failing on it forever.
                logger.warning("heartbeat: database unavailable (%s); retrying", error)
                connections.close_all()
            except Exception:
                logger.exception("heartbeat thread error")
            beats += 1
            self.stopped.wait(settings.WORKER_HEARTBEAT_SECONDS)
        connections.close_all()  # this thread's own database connection

    def unload_idle_models(self) -> None:
        """Queue an unload (reason ``idle``) for each model unused for longer than its keep_alive.

        The unload runs as a job on this worker's own queue, so it never races a job using the model.
        """
        from models_app.models import LanguageModel

        idle = {entry["model_id"]: entry["idle_seconds"] for entry in LOADED_MODELS.summary()}
        expiring = LanguageModel.objects.filter(
            pk__in=list(idle), status=LanguageModel.Status.READY, keep_alive_seconds__isnull=False
        ).values_list("pk", "keep_alive_seconds")
        for model_id, keep_alive in expiring:
            if idle[model_id] > keep_alive and model_id not in self.unloads_queued:
                self.unloads_queued.add(model_id)
                enqueue(
                    worker_queue(self.identity.name), "models_app.tasks.unload_model", model_id, reason="idle"
                )
        self.unloads_queued &= set(idle)

    def stop(self) -> None:
        self.stopped.set()
        with contextlib.suppress(redis.RedisError):
            get_redis().delete(heartbeat_key(self.identity.name))


def watch_key() -> str:
    return f"{settings.REDIS_KEY_PREFIX}:worker-watch"


class WorkerWatchThread(threading.Thread):
    """In a web process: looks for workers that died, in case none is left alive to notice.

    Workers check each other's heartbeats (every sixth beat, ``worker_lost_reconcile``); when the
    last one dies, nothing would, and its models would stay ``loading`` or ``ready``. This thread
    runs the same reconcile every half ``WORKER_LOST_AFTER_SECONDS``; a Redis key taken with
    ``SET NX EX`` lets one web process in the deployment do it per period.
    """

    def __init__(self) -> None:
        super().__init__(name="worker-watch", daemon=True)
        self.interval = max(float(settings.WORKER_LOST_AFTER_SECONDS) / 2, 1.0)

    def run(self) -> None:
        from models_app.services import worker_lost_reconcile

        while True:
            time.sleep(self.interval)
            try:
                my_turn = get_redis().set(watch_key(), os.getpid(), nx=True, ex=max(int(self.interval), 1))
                if my_turn and not redis_restarted_recently():
                    lost = worker_lost_reconcile()
                    if lost:
                        logger.warning("worker watch: %d model(s) of lost workers unloaded", len(lost))
            except (redis.RedisError, OSError, OperationalError, InterfaceError) as error:
                logger.warning("worker watch: %s; retrying", error)
            except Exception:
                logger.exception("worker watch error")
            finally:
                connections.close_all()  # this thread's connection goes back to the pool


_WORKER_WATCH: WorkerWatchThread | None = None


def start_worker_watch() -> None:
    """Start the web process's :class:`WorkerWatchThread` once (``WATCH_WORKERS``)."""
    global _WORKER_WATCH
    if _WORKER_WATCH is None:
        _WORKER_WATCH = WorkerWatchThread()
        _WORKER_WATCH.start()


def run_worker(*, name: str, device: str, burst: bool = False, max_jobs: int | None = None) -> None:
    """Run a named SimpleWorker on its own queue and the shared queue until stopped."""
    global CURRENT_WORKER
    from models_app.services import worker_release_models

    identity = WorkerIdentity(name=name, device=device)
    CURRENT_WORKER = identity
    worker_release_models(
        worker_name=name,
        reason="worker_lost",
        holding=[entry["model_id"] for entry in LOADED_MODELS.summary()],
        code="WORKER_LOST",
        message="The worker hosting this model restarted.",
    )
    from activations.services import extraction_resume_after_restart

    extraction_resume_after_restart(worker_name=name)  # they continue from their last complete shard
    heartbeat = HeartbeatThread(identity)
    write_heartbeat(identity, heartbeat.started_at)
    heartbeat.start()
    try:
        worker = MiStudioWorker(
            [worker_queue(name), shared_queue()],
            name=f"{name}.{os.getpid()}",
            connection=get_redis(),
        )
        worker.work(burst=burst, max_jobs=max_jobs, logging_level=os.environ.get("LOG_LEVEL", "INFO"))
    finally:
        heartbeat.stop()
        heartbeat.join(timeout=5)
        connections.close_all()
        CURRENT_WORKER = None
