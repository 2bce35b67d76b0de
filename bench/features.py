"""Feature analysis of every feature of an SAE over a cache of >= 1M tokens, against sae-dashboard
building the same features' dashboards; dashboard open latency with 24,576 features stored; peak
RSS at 1x and 4x the cache.

Model and data. demo-gpt2, the workbench's demo model (engine/demo_training.py: 4 layers, width
128, a 4,096-token BPE vocabulary; trained here for ``--demo-seconds`` (90 s) unless
``--model-dir``, by default data/local_models/demo-gpt2, holds one already trained). Tokens: the
demo corpus (the standard library's docstrings, engine/testing/corpus.py), tokenized once and
joined with eos into one stream of about 192k tokens, cut into sequences of 128 tokens; the
stream is passed over again with the cut shifted by 37 tokens each pass (0, 37, 74, ...) until
``--tokens`` tokens are reached, so the text repeats about 5.5x at 1M tokens but no sequence does
(every activation depends on its whole prefix, so no two are the same row).

Cache and SAE. ``blocks.2.hook_resid_post`` of every token is extracted with the engine's
extraction path (``plan_batches`` -> ``extract`` -> the store's ``CacheWriter``, the worker task's
path) into a cache on disk. A TopK SAE with d_sae = 8 x d_in (1,024 features), k = 32, is trained
by ``engine.sae.train`` for one pass over the cache (batch 1,024, lr 1e-3) and saved as a SAELens
folder (``save_saelens``). Both contenders use that folder.

Contenders, each in a fresh process:

* **ours** (the project's environment): what the ``run_feature_analysis`` job computes, timed
  from the open cache and loaded SAE to ``features.safetensors`` on disk: ``analyze`` (three
  streamed passes over the cache), ``feature_arrays``, ``decoder_neighbours``, ``logit_effects``
  through the model's unembedding, and ``save_file``. It reads the cache: no model forward.
  Median of ``--repeats`` runs.
* **sae-dashboard** 0.8.0 (``.venv-dashboard``, see bench/requirements-dashboard.txt; it needs
  transformer-lens 2 / transformers 4, the project's bench environment has 3 / 5):
  ``SaeVisRunner(SaeVisConfig(...)).run(sae, model, tokens)`` on the same SAE folder loaded by
  sae-lens's ``SAE.load_from_disk``, a TransformerLens ``HookedTransformer`` built from the same
  weights (``convert_gpt2_weights``, no Hub), and the same token ids as one [sequences, 128]
  tensor. It runs the model forward itself (once per batch of 256 features), so the table also
  gives ours + extraction, the model forward included. Its layout is set to build what ours
  stores: top 20 activations, 5 intervals x 4 examples, 8 tokens before and 3 after, histograms of
  40 bins, 10 logit and feature-table rows. Only the data is built (no HTML), as ours.
  ``quantile_feature_batch_size`` is lowered to what ``torch.quantile``'s 2^24-element limit
  allows at this many tokens (2^24 // tokens features at a time: its default of 64 fails past
  262,144 tokens). sae-dashboard folds
  each feature's decoder norm into its encoder first (and sae-lens allows that for a TopK SAE only
  with ``rescale_acts_by_decoder_norm`` on): the SAE is saved with unit-norm decoder rows (the
  trainer's scaling folded into the encoder instead, see ``train_sae``), so the flag is turned on
  in the loaded SAE and changes no activation. The child also adds up the seconds of its main
  parts (forward + encode + correlations, quantiles, histograms, examples) by wrapping them.
  ``--features-subset N`` runs only its first N features and extrapolates its time linearly to
  all (reported as such); by default every feature.

Checks of equality: every compared feature's top activations (sequence, position, value) from
ours' ``features.safetensors`` against sae-dashboard's top group. sae-dashboard never picks a
token within 9 of a sequence's start or 3 of its end (the context it shows must fit), so ours'
top list, filtered to those positions, must equal the head of its list: same positions, values
within 2e-3 (sae-dashboard rounds to 4 decimals; the model forward differs between
TransformerLens and transformers by float rounding). A swap of two near-equal values counts as
equal when the values agree. Also each feature's max and density against its statistics.

Dashboard open: a fresh process with a temporary ``MISTUDIO_DATA_DIR`` (SQLite and the embedded
Redis unless DATABASE_URL / REDIS_URL are set) registers demo-gpt2, writes a cache of the first
``--latency-tokens`` rows of the big one with the store's writer, trains a TopK SAE with 24,576
features on it briefly (one pass) and runs the real analysis job: ``POST
/api/saes/{id}/analyses`` and a burst worker (``run_worker``), which writes features.safetensors
and 24,576 Feature rows. Then ``GET /api/saes/{id}/features/{index}`` for ``--requests`` random
features among those that fired (a dead one's dashboard has nothing to read), after 5 warm-up
requests, through the test client, timed around each request in-process (server time, no
network): p50 / p95 / max. d_in is the demo model's 128: what a dashboard read costs depends on
the number of features and the per-feature arrays, not on d_in.

Peak RSS: ours on the cache and on one 4x larger (same stream, more passes), fresh processes
each, as VmHWM (/proc/self/status): Linux's ``ru_maxrss`` carries the parent's peak over fork +
exec, so a child of this orchestrating process (the model, the caches' writer, the SAE training)
would report at least that.

Device: ``--device`` (default cpu; ``cuda:0`` compares on one GPU) is where the model extracts
the cache, the SAE trains, ours encodes (the SAE on the device, each chunk moved there and its
activations back, as the analysis job does) and sae-dashboard runs its model and SAE. The dashboard
open latency's job stays on the CPU.

Goals: ours >= 3x faster than sae-dashboard with the same top activations; dashboard open p95 <=
150 ms with 24,576 features; our peak RSS grows <= 10 % with a 4x larger cache.

    .venv/bin/python bench/features.py [--tokens 1048576] [--repeats 3] [--features-subset N]
        [--model-dir /path/to/demo-gpt2] [--device cuda:0] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peers import load_transformer_lens  # noqa: E402  (bench/, the script's own folder)

HOOK = "blocks.2.hook_resid_post"
SEQUENCE_LENGTH = 128
PASS_SHIFT = 37  # tokens by which each pass over the corpus stream moves the cut
EXTRACTION_BATCH = 32  # sequences per forward
EXPANSION = 8
K = 32
LATENCY_FEATURES = 24_576
DASHBOARD_PYTHON = ROOT / ".venv-dashboard" / "bin" / "python"
QUANTILE_LIMIT = 2**24  # torch.quantile refuses inputs with more elements
VALUE_TOLERANCE = 2e-3
GOAL_SPEEDUP = 3.0
GOAL_P95_MS = 150.0
GOAL_RSS_GROWTH = 0.10


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, the peak of its own memory map. Linux's ru_maxrss also
    carries over the parent's peak through fork + exec, so a child of this (large) orchestrating
    process would report at least the parent's size; ru_maxrss where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- data, cache, SAE (main process, project environment) ----------------------------------------


def demo_model(folder: Path | None, workdir: Path, seconds: float) -> tuple[Path, str]:
    """A trained demo-gpt2 folder: ``folder`` if it holds one, else trained now into ``workdir``."""
    if folder is not None and (folder / "training_report.json").exists():
        return folder, f"demo-gpt2 from {folder}"
    from engine.demo_training import train_demo_gpt2

    print(f"training demo-gpt2 ({seconds:.0f} s)…", flush=True)
    report = train_demo_gpt2(workdir / "demo-gpt2", time_budget_seconds=seconds)
    return (
        workdir / "demo-gpt2",
        f"demo-gpt2 trained {seconds:.0f} s here (held-out loss {report.final_loss:.2f})",
    )


def token_sequences(tokenizer, tokens: int):
    """[n, SEQUENCE_LENGTH] token ids, n * SEQUENCE_LENGTH >= ``tokens``: the demo corpus as one
    eos-joined stream, cut into sequences, the cut shifted by PASS_SHIFT on each further pass."""
    import numpy as np

    from engine.demo_training import demo_corpus

    encodings = tokenizer.backend_tokenizer.encode_batch(demo_corpus(), add_special_tokens=False)
    eos = tokenizer.eos_token_id
    stream = np.fromiter((token for encoding in encodings for token in [*encoding.ids, eos]), dtype=np.int64)
    count = math.ceil(tokens / SEQUENCE_LENGTH)
    parts, have, offset_pass = [], 0, 0
    while have < count:
        offset = (offset_pass * PASS_SHIFT) % SEQUENCE_LENGTH
        usable = (len(stream) - offset) // SEQUENCE_LENGTH
        parts.append(stream[offset : offset + usable * SEQUENCE_LENGTH].reshape(usable, SEQUENCE_LENGTH))
        have += usable
        offset_pass += 1
    return np.concatenate(parts)[:count], len(stream)


def write_cache(model, sequences, directory: Path) -> float:
    """The worker task's path: ``plan_batches`` -> ``extract`` -> ``CacheWriter``; seconds taken."""
    from activations.store import CacheWriter, shard_tokens_for
    from engine.extraction import extract, plan_batches

    tokenized = sequences.tolist()
    widths = {HOOK: model.config.n_embd}
    started = time.perf_counter()
    plan = plan_batches([len(ids) for ids in tokenized], EXTRACTION_BATCH)
    writer = CacheWriter.create_or_resume(
        directory,
        key={"bench": "features", "sequences": len(tokenized)},
        provenance={"batch_size": EXTRACTION_BATCH},
        hooks=widths,
        dtype="float32",
        shard_max_tokens=shard_tokens_for(widths, "float32"),
    )
    with writer:
        for batch in extract(model, tokenized, plan, hooks=[HOOK], dtype="float32"):
            writer.add_extracted(batch)
        writer.finalize(num_samples=len(tokenized))
    return time.perf_counter() - started


