"""``manage.py worker``: a named RQ SimpleWorker on its own queue plus the shared queue."""

import socket

from django.core.management.base import BaseCommand, CommandError

from engine.placement import Placement, PlacementError, parse_device, parse_max_memory
from mistudio.workers import default_device, run_worker
from models_app.services import worker_release_models


class Command(BaseCommand):
    help = "Run a miStudio worker (rq.SimpleWorker) that loads models and runs jobs on one device."

    def add_arguments(self, parser):
        parser.add_argument(
            "--name", help="Worker name, unique across the deployment (default: host-device)."
        )
        parser.add_argument(
            "--device",
            help="cpu, cuda:0, cuda:1, …, or auto: split each model across the GPUs, the CPU and "
            "disk (default: cuda:0 if available, else cpu).",
        )
        parser.add_argument(
            "--max-memory",
            help="With --device auto: the most each device may hold, e.g. cuda:0=20GiB,cpu=64GiB "
            "(default: what each device has free); what fits nowhere is offloaded to disk "
            "(MODEL_OFFLOAD_DIR).",
        )
        parser.add_argument("--burst", action="store_true", help="Exit once the queues are empty.")
        parser.add_argument("--max-jobs", type=int, default=None)

    def handle(self, *args, **options):

        try:
            device = parse_device(options["device"] or default_device())
            max_memory = parse_max_memory(options["max_memory"]) if options["max_memory"] else {}
            placement = Placement(device=device, max_memory=max_memory)
        except PlacementError as error:
            raise CommandError(error.message) from error
        name = options["name"] or f"{socket.gethostname()}-{device.replace(':', '')}"
        if not name.replace("-", "").replace("_", "").isalnum():
            raise CommandError("--name may contain letters, digits, '-' and '_' only.")
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # progress goes out as events, not into the log
        self.stdout.write(f"worker {name} on {placement.describe()}")
        try:
            run_worker(
                name=name, device=device, max_memory=max_memory, burst=options["burst"],
                max_jobs=options["max_jobs"],
            )  # fmt: skip
        finally:  # the process ends: the models it held are gone
            worker_release_models(
                worker_name=name, reason="worker_stopped", message="The worker hosting this model stopped."
            )
