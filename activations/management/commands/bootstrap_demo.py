"""``manage.py bootstrap_demo``: the demo-gpt2 model, a demo dataset, a labelled one (docstrings by
their module's topic, for sparse probing) and (embedded default) a demo user.

Idempotent: a second run reuses the trained model, the dataset and the rows.
"""

import json
import secrets
import time

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand
from tqdm import tqdm

from activations.models import Dataset
from activations.services import dataset_create_from_texts
from engine.demo_training import demo_corpus, demo_topics, train_demo_gpt2
from models_app.models import LanguageModel
from models_app.services import model_register

DEMO_MODEL_NAME = "demo-gpt2"
DEMO_DATASET_NAME = "demo-docstrings"
DEMO_DATASET_SAMPLES = 2000
DEMO_TOPICS_NAME = "demo-docstring-topics"


class Command(BaseCommand):
    help = "Train (once) and register the demo-gpt2 model and demo dataset."

    def add_arguments(self, parser):
        parser.add_argument("--training-seconds", type=float, default=90.0, help="Training time budget.")

    def handle(self, *args, **options):

        owner = self.demo_user() if settings.EMBEDDED_DATABASE else None
        folder = settings.LOCAL_MODEL_ROOTS[0] / DEMO_MODEL_NAME
        report_file = folder / "training_report.json"
        if report_file.exists():
            self.stdout.write(f"Reusing the trained {DEMO_MODEL_NAME}.")
        else:
            folder.parent.mkdir(parents=True, exist_ok=True)
            budget = options["training_seconds"]
            self.stdout.write(f"Training {DEMO_MODEL_NAME} for up to {budget:.0f} s on local text…")
            started = time.monotonic()
            with tqdm(total=round(budget), unit="s", desc="training", leave=True) as bar:

                def progress(step: int, loss: float, _bar=bar) -> None:
                    _bar.n = min(round(time.monotonic() - started), _bar.total)
                    _bar.set_postfix(step=step, loss=f"{loss:.2f}")

                report = train_demo_gpt2(folder, time_budget_seconds=budget, progress=progress)
                bar.update(bar.total - bar.n)
            self.stdout.write(
                f"Trained {report.steps} steps in {report.seconds:.0f} s: "
                f"loss {report.initial_loss:.2f} → {report.final_loss:.2f}"
            )
        if not LanguageModel.objects.filter(identifier=str(folder.resolve())).exists():
            model = model_register(source="local", identifier=str(folder), name=DEMO_MODEL_NAME, owner=owner)
            self.stdout.write(f"Registered model {model.id}.")
        if not Dataset.objects.filter(name=DEMO_DATASET_NAME).exists():
            dataset = dataset_create_from_texts(
                name=DEMO_DATASET_NAME, texts=demo_corpus()[:DEMO_DATASET_SAMPLES], owner=owner,
                source=Dataset.Source.BUILTIN,
            )  # fmt: skip
            self.stdout.write(f"Registered dataset {dataset.id} ({dataset.sample_count} samples).")
        if not Dataset.objects.filter(name=DEMO_TOPICS_NAME).exists():
            pairs = demo_topics()
            labelled = dataset_create_from_texts(
                name=DEMO_TOPICS_NAME, texts=[text for text, _ in pairs],
                labels=[topic for _, topic in pairs], label_field="topic", owner=owner,
                source=Dataset.Source.BUILTIN,
            )  # fmt: skip
            self.stdout.write(
                f"Registered labelled dataset {labelled.id} ({labelled.sample_count} samples, "
                f"{len(labelled.classes)} topics: sparse probing reads it)."
            )
        summary = json.loads(report_file.read_text()) if report_file.exists() else {}
        if summary:
            self.stdout.write(f"Demo ready (final training loss {summary.get('final_loss', 0):.2f}).")

    def demo_user(self):
        """The embedded default's demo user (admin); its password is kept in the data directory."""
        credentials = settings.DATA_DIR / "demo-credentials.txt"
        user, created = get_user_model().objects.get_or_create(username="demo")
        if created or not credentials.exists():
            password = secrets.token_urlsafe(9)
            user.set_password(password)
            user.is_staff = user.is_superuser = True
            user.save()
            credentials.write_text(f"username demo, password {password}\n")
            credentials.chmod(0o600)
        user.groups.set([Group.objects.get(name="model:admin")])
        return user