def train_sae(
    cache: Path, save_to: Path, *, d_sae: int, rows: int | None = None, device: str = "cpu"
) -> dict:
    """A TopK SAE trained by the engine on ``device`` for one pass over the cache's first ``rows``
    rows."""
    import torch

    from activations.store import ActivationStore
    from engine.sae import TrainingConfig, shuffled_batches, train
    from engine.sae.formats import save_saelens

    store = ActivationStore.open(cache)
    total, d_in = store.shape(HOOK)
    rows = min(rows or total, total)
    batch_size = 1024
    config = TrainingConfig(
        architecture="topk",
        d_sae=d_sae,
        k=K,
        lr=1e-3,
        batch_size=batch_size,
        total_tokens=rows,
        warmup_steps=max(1, rows // batch_size // 20),
    )

    def chunks(step: int = 16384):
        for start in range(0, rows, step):
            yield store.get(HOOK, start, min(start + step, rows), as_torch=True).float()

    torch.manual_seed(0)
    started = time.perf_counter()
    trained = train(
        shuffled_batches(chunks(), batch_size=batch_size, buffer_rows=16 * batch_size),
        d_in=d_in,
        config=config,
        sample=store.get(HOOK, 0, min(rows, 8192), as_torch=True).float(),
        device=device,
    )
    seconds = time.perf_counter() - started
    sae = trained.sae
    with torch.no_grad():
        # The trainer keeps decoder rows at unit norm and folds its activation scaling into them
        # (every row then has norm 1 / scaling). Moved into the encoder instead: the same SAE
        # (equal norms leave TopK's choice alone, reconstructions are unchanged), with the
        # unit-norm decoder sae-dashboard expects; it would fold the norms itself otherwise,
        # and its activations would be ours times the norm.
        norms = sae.W_dec.norm(dim=1)
        sae.W_enc.mul_(norms)
        sae.b_enc.mul_(norms)
        sae.W_dec.div_(norms[:, None])
    save_saelens(sae, save_to, hook_name=HOOK, model_name="demo-gpt2")
    last = trained.history[-1]
    return {
        "seconds": seconds,
        "steps": trained.steps,
        "d_in": d_in,
        "d_sae": d_sae,
        "explained_variance": last.explained_variance,
        "l0": last.l0,
        "dead": last.dead,
        "decoder_norms": [float(norms.min()), float(norms.max())],
    }


# -- ours (a fresh process, project environment) ----------------------------------------------------


def ours_main(cache: str, sae_folder: str, model_folder: str, out: str, device: str = "cpu") -> dict:
    """The job's computation over the cache, the SAE on ``device``, timed; arrays written to
    ``out``/features.safetensors."""
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    from activations.store import ActivationStore
    from engine.features.analysis import AnalysisConfig, TokenTable, analyze, feature_arrays
    from engine.features.decoder import decoder_neighbours, logit_effects, unembedding
    from engine.sae.formats import load_saelens

    store = ActivationStore.open(Path(cache))
    table = store.tokens()
    tokens = TokenTable(table["token_ids"], table["sample_index"], table["position"])
    module, _ = load_saelens(sae_folder)
    module.eval().to(device)
    weights = unembedding(AutoModelForCausalLM.from_pretrained(model_folder).eval())
    config = AnalysisConfig()
    rss_before = peak_rss_mib()
    phase_ends: dict[int, float] = {}

    def on_progress(progress) -> None:
        phase_ends[progress.phase] = time.perf_counter()

    started = time.perf_counter()
    with torch.no_grad():
        state = analyze(
            lambda rows: module.encode(rows.to(device)).float().cpu(),  # as the analysis job
            lambda start, stop: store.get(HOOK, start, stop, as_torch=True).float(),
            tokens,
            d_sae=module.shape.d_sae,
            config=config,
            on_progress=on_progress,
        )
        swept = time.perf_counter()
        arrays = feature_arrays(state, tokens, config)
        arrays.update(decoder_neighbours(module.W_dec))
        arrays.update(logit_effects(module.W_dec, *weights))
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(Path(out) / "features.safetensors"))
    finished = time.perf_counter()
    ends = [started] + [phase_ends.get(phase, swept) for phase in (1, 2, 3)]
    return {
        "tokens": len(tokens),
        "d_sae": module.shape.d_sae,
        "seconds": finished - started,
        "passes": [ends[i + 1] - ends[i] for i in range(3)],
        "results_seconds": finished - swept,
        "peak_rss_mib": peak_rss_mib(),
        "rss_before_mib": rss_before,
        "threads": torch.get_num_threads(),
    }


