"""Worker processes: identity, queues, heartbeats, declared task timeouts and the interactive lane.

A worker is an ``rq.SimpleWorker`` (no fork per job: the loaded models live in this process,
and CUDA cannot be used after fork) that consumes, in this order, its *interactive* queue
(generation and worker calls: quick answers someone is waiting for), a model load waiting on the
shared queue, its own queue and the shared queue; after ``WORKER_INTERACTIVE_TURN_SECONDS`` of
interactive work in a row the other lanes get one item (``MiStudioWorker.lane_order``). Every
``WORKER_HEARTBEAT_SECONDS`` a thread writes its heartbeat — device, memory, loaded models — to
Redis with a time-to-live, so a worker that dies simply disappears from ``/healthz``.

Interactive work never waits for a long job: a job asks :func:`serve_interactive` between its
steps (``mistudio.job_runner.JobContext.should_cancel``), which runs what waits on the interactive
queue right there, sharing the loaded model — one thread, so no two forward passes ever see
each other's hooks.
"""

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError, connections, transaction
from rq import Queue, SimpleWorker
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.timeouts import TimerDeathPenalty

from engine.placement import Placement
from engine.registry import LOADED_MODELS
from mistudio.redis_client import get_redis, worker_redis
from mistudio.structured_logging import job_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerIdentity:
    name: str
    # cpu, cuda:N, or auto: models split across the devices of ``max_memory`` and disk.
    device: str
    # Per-device budgets for ``auto`` (device -> bytes); empty: what each device has free.
    max_memory: tuple[tuple[str, int], ...] = ()

    @property
    def placement(self) -> Placement:
        return Placement(
            device=self.device,
            max_memory=dict(self.max_memory),
            offload_folder=str(settings.MODEL_OFFLOAD_DIR / self.name) if self.device == "auto" else None,
        )

    @property
    def compute_device(self) -> str:
        """Where the worker's own tensors go (SAE training, encoding): see Placement.compute_device."""
        return self.placement.compute_device


# Set once by ``run_worker`` in a worker process; None in the web process.
CURRENT_WORKER: WorkerIdentity | None = None


def current_worker() -> WorkerIdentity:
    """This process's worker (tasks run only inside ``manage.py worker``)."""
    if CURRENT_WORKER is None:
        raise RuntimeError("model jobs run only inside a miStudio worker (manage.py worker)")
    return CURRENT_WORKER


def worker_queue_name(worker_name: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}.worker.{worker_name}"


def interactive_queue_name(worker_name: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}.interactive.{worker_name}"