# -- sae-dashboard (a fresh process in .venv-dashboard) ---------------------------------------------


def dashboard_layout():
    """sae-dashboard's feature-centric layout, sized to what ours stores."""
    from sae_dashboard.components_config import (
        ActsHistogramConfig,
        Column,
        FeatureTablesConfig,
        LogitsHistogramConfig,
        LogitsTableConfig,
        SequencesConfig,
    )
    from sae_dashboard.layout import SaeVisLayoutConfig

    from_ours = {"before": 8, "after": 3, "top_k": 20, "intervals": 5, "per_interval": 4, "bins": 40}
    return SaeVisLayoutConfig(
        columns=[
            Column(FeatureTablesConfig(n_rows=10)),
            Column(
                ActsHistogramConfig(n_bins=from_ours["bins"]),
                LogitsTableConfig(n_rows=10),
                LogitsHistogramConfig(n_bins=from_ours["bins"]),
            ),
            Column(
                SequencesConfig(
                    stack_mode="stack-none",
                    buffer=(from_ours["before"], from_ours["after"]),
                    top_acts_group_size=from_ours["top_k"],
                    n_quantiles=from_ours["intervals"],
                    quantile_group_size=from_ours["per_interval"],
                )
            ),
        ],
        height=750,
    )


def time_stages() -> dict[str, float]:
    """Wrap the parts of sae-dashboard's run where its time goes, adding up each one's seconds."""
    from sae_dashboard.feature_data_generator import FeatureDataGenerator
    from sae_dashboard.sequence_data_generator import SequenceDataGenerator
    from sae_dashboard.utils_fns import FeatureStatistics, HistogramData

    stages: dict[str, float] = {}

    def timed(name: str, function):
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                stages[name] = stages.get(name, 0.0) + time.perf_counter() - began

        return wrapper

    FeatureDataGenerator.get_feature_data = timed(
        "forward, encode, correlations", FeatureDataGenerator.get_feature_data
    )
    FeatureStatistics.create = classmethod(timed("quantiles", FeatureStatistics.create.__func__))
    HistogramData.from_data = classmethod(timed("histograms", HistogramData.from_data.__func__))
    SequenceDataGenerator.get_sequences_data = timed("examples", SequenceDataGenerator.get_sequences_data)
    return stages


def dashboard_main(
    sae_folder: str, model_folder: str, tokens_file: str, out: str, subset: int, device: str = "cpu"
) -> dict:
    import importlib.metadata

    import numpy as np
    import torch
    from sae_dashboard.sae_vis_data import SaeVisConfig
    from sae_dashboard.sae_vis_runner import SaeVisRunner
    from sae_lens import SAE

    model = load_transformer_lens(Path(model_folder), tokenizer=False).to(device)
    sae = SAE.load_from_disk(sae_folder, device=device)
    norm_error = float((sae.W_dec.detach().norm(dim=1) - 1).abs().max())
    if getattr(sae.cfg, "rescale_acts_by_decoder_norm", None) is False:
        # sae-dashboard folds the decoder norms into the encoder, which sae-lens allows for TopK
        # only with this flag; with unit-norm decoder rows it changes no activation.
        assert norm_error < 1e-4, f"decoder rows are not unit-norm ({norm_error})"
        sae.cfg.rescale_acts_by_decoder_norm = True
    tokens = torch.from_numpy(np.load(tokens_file))
    d_sae = sae.cfg.d_sae
    features = list(range(min(subset, d_sae) if subset else d_sae))
    cfg = SaeVisConfig(
        hook_point=sae.cfg.metadata.hook_name,
        features=features,
        minibatch_size_features=256,
        minibatch_size_tokens=64,
        quantile_feature_batch_size=max(1, (QUANTILE_LIMIT - 1) // tokens.numel()),
        device=device,
        dtype="float32",
        feature_centric_layout=dashboard_layout(),
        verbose=False,
    )
    stages = time_stages()
    rss_before = peak_rss_mib()
    started = time.perf_counter()
    data = SaeVisRunner(cfg).run(encoder=sae, model=model, tokens=tokens)
    seconds = time.perf_counter() - started
    before = cfg.feature_centric_layout.seq_cfg.buffer[0]
    top = {}
    for feature in features:
        group = data.feature_data_dict[feature].sequence_data.seq_group_data[0]
        top[feature] = [
            [sequence.original_index, sequence.qualifying_token_index, sequence.feat_acts[before]]
            for sequence in group.seq_data
        ]
    Path(out).write_text(
        json.dumps(
            {
                "features": features,
                "top": {str(feature): rows for feature, rows in top.items()},
                "max": list(data.feature_stats.max),
                "frac_nonzero": list(data.feature_stats.frac_nonzero),
            }
        )
    )
    return {
        "seconds": seconds,
        "features": len(features),
        "d_sae": d_sae,
        "tokens": tokens.numel(),
        "peak_rss_mib": peak_rss_mib(),
        "rss_before_mib": rss_before,
        "decoder_norm_error": norm_error,
        "quantile_feature_batch_size": cfg.quantile_feature_batch_size,
        "stages": stages,
        "threads": torch.get_num_threads(),
        "versions": {
            name: importlib.metadata.version(name)
            for name in ("sae-dashboard", "sae-lens", "transformer-lens", "transformers", "torch")
        },
    }


# -- equality of the top activations --------------------------------------------------------------


def compare(ours_folder: Path, dashboard_file: Path, sequence_length: int) -> dict:
    """Ours' top activations (at positions sae-dashboard may pick) against sae-dashboard's."""
    import numpy as np
    from safetensors.numpy import load_file

    ours = load_file(str(ours_folder / "features.safetensors"))
    theirs = json.loads(dashboard_file.read_text())
    low, high = 8 + 1, sequence_length - 3  # sae-dashboard's buffer (8, 3): positions [9, 125)
    same_positions = within_tolerance = compared_examples = 0
    worst = 0.0
    mismatches = []
    for feature in theirs["features"]:
        rows = ours["top_rows"][feature]
        keep = (rows >= 0) & (ours["top_position"][feature] >= low) & (ours["top_position"][feature] < high)
        mine = list(
            zip(
                ours["top_sample"][feature][keep].tolist(),
                ours["top_position"][feature][keep].tolist(),
                ours["top_values"][feature][keep].tolist(),
                strict=True,
            )
        )
        positive = [entry for entry in theirs["top"][str(feature)] if entry[2] > 0]
        # Ours' list is the feature's top 20 over all positions: filtered, it is the head of
        # theirs; when the feature fired fewer than 20 times, it is all of theirs.
        other = positive if (rows >= 0).sum() < len(rows) else positive[: len(mine)]
        compared_examples += len(mine)
        if len(other) != len(mine):
            mismatches.append((feature, f"{len(mine)} examples vs {len(other)}"))
            continue
        positions = all(tuple(a[:2]) == tuple(b[:2]) for a, b in zip(mine, other, strict=True))
        gaps = [abs(a[2] - b[2]) for a, b in zip(mine, other, strict=True)]
        worst = max([worst, *gaps])
        same_positions += positions
        if all(gap <= VALUE_TOLERANCE for gap in gaps):  # a swap of near-equal values is equal
            within_tolerance += 1
        else:
            mismatches.append((feature, f"positions {positions}, max value gap {max(gaps):.2e}"))
    features = theirs["features"]
    max_gap = float(np.max(np.abs(ours["max"][features] - np.asarray(theirs["max"]))))
    density_gap = float(np.max(np.abs(ours["density"][features] - np.asarray(theirs["frac_nonzero"]))))
    return {
        "features": len(features),
        "examples": compared_examples,
        "same_positions": same_positions,
        "equal": within_tolerance,
        "max_value_gap": worst,
        "max_of_max_gap": max_gap,
        "max_density_gap": density_gap,
        "mismatches": mismatches[:10],
    }


# -- dashboard open latency (a fresh process, Django on a temporary data directory) ---------------


def latency_main(model_folder: str, cache: str, rows: int, d_sae: int, requests: int) -> dict:
    data_dir = Path(tempfile.mkdtemp(prefix="bench-features-latency-"))
    os.environ["MISTUDIO_DATA_DIR"] = str(data_dir)
    os.environ["DJANGO_SETTINGS_MODULE"] = "mistudio.settings"
    os.environ["ALLOWED_HOSTS"] = "localhost,127.0.0.1,testserver"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    import uuid

    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    from activations.models import ActivationCache
    from activations.services import cache_store_completed, cache_store_open
    from activations.store import ActivationStore
    from features.models import Feature, FeatureAnalysis
    from mistudio import embedded_redis
    from mistudio.workers import run_worker
    from models_app.services import model_register
    from saes.models import SparseAutoencoder
    from saes.services import folder_size

    try:
        call_command("migrate", verbosity=0)
        owner = get_user_model().objects.create_user(username="bench-owner")
        owner.groups.add(Group.objects.get(name="model:write"))
        token = Token.objects.create(user=owner)
        folder = settings.LOCAL_MODEL_ROOTS[0] / "demo-gpt2"
        shutil.copytree(model_folder, folder)
        model = model_register(source="local", identifier=str(folder), name="demo-gpt2", owner=owner)

        source = ActivationStore.open(Path(cache))
        table = source.tokens()
        samples = int(table["sample_index"][rows - 1]) + 1
        rows = int((table["sample_index"] < samples).sum())  # whole samples
        d_in = source.shape(HOOK)[1]
        cache_row = ActivationCache.objects.create(
            key_hash=uuid.uuid4().hex, key={"bench": "features-latency", "rows": rows}, model=model,
            hooks=[HOOK], max_length=SEQUENCE_LENGTH, dtype="float32", sample_count=samples, owner=owner,
        )  # fmt: skip
        writer = cache_store_open(cache_row, provenance={"bench": "features"}, hooks={HOOK: d_in})
        with writer:
            for batch, start in enumerate(range(0, rows, 16384)):
                stop = min(rows, start + 16384)
                writer.add_batch(
                    batch,
                    token_ids=table["token_ids"][start:stop],
                    sample_index=table["sample_index"][start:stop],
                    positions=table["position"][start:stop],
                    activations={HOOK: source.get(HOOK, start, stop, as_torch=True)},
                )
            manifest = writer.finalize(num_samples=samples)
        cache_store_completed(cache_row, manifest=manifest, size_bytes=writer.size_bytes)

        sae = SparseAutoencoder(
            name="bench", model=model, model_name=model.display_identifier, cache=cache_row, hook_name=HOOK,
            architecture="topk", d_in=d_in, d_sae=d_sae, k=K, status=SparseAutoencoder.Status.COMPLETED,
            progress=100, owner=owner,
        )  # fmt: skip
        training = train_sae(cache_row.directory, sae.directory, d_sae=d_sae)
        sae.file_size_bytes = folder_size(sae.directory)
        sae.save()

        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
        response = client.post(f"/api/saes/{sae.id}/analyses", {}, format="json")
        assert response.status_code == 202, response.content
        started = time.perf_counter()
        run_worker(name="bench-features", device="cpu", burst=True)
        job_seconds = time.perf_counter() - started
        analysis = FeatureAnalysis.objects.get(pk=response.json()["id"])
        assert analysis.status == "completed", (analysis.error_code, analysis.error_message)
        stored = Feature.objects.filter(analysis=analysis).count()
        assert stored == d_sae, stored

        # Random features among those that fired: a dead one's dashboard has no examples to read.
        live = list(Feature.objects.filter(analysis=analysis, density__gt=0).values_list("index", flat=True))
        indices = random.Random(0).sample(live, min(len(live), requests + 5))
        latencies, bodies = [], []
        for number, index in enumerate(indices):
            began = time.perf_counter()
            response = client.get(f"/api/saes/{sae.id}/features/{index}")
            elapsed = (time.perf_counter() - began) * 1000
            assert response.status_code == 200 and response.json()["index"] == index, response.content[:300]
            if number >= 5:  # the first five warm up (imports, the tokenizer, the file's header)
                latencies.append(elapsed)
                bodies.append(response.json())
        examples = [len(body["top_examples"]) for body in bodies]
        return {
            "features": stored,
            "live": len(live),
            "tokens": analysis.tokens,
            "training_seconds": training["seconds"],
            "job_seconds": job_seconds,
            "analysis_seconds": analysis.summary.get("seconds"),
            "file_mib": analysis.data_path.stat().st_size / 2**20,
            "requests": len(latencies),
            "latencies_ms": latencies,
            "database": settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1],
            "top_examples_mean": sum(examples) / len(examples),
            "interval_examples_mean": sum(len(body["interval_examples"]) for body in bodies) / len(bodies),
            "response_kib_mean": sum(len(json.dumps(body)) for body in bodies) / len(bodies) / 1024,
        }
    finally:
        if settings.EMBEDDED_REDIS:
            embedded_redis.stop(settings.EMBEDDED_REDIS_SOCKET)
        shutil.rmtree(data_dir, ignore_errors=True)