def heartbeat_key(worker_name: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:worker:{worker_name}"


def shared_queue() -> Queue:
    return Queue(settings.SHARED_QUEUE, connection=get_redis())


def worker_queue(worker_name: str) -> Queue:
    return Queue(worker_queue_name(worker_name), connection=get_redis())


def interactive_queue(worker_name: str) -> Queue:
    """Where quick work for ``worker_name``'s loaded models waits (generation, worker calls)."""
    return Queue(interactive_queue_name(worker_name), connection=get_redis())


def queue_by_name(name: str) -> Queue:
    return Queue(name, connection=get_redis())


# Model loads are RQ jobs with ids of this prefix, put at the front of the shared queue: a person
# waits on them (``models_app.services.model_load_request``).
LOAD_JOB_PREFIX = "load-"
# Work that has waited this long on a queue that idle workers also consume found none: the worker
# running a job should make room for it.
IDLE_WORKER_GRACE_SECONDS = 1.0


def loads_waiting(queue: Queue, *, grace_seconds: float = 0.0) -> bool:
    """Whether a model load waits on ``queue`` (for ``grace_seconds`` at least)."""
    prefix = LOAD_JOB_PREFIX.encode()
    ids = [
        job_id.decode() for job_id in queue.connection.lrange(queue.key, 0, 999) if job_id.startswith(prefix)
    ]
    if not ids or grace_seconds <= 0:
        return bool(ids)
    now = datetime.now(UTC)
    return any(
        job is not None
        and job.enqueued_at is not None
        and (now - job.enqueued_at.replace(tzinfo=job.enqueued_at.tzinfo or UTC)).total_seconds()
        >= grace_seconds
        for job in Job.fetch_many(ids, connection=queue.connection)
    )


# --- the apps' hooks ------------------------------------------------------------------------------
# The apps plug their chores into the worker here (in AppConfig.ready), so that this module needs
# none of them: "start" (identity) when a worker starts, before it takes jobs; "every_beat"
# (identity) each heartbeat; "reconcile" () -> the rows it settled, every sixth beat (unless
# Redis just restarted) and in the web process's watch; "every_sixth_beat" () after it.
_HOOKS: dict[str, list[Callable[..., Any]]] = {
    "start": [],
    "every_beat": [],
    "reconcile": [],
    "every_sixth_beat": [],
    "interactive_owners": [],
    "batch_owners": [],
}


def register_worker_hook(when: str, hook: Callable[..., Any]) -> None:
    """Run ``hook`` at ``when`` (a key of ``_HOOKS``), in the order the apps register them."""
    if hook not in _HOOKS[when]:
        _HOOKS[when].append(hook)


def reconcile() -> int:
    """Settle the rows of workers that are gone (every registered reconcile); how many changed."""
    return sum(len(hook() or ()) for hook in _HOOKS["reconcile"])


def worker_task(*, timeout: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare how long an RQ task may run, beside its body: the worker applies it when it runs
    the task (:meth:`MiStudioWorker.perform_job`), whatever queued it."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        function.timeout = timeout
        return function

    return decorate


def enqueue(queue: Queue, task: str, *args: Any, **options: Any) -> None:
    """Put ``task`` on ``queue`` once the current transaction commits (at once outside one), so the
    worker finds the rows the caller saved. The one way any code queues a job; the task's own
    declared timeout (``worker_task``) applies when it runs."""
    transaction.on_commit(lambda: queue.enqueue(task, *args, **options))


def call_worker_key(request_id: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:call:{request_id}"


def call_waiting_key(request_id: str) -> str:
    """Set while the caller still waits: a call whose caller gave up is not computed."""
    return f"{settings.REDIS_KEY_PREFIX}:call:{request_id}:waiting"


def call_worker(
    worker_name: str, task: str, *args: Any, wait_seconds: float, owner: Any = None
) -> dict[str, Any]:
    """Run ``task(request_id, *args)`` on ``worker_name``'s interactive queue (where its models are
    loaded) and wait for the JSON it answers with :func:`answer_call`: the way a request that needs
    a loaded model (live encoding, patching, the logit lens) gets a quick answer from a worker.

    The answer comes through a Redis stream that the process's one reader follows
    (``mistudio.stream_hub``): a waiting call holds no Redis connection. A busy worker answers
    between two steps of its job. 503 ``MODEL_BUSY`` when no answer comes in ``wait_seconds``.
    However the wait ends without an answer (that timeout, the client gone, an error), the call
    is withdrawn: taken off the queue, or skipped by the worker if it has not started it. An
    ``{"error": …}`` answer is raised as the ApplicationError it describes. The call is
    ``owner``'s (a user; None: the system's): the worker charges its time to them and gives it its
    turn by their share of the worker (``mistudio.worker_clock``).
    """
    from mistudio.errors import ApplicationError
    from mistudio.request_lifetime import release_database, request_abandoned
    from mistudio.stream_hub import entry_event, stream_hub

    if transaction.get_connection().in_atomic_block:  # the job would wait for a commit this waits on
        raise RuntimeError("call_worker must not run inside a transaction")
    request_id = os.urandom(16).hex()
    key, waiting = call_worker_key(request_id), call_waiting_key(request_id)
    abandoned = request_abandoned()
    queue = interactive_queue(worker_name)
    job_id = f"call-{request_id}"
    body = None
    caller = getattr(owner, "pk", owner)
    release_database()
    with stream_hub().follow(key) as follower:
        get_redis().set(
            waiting, "system" if caller is None else str(caller), ex=max(1, int(wait_seconds) + 1)
        )
        try:
            queue.enqueue(task, request_id, *args, job_id=job_id)
            deadline = time.monotonic() + wait_seconds
            while body is None and not abandoned.is_set() and (left := deadline - time.monotonic()) > 0:
                entries = follower.get(min(left, CALL_WAIT_SLICE_SECONDS))
                if entries:
                    body = entry_event(entries[0])
        finally:
            if body is None:
                withdraw_call(queue, request_id)
            get_redis().delete(key)
    if body is None:
        if abandoned.is_set():
            raise ApplicationError("CLIENT_GONE", "The client went away.", status=499)
        raise ApplicationError(
            "MODEL_BUSY",
            "The model's worker did not answer in time (it may be busy with a long step).",
            status=503,
            details={"retry_after_seconds": 5},
        )
    if "error" in body:
        error = body["error"]
        raise ApplicationError(
            error["code"],
            error["message"],
            details=error.get("details") or {},
            status=error.get("status", 409),
        )
    return body


# How often a waiting call looks whether its client went away.
CALL_WAIT_SLICE_SECONDS = 0.25


def withdraw_call(queue: Queue, request_id: str) -> None:
    """Withdraw a call nobody waits for: a worker that has not started it skips it."""
    with contextlib.suppress(redis.RedisError):
        get_redis().delete(call_waiting_key(request_id))
    with contextlib.suppress(Exception):
        queue.remove(f"call-{request_id}")


def answer_call(request_id: str, compute: Callable[[], dict[str, Any]], *, failure_code: str) -> None:
    """The worker's side of :func:`call_worker`: ``compute()``'s JSON, or the error it raised, to
    the Redis stream the caller follows (kept two minutes for a caller that gave up). A call whose
    caller stopped waiting is not computed."""
    from engine.errors import EngineError
    from mistudio.errors import ApplicationError
    from mistudio.worker_clock import CLOCK

    redis_client = get_redis()
    caller = redis_client.getdel(call_waiting_key(request_id))
    if caller is None:
        logger.info("worker call %s withdrawn by its caller; skipped", request_id)
        return
    started = time.monotonic()
    try:
        body = compute()
    except (ApplicationError, EngineError) as error:
        status = getattr(error, "status", 400 if isinstance(error, EngineError) else 409)
        details = getattr(error, "details", None) or {}
        body = {"error": {"code": error.code, "message": error.message, "details": details, "status": status}}
    except Exception as error:
        logger.exception("worker call %s failed", request_id)
        body = {
            "error": {"code": failure_code, "message": f"It failed: {type(error).__name__}.", "status": 500}
        }
    CLOCK.charge(time.monotonic() - started, [call_owner(caller)])
    key = call_worker_key(request_id)
    pipeline = redis_client.pipeline(transaction=False)
    pipeline.xadd(key, {"event": json.dumps(body)})
    pipeline.expire(key, 120)
    pipeline.execute()


def call_owner(value: bytes | str) -> int | None:
    """The owner a call's waiting key names (a user id, or ``system``)."""
    text = value.decode() if isinstance(value, bytes) else value
    return None if text == "system" else int(text)


def call_owners(identity: WorkerIdentity) -> set[int | None]:
    """The owners of the worker calls (``call_worker``) waiting on this worker's interactive queue."""
    queue = interactive_queue(identity.name)
    ids = [
        job_id.decode()
        for job_id in queue.connection.lrange(queue.key, 0, 999)
        if job_id.startswith(b"call-")
    ]
    if not ids:
        return set()
    values = queue.connection.mget([call_waiting_key(job_id.removeprefix("call-")) for job_id in ids])
    return {call_owner(value) for value in values if value is not None}


@dataclass(frozen=True)
class Lender:
    """A running job lending its worker's time to the interactive lane, between two of its steps."""

    owner: int | None


_LENDING = threading.local()


def lender() -> Lender | None:
    """The job whose time this thread's interactive work runs in (:func:`serve_interactive`), or
    None: that work should give it back soon (a generation batch yields to it)."""
    return getattr(_LENDING, "lender", None)


def interactive_turn(identity: WorkerIdentity, *, owner: int | None) -> bool:
    """Whether the interactive work waiting for this worker goes before the job of ``owner`` now:
    when someone it waits for had no more of the worker's time lately than the job's owner
    (``mistudio.worker_clock``; the apps say who waits: ``interactive_owners`` hooks). A chat of a
    few tokens is served at once; a flood of one user's generation gets turns with the job, not
    all of its time."""
    from mistudio.worker_clock import CLOCK

    if not interactive_queue(identity.name).count:
        return False
    waiting = set().union(*(hook() for hook in _HOOKS["interactive_owners"]))
    # Tokens with no owner waiting behind them (their rows ran in another batch): cheap to drop.
    return not waiting or CLOCK.before(waiting, owner)


def batch_turn(queues: list[Queue]) -> bool:
    """Whether, with both lanes waiting, an owner of the batch jobs waiting for this worker had less
    of its time lately than everyone the interactive lane waits for (``batch_owners`` and
    ``interactive_owners`` hooks; ``mistudio.worker_clock``)."""
    from mistudio.worker_clock import CLOCK

    interactive, own, shared = queues
    if not interactive.count or not (own.count or shared.count):
        return False
    batch = set().union(*(hook() for hook in _HOOKS["batch_owners"]))
    waiting = set().union(*(hook() for hook in _HOOKS["interactive_owners"]))
    if not batch or not waiting:
        return False
    served = CLOCK.snapshot(batch | waiting)
    return min(served[owner] for owner in batch) < min(served[owner] for owner in waiting)


def serve_interactive(identity: WorkerIdentity, *, most: int = 16, owner: int | None = None) -> int:
    """Run the work waiting on this worker's interactive queue, here and now, while it is its turn
    (:func:`interactive_turn`) and at most ``most`` items: called by a running job of ``owner``
    between its steps. Returns how many ran. A failure is logged and never reaches the job that
    lent its time."""
    queue = interactive_queue(identity.name)
    done = 0
    _LENDING.lender = Lender(owner=owner)
    try:
        while done < most and interactive_turn(identity, owner=owner):
            if not _serve_one(queue):
                break
            done += 1
    finally:
        _LENDING.lender = None
    return done


def _serve_one(queue: Queue) -> bool:
    """Run the next item of ``queue``; False when there was none."""
    popped = queue.connection.lpop(queue.key)  # (RQ's pop_job_id fails on an empty queue)
    if popped is None:
        return False
    job_id = popped.decode()
    try:
        job = Job.fetch(job_id, connection=queue.connection)
    except NoSuchJobError:  # deleted meanwhile (a withdrawn call)
        return True
    with job_context(job_id=job.id):
        try:
            job.func(*job.args, **job.kwargs)
        except Exception:
            logger.exception("interactive job %s failed", job.id)
        finally:
            with contextlib.suppress(Exception):
                job.delete()
    return True


def device_memory(device: str) -> tuple[int, int]:
    """(total, free) bytes of the device's memory: the GPU's for cuda:N, the machine's for cpu."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(total), int(free)
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


def device_budgets(placement: Placement) -> dict[str, tuple[int, int]]:
    """(total, free) bytes of each device the placement may fill, each capped by its budget."""
    budgets = {}
    for device in placement.memory_devices():
        total, free = device_memory(device)
        if (budget := placement.max_memory.get(device)) is not None:
            total, free = min(total, budget), min(free, budget)
        budgets[device] = (total, free)
    return budgets


def placement_memory(placement: Placement) -> tuple[int, int]:
    """(total, free) bytes a placement may fill: one device's, or the sum over a split
    placement's devices, each capped by its budget."""
    budgets = device_budgets(placement).values()
    return sum(total for total, _ in budgets), sum(free for _, free in budgets)


def memory_limit_bytes() -> int:
    """MODEL_MEMORY_LIMIT_GB as bytes; 0 means no budget beyond the device's own memory."""
    return int(settings.MODEL_MEMORY_LIMIT_GB * 2**30)


def available_memory(placement: Placement) -> int:
    """Bytes a new model may take now: free memory where the placement puts models, capped by
    what the budget leaves."""
    free = placement_memory(placement)[1]
    if limit := memory_limit_bytes():
        free = min(free, limit - LOADED_MODELS.total_bytes())
    return free


def default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def heartbeat_payload(identity: WorkerIdentity, started_at: float) -> dict:
    total, free = placement_memory(identity.placement)
    return {
        "name": identity.name,
        "device": identity.device,
        "placement": identity.placement.describe(),
        "memory_total_bytes": total,
        "memory_free_bytes": free,
        "memory_limit_bytes": memory_limit_bytes(),
        "loaded_models": LOADED_MODELS.summary(),
        "queues": [queue.name for queue in worker_queues(identity.name)],
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
    """SimpleWorker over a worker's three queues (``worker_queues``' order: interactive, own,
    shared) that no lane starves (:meth:`lane_order`); it can also be driven from a non-main
    thread (tests, embedded tools).

    Signal handlers can only be installed in the main thread; elsewhere the caller owns shutdown.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if threading.current_thread() is not threading.main_thread():
            self.death_penalty_class = TimerDeathPenalty  # SIGALRM needs the main thread
        self.interactive_since: float | None = None  # since when it has served only interactive work

    def lane_order(self) -> list[Queue]:
        """The order the next item is taken in. A waiting model load first (a person waits on it,
        and loads are rare: rate-limited). Then the interactive lane (someone waits for each
        answer) before the batch jobs' tokens of its own queue and the shared one — unless the
        batch lane's owner had less of the worker's time lately than everyone the interactive lane
        waits for (:func:`batch_turn`), or the interactive lane has had the worker
        ``WORKER_INTERACTIVE_TURN_SECONDS`` in a row: then the batch lane goes first for one item
        (a job then shares its time through :func:`serve_interactive`). A flood of generation never
        starves a load or a batch job."""
        interactive, own, shared = self.queues
        if loads_waiting(shared):
            return [shared, interactive, own]
        if interactive.count == 0:
            self.interactive_since = None
        turn_over = (
            self.interactive_since is not None
            and time.monotonic() - self.interactive_since >= settings.WORKER_INTERACTIVE_TURN_SECONDS
        )
        batch = [own, shared]
        return [*batch, interactive] if turn_over or batch_turn(self.queues) else [interactive, *batch]

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None):
        """RQ's dequeue, in :meth:`lane_order`; notes how long the interactive lane has had the worker."""
        self._ordered_queues = self.lane_order()
        result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        if result is not None:
            if result[1].name != self.queues[0].name:
                self.interactive_since = None
            elif self.interactive_since is None:
                self.interactive_since = time.monotonic()
        return result

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            super()._install_signal_handlers()

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Run the job with its id on every log record written meanwhile (``job_id`` in the logs)."""
        with job_context(job_id=job.id):
            super().execute_job(job, queue)

    def perform_job(self, job: Job, queue: Queue, execution) -> bool:
        """Run the job under the timeout its task declares (``worker_task``), not the one it was
        queued with."""
        with contextlib.suppress(Exception):  # a task that cannot be imported fails in super()
            declared = getattr(job.func, "timeout", None)
            if declared:
                job.timeout = declared
        return super().perform_job(job, queue, execution)


class HeartbeatThread(threading.Thread):
    """Writes the heartbeat and runs the apps' hooks: each beat, and every sixth beat the
    reconcile (rows of workers that vanished) and the periodic chores."""

    def __init__(self, identity: WorkerIdentity):
        super().__init__(name=f"heartbeat-{identity.name}", daemon=True)
        self.identity = identity
        self.started_at = time.time()
        self.stopped = threading.Event()

    def run(self) -> None:
        beats = 0
        while not self.stopped.is_set():
            try:
                write_heartbeat(self.identity, self.started_at)
                for hook in _HOOKS["every_beat"]:
                    hook(self.identity)
                if beats % 6 == 0:
                    if not redis_restarted_recently():
                        reconcile()
                    for hook in _HOOKS["every_sixth_beat"]:
                        hook()
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
        while True:
            time.sleep(self.interval)
            try:
                my_turn = get_redis().set(watch_key(), os.getpid(), nx=True, ex=max(int(self.interval), 1))
                if my_turn and not redis_restarted_recently():
                    lost = reconcile()
                    if lost:
                        logger.warning("worker watch: %d row(s) of lost workers settled", lost)
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


def run_worker(
    *,
    name: str,
    device: str,
    max_memory: dict[str, int] | None = None,
    burst: bool = False,
    max_jobs: int | None = None,
) -> None:
    """Run a named SimpleWorker on its own queue and the shared queue until stopped.

    ``device`` ``auto`` splits each model over the devices of ``max_memory`` (device -> bytes)
    and disk; see :mod:`engine.placement`.
    """
    global CURRENT_WORKER
    identity = WorkerIdentity(name=name, device=device, max_memory=tuple((max_memory or {}).items()))
    CURRENT_WORKER = identity
    for hook in _HOOKS["start"]:
        hook(identity)
    heartbeat = HeartbeatThread(identity)
    write_heartbeat(identity, heartbeat.started_at)
    heartbeat.start()
    try:
        connection = worker_redis()
        worker = MiStudioWorker(
            [Queue(queue.name, connection=connection) for queue in worker_queues(name)],
            name=f"{name}.{os.getpid()}",
            connection=connection,
            worker_ttl=settings.RQ_WORKER_TTL_SECONDS,
        )
        worker.work(burst=burst, max_jobs=max_jobs, logging_level=os.environ.get("LOG_LEVEL", "INFO"))
    finally:
        heartbeat.stop()
        heartbeat.join(timeout=5)
        connections.close_all()
        CURRENT_WORKER = None


def worker_queues(worker_name: str) -> list[Queue]:
    """What a worker consumes: its interactive queue, its own queue, the shared queue (in the
    order of ``MiStudioWorker.lane_order``)."""
    return [interactive_queue(worker_name), worker_queue(worker_name), shared_queue()]


def queue_lengths(*, heartbeats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Jobs waiting, running and failed in miStudio's queues: the shared one, each live worker's
    interactive and own queues, and those of a worker that is gone but left jobs behind (they wait
    for it to return). A batch job waits as a token on a queue (``mistudio.jobs``).

    ``heartbeats`` are the live workers'. Counts are read without RQ's registry cleanup, so looking
    at them changes nothing; "running" counts only jobs a live worker process holds (RQ's started
    registry keeps a killed worker's job until the job's timeout, which can be hours).
    """
    connection = get_redis()
    prefixes = {"worker": worker_queue_name(""), "interactive": interactive_queue_name("")}
    by_name: dict[str, str | None] = {settings.SHARED_QUEUE: None}
    for beat in heartbeats:
        by_name.update({queue.name: beat["name"] for queue in worker_queues(beat["name"])[:2]})
    live_processes = {f"{beat['name']}.{beat.get('pid')}" for beat in heartbeats}  # RQ's worker names

    def running(queue: Queue) -> int:
        started = queue.started_job_registry.get_job_ids(cleanup=False)
        jobs = Job.fetch_many(started, connection=connection) if started else []
        return sum(1 for job in jobs if job is not None and job.worker_name in live_processes)

    def kind_of(name: str) -> str:
        if name == settings.SHARED_QUEUE:
            return "shared"
        return next(kind for kind, prefix in prefixes.items() if name.startswith(prefix))

    known = [Queue(name, connection=connection) for name in by_name]
    # Queues RQ has seen (it records a queue on its first job), for the ones of departed workers.
    departed = [
        queue
        for queue in Queue.all(connection=connection)
        if queue.name.startswith(tuple(prefixes.values())) and queue.name not in by_name
    ]
    rows = []
    for queue in known + departed:
        kind = kind_of(queue.name)
        row = {
            "name": queue.name,
            "worker": by_name[queue.name]
            if queue.name in by_name
            else queue.name.removeprefix(prefixes[kind]),
            "kind": kind,
            "worker_alive": queue.name in by_name,
            "queued": queue.count,
            "running": running(queue),
            "failed": queue.failed_job_registry.get_job_count(cleanup=False),
        }
        if row["worker_alive"] or row["queued"]:
            rows.append(row)
    return rows