# -- orchestration --------------------------------------------------------------------------------


def run_child(python: Path | str, *arguments: str) -> dict | None:
    """A fresh process running this file with ``arguments``; its ``RESULT`` line as JSON."""
    command = [str(python), str(Path(__file__).resolve()), *arguments]
    environment = {
        **os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore",
    }  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT, check=False)
    for line in finished.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"  {' '.join(arguments[:1])} failed (exit {finished.returncode}):\n{finished.stderr[-4000:]}")
    return None


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens", type=int, default=1_048_576, help="tokens of the cache (>= 1M for the issue)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of ours on the cache (median)")
    parser.add_argument(
        "--features-subset", type=int, default=0, help="sae-dashboard on its first N features only (0: all)"
    )
    parser.add_argument("--model-dir", type=Path, default=ROOT / "data" / "local_models" / "demo-gpt2")
    parser.add_argument("--demo-seconds", type=float, default=90.0, help="demo-gpt2's training budget")
    parser.add_argument("--latency-features", type=int, default=LATENCY_FEATURES)
    parser.add_argument(
        "--latency-tokens", type=int, default=65_536, help="the 24,576-feature analysis's cache"
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--dashboard-python", type=Path, default=DASHBOARD_PYTHON)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: dashboard,latency,rss")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--workdir", type=Path, help="keep the caches, SAE and outputs here (a new folder)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 16k tokens, 1 run, 2,048-feature latency, 10 s demo"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where extraction, SAE training, ours and sae-dashboard run: cpu (default) or cuda:N",
    )
    parser.add_argument("--ours", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--dashboard", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--latency", nargs=5, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.ours:
        print("RESULT " + json.dumps(ours_main(*arguments.ours, device=arguments.device)))
        return
    if arguments.dashboard:
        *paths, subset = arguments.dashboard
        print("RESULT " + json.dumps(dashboard_main(*paths, int(subset), device=arguments.device)))
        return
    if arguments.latency:
        folder, cache, rows, d_sae, requests = arguments.latency
        print("RESULT " + json.dumps(latency_main(folder, cache, int(rows), int(d_sae), int(requests))))
        return
    if arguments.quick:
        arguments.tokens, arguments.repeats = 16_384, 1
        arguments.latency_features, arguments.latency_tokens, arguments.requests = 2048, 8192, 50
        arguments.demo_seconds = 10.0
    skip = {part.strip() for part in arguments.skip.split(",") if part.strip()}
    results = run(arguments, skip)
    if arguments.json:
        arguments.json.write_text(json.dumps(results, indent=2))
    report(results, arguments)


def run(arguments: argparse.Namespace, skip: set[str]) -> dict:
    import numpy as np
    import torch

    from engine.loading import load_weights

    results: dict = {"tokens_requested": arguments.tokens}
    workdir = arguments.workdir or Path(tempfile.mkdtemp(prefix="bench-features-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        folder, model_note = demo_model(arguments.model_dir, workdir, arguments.demo_seconds)
        device = arguments.device
        weights = load_weights(folder, model_type="gpt2", quantization="none", device=device)
        model = weights.model
        results["model"] = model_note
        results["threads"] = torch.get_num_threads()
        results["device"] = device
        caches = {}
        for factor in (1, 4) if "rss" not in skip else (1,):
            sequences, stream = token_sequences(weights.tokenizer, factor * arguments.tokens)
            caches[factor] = workdir / f"cache-{factor}x"
            print(f"extracting {sequences.size:,} tokens ({factor}x) into a cache…", flush=True)
            seconds = write_cache(model, sequences, caches[factor])
            results[f"extraction_{factor}x"] = {"tokens": int(sequences.size), "seconds": seconds}
            if factor == 1:
                np.save(workdir / "tokens.npy", sequences)
                results["sequences"], results["stream_tokens"] = len(sequences), stream
        del model, weights
        from activations.store import ActivationStore

        d_in = ActivationStore.open(caches[1]).shape(HOOK)[1]
        results["d_in"] = d_in
        print(f"training the SAE ({EXPANSION * d_in} features, one pass)…", flush=True)
        sae = workdir / "sae"
        results["training"] = train_sae(caches[1], sae, d_sae=EXPANSION * d_in, device=device)

        runs = []
        for repeat in range(arguments.repeats):
            print(f"ours, run {repeat + 1}/{arguments.repeats}…", flush=True)
            outcome = run_child(
                sys.executable, "--ours", str(caches[1]), str(sae), str(folder), str(workdir / "ours"),
                "--device", device,
            )  # fmt: skip
            if outcome is None:
                sys.exit("ours failed")
            runs.append(outcome)
        results["ours"] = {
            "runs": runs,
            "seconds": statistics.median(run["seconds"] for run in runs),
            "peak_rss_mib": max(run["peak_rss_mib"] for run in runs),
        }

        if "dashboard" not in skip:
            if not arguments.dashboard_python.exists():
                print(f"{arguments.dashboard_python} not found: see bench/requirements-dashboard.txt")
            else:
                print("sae-dashboard…", flush=True)
                out = workdir / "dashboard.json"
                outcome = run_child(
                    arguments.dashboard_python, "--dashboard", str(sae), str(folder),
                    str(workdir / "tokens.npy"), str(out), str(arguments.features_subset), "--device", device,
                )  # fmt: skip
                if outcome is not None:
                    results["dashboard"] = outcome
                    results["equality"] = compare(workdir / "ours", out, SEQUENCE_LENGTH)

        if "rss" not in skip:
            print("ours on the 4x cache…", flush=True)
            results["ours_4x"] = run_child(
                sys.executable, "--ours", str(caches[4]), str(sae), str(folder), str(workdir / "ours-4x"),
                "--device", device,
            )  # fmt: skip

        if "latency" not in skip:
            print(f"dashboard latency: {arguments.latency_features:,} features through the job…", flush=True)
            results["latency"] = run_child(
                sys.executable, "--latency", str(folder), str(caches[1]), str(arguments.latency_tokens),
                str(arguments.latency_features), str(arguments.requests),
            )  # fmt: skip
    finally:
        if arguments.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return results


def report(results: dict, arguments: argparse.Namespace) -> None:
    tokens = results["extraction_1x"]["tokens"]
    ours, training = results["ours"], results["training"]
    d_sae = ours["runs"][0]["d_sae"]
    print()
    print(
        f"{results['model']}; {HOOK} (d_in {results['d_in']}); TopK SAE, {d_sae:,} features "
        f"({EXPANSION}x), k {K}, trained one pass ({training['steps']} steps, {training['seconds']:.0f} s, "
        f"explained variance {training['explained_variance']:.3f}); {tokens:,} tokens = "
        f"{results['sequences']:,} sequences x {SEQUENCE_LENGTH} (the corpus stream of "
        f"{results['stream_tokens']:,} tokens {tokens / results['stream_tokens']:.1f}x, cut shifted by "
        f"{PASS_SHIFT} each pass); on {results['device']}, torch threads {results['threads']}; "
        "a shared 2-core machine"
    )
    print(f"  {'':<48} {'seconds':>8} {'tokens/s':>10} {'peak RSS':>10}")

    def row(label: str, seconds: float, rss: float | None = None, note: str = "") -> None:
        rss_text = f"{rss:,.0f} MiB" if rss else ""
        print(f"  {label:<48} {seconds:>8.1f} {tokens / seconds:>10,.0f} {rss_text:>10}  {note}")

    def median(values) -> float:
        return statistics.median(values)

    extraction = results["extraction_1x"]["seconds"]
    row("extraction (model forward + cache write)", extraction)
    passes = [median(run["passes"][i] for run in ours["runs"]) for i in range(3)]
    runs = ", ".join(f"{run['seconds']:.1f}" for run in ours["runs"])
    row(
        f"ours: feature analysis (median of {len(ours['runs'])})", ours["seconds"], ours["peak_rss_mib"],
        f"runs {runs} s; passes "
        f"{' / '.join(f'{value:.1f}' for value in passes)} s; results + file "
        f"{median(run['results_seconds'] for run in ours['runs']):.1f} s",
    )  # fmt: skip
    row("ours + extraction", ours["seconds"] + extraction)
    dashboard = results.get("dashboard")
    if dashboard:
        scale = dashboard["d_sae"] / dashboard["features"]
        seconds = dashboard["seconds"] * scale
        stages = ", ".join(f"{name} {value * scale:.1f} s" for name, value in dashboard["stages"].items())
        versions = dashboard["versions"]
        note = f"v{versions['sae-dashboard']} (sae-lens {versions['sae-lens']}): {stages}"
        if scale != 1:
            note += f"; {dashboard['features']} features took {dashboard['seconds']:.1f} s, x{scale:.1f}"
        row("sae-dashboard SaeVisRunner.run (its forward)", seconds, dashboard["peak_rss_mib"], note)
        ratio = seconds / ours["seconds"]
        histograms = dashboard["stages"].get("histograms", 0.0) * scale
        verdict = "met" if ratio >= GOAL_SPEEDUP else "MISSED"
        print(
            f"  sae-dashboard / ours: {ratio:.2f}x (goal >= {GOAL_SPEEDUP:.0f}x: {verdict}); with our "
            f"extraction counted {seconds / (ours['seconds'] + extraction):.2f}x; without its histograms "
            f"{(seconds - histograms) / ours['seconds']:.2f}x"
            + (" (extrapolated from a subset)" if scale != 1 else "")
        )
        equality = results["equality"]
        print(
            f"  top activations of {equality['features']:,} features ({equality['examples']:,} examples at "
            f"positions both may pick): {equality['equal']:,} equal within {VALUE_TOLERANCE:g}, "
            f"{equality['same_positions']:,} with identical positions; largest value gap "
            f"{equality['max_value_gap']:.1e}; max activation gap {equality['max_of_max_gap']:.1e}, "
            f"density gap {equality['max_density_gap']:.1e}"
        )
        for feature, why in equality["mismatches"]:
            print(f"    feature {feature}: {why}")
    large = results.get("ours_4x")
    if large:
        growth = large["peak_rss_mib"] / ours["peak_rss_mib"] - 1
        print(
            f"  ours' peak RSS (VmHWM): {ours['peak_rss_mib']:,.0f} MiB at {tokens:,} tokens, "
            f"{large['peak_rss_mib']:,.0f} MiB at {large['tokens']:,} ({large['seconds']:.1f} s, "
            f"{large['tokens'] / large['seconds']:,.0f} tok/s): {growth:+.1%} "
            f"(goal <= {GOAL_RSS_GROWTH:.0%}: {'met' if growth <= GOAL_RSS_GROWTH else 'MISSED'})"
        )
    latency = results.get("latency")
    if latency:
        values = latency["latencies_ms"]
        p95 = percentile(values, 0.95)
        print(
            f"  GET /api/saes/{{id}}/features/{{index}}, {latency['features']:,} features stored "
            f"({latency['live']:,} fired; {latency['file_mib']:.0f} MiB file, {latency['database']}), "
            f"{latency['requests']} random features that fired (on average "
            f"{latency['top_examples_mean']:.1f} top + {latency['interval_examples_mean']:.1f} interval "
            f"examples, {latency['response_kib_mean']:.0f} KiB of JSON): "
            f"p50 {percentile(values, 0.5):.1f} ms, p95 {p95:.1f} ms, max {max(values):.1f} ms "
            f"(goal p95 <= {GOAL_P95_MS:.0f} ms: {'met' if p95 <= GOAL_P95_MS else 'MISSED'}); the job over "
            f"{latency['tokens']:,} tokens took {latency['job_seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
