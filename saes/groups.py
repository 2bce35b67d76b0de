"""Training from the model: a group of SAEs and transcoders fed by one forward pass over a dataset.

One request names a model, a dataset and the members: hook points (an SAE each), transcoders
(an input and an output hook each), times hyper-parameter variants (each variant a member per
hook and per transcoder). Every front door (API, page, ``manage.py train_sae_group``) calls
:func:`sae_group_train_request`; the group is one job (``saes.tasks.run_sae_group_training``),
and each member a :class:`~saes.models.SparseAutoencoder` row with its own curves and evaluation.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import transaction
from rest_framework.exceptions import ValidationError

from activations.models import Dataset
from activations.selectors import hook_points
from activations.services import hook_names_for
from activations.services.extractions import default_max_length, storage_dtype_for
from engine import budgets
from engine.sae_architectures import (
    DEFAULT_ARCHITECTURE,
    DEFAULT_LIVE_EXPANSION,
    default_live_k,
    default_live_tokens,
)
from mistudio import jobs
from mistudio.access import check_may_change
from mistudio.budgets import memory_budget_check
from mistudio.errors import ApplicationError
from mistudio.text import check_label_text
from models_app.models import LanguageModel
from models_app.services import model_heads, model_job_queue, model_worker_name
from saes.cache_data import SHUFFLE_BUFFER_BATCHES, evaluation_rows
from saes.models import SaeGroup, SparseAutoencoder
from saes.serializers import VariantSerializer
from saes.services import check_sae_size, training_hyperparameters

MAX_GROUP_MEMBERS = 32
# The held-out samples (the dataset's last ones, never trained on): 5 %, from 1 to 256.
HOLDOUT_FRACTION, MAX_HOLDOUT_SAMPLES = 0.05, 256
DEFAULT_GROUP_MAX_LENGTH = 128  # tokens a sample (SAELens' usual context_size)
FORWARD_TOKENS = 4096  # tokens a forward pass reads: samples per pass = this / max_length
WINDOW_SAMPLES = 1024  # samples read from the dataset file, tokenized and planned at a time
# What a variant may change; everything else is the request's.
VARIANT_FIELDS = (
    "architecture",
    "expansion_factor",
    "d_sae",
    "k",
    "l1_coefficient",
    "l0_coefficient",
    "lr",
    "matryoshka_widths",
    "dead_after_steps",
)


TRANSCODER_LINE = re.compile(r"^\s*(\S+)\s*(?:->|→)\s*(\S+)\s*(skip)?\s*$")


def parse_transcoders(text: str) -> list[dict[str, Any]]:
    """``in -> out`` (``skip`` after it for a skip transcoder), one a line."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = TRANSCODER_LINE.match(line)
        if match is None:
            raise ValidationError(
                {"transcoders": [f"Line {number}: write it as 'input hook -> output hook [skip]'."]}
            )
        found.append({"hook_in": match[1], "hook_out": match[2], "skip": bool(match[3])})
    return found


def parse_variants(text: str) -> list[dict[str, Any]]:
    """One variant a line, as ``name=value`` pairs (``k=32 expansion_factor=8``)."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        variant: dict[str, Any] = {}
        for pair in line.replace(",", " ").split():
            name, _, value = pair.partition("=")
            if not value:
                raise ValidationError({"variants": [f"Line {number}: write each setting as name=value."]})
            variant[name] = value.split("/") if name == "matryoshka_widths" else value
        checked = VariantSerializer(data=variant)
        if not checked.is_valid():
            raise ValidationError({"variants": [f"Line {number}: {checked.errors}"]})
        found.append(dict(checked.validated_data))
    return found


def holdout_samples(sample_count: int) -> int:
    return min(MAX_HOLDOUT_SAMPLES, max(1, round(sample_count * HOLDOUT_FRACTION)))


def group_settings(model: LanguageModel, dataset: Dataset, *, max_length: int | None) -> dict[str, Any]:
    """How the model reads the dataset: tokens per sample, samples per forward pass, held-out split."""
    if dataset.sample_count < 2:
        raise ApplicationError(
            "DATASET_TOO_SMALL", "Training from the model needs at least 2 samples: some are held out."
        )
    max_length = default_max_length(model, max_length or DEFAULT_GROUP_MAX_LENGTH)
    held_out = holdout_samples(dataset.sample_count)
    return {
        "max_length": max_length,
        "forward_batch_size": max(1, FORWARD_TOKENS // max_length),
        "window_samples": WINDOW_SAMPLES,
        "train_samples": dataset.sample_count - held_out,
        "holdout_samples": held_out,
        "dtype": storage_dtype_for(model),
    }


def group_members(
    *, hooks: list[str], transcoders: list[dict[str, Any]], variants: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every (site, variant) pair: ``{"hook", "hook_out", "skip", **variant}``."""
    sites = [{"hook": hook, "hook_out": None, "skip": False} for hook in hooks]
    sites += [
        {"hook": tc["hook_in"], "hook_out": tc["hook_out"], "skip": bool(tc.get("skip", False))}
        for tc in transcoders
    ]
    if not sites:
        raise ApplicationError("HOOK_REQUIRED", "Name at least one hook or transcoder to train.")
    for variant in variants:
        unknown = sorted(set(variant) - set(VARIANT_FIELDS))
        if unknown:
            raise ApplicationError(
                "INVALID_PARAMETER",
                f"A variant may set {', '.join(VARIANT_FIELDS)}; not {', '.join(unknown)}.",
                details={"invalid": unknown},
            )
    members = [{**site, **variant} for site in sites for variant in (variants or [{}])]
    if len(members) > MAX_GROUP_MEMBERS:
        raise ApplicationError(
            "GROUP_TOO_LARGE",
            f"{len(members)} members (sites x variants); a group trains at most {MAX_GROUP_MEMBERS}.",
            details={"members": len(members), "limit": MAX_GROUP_MEMBERS},
        )
    return members


def group_memory(
    model: LanguageModel, configs: list[tuple[dict[str, Any], int, int]], *, settings: dict
) -> budgets.MemoryEstimate:
    """The group's estimated peak: each member's training (``engine.budgets.sae_training``, less
    its own read-ahead), one shuffle buffer of every hook's rows side by side, one forward pass."""
    parts: dict[str, int] = {}
    batch_size = configs[0][0]["batch_size"]
    for config, d_in, d_out in configs:
        estimate = budgets.sae_training(
            architecture=config["architecture"],
            d_in=max(d_in, d_out),
            d_sae=config["d_sae"],
            batch_size=batch_size,
            buffered_rows=0,
            sample_rows=0,
            evaluation_rows=evaluation_rows(config["d_sae"]),
        )
        for name, size in estimate.parts.items():
            if name != "runtime":
                parts[f"SAEs: {name}"] = parts.get(f"SAEs: {name}", 0) + size
    widths = sum(d_in + (d_out if d_out != d_in else 0) for _, d_in, d_out in configs)
    tokens = settings["forward_batch_size"] * settings["max_length"]
    parts["the shuffle buffer"] = SHUFFLE_BUFFER_BATCHES * batch_size * widths * budgets.FLOAT
    parts["one forward pass"] = budgets.forward_pass(
        tokens=tokens,
        hidden=model.hidden_size or 0,
        layers=model.num_layers or 0,
        heads=model_heads(model),
        longest=settings["max_length"],
    )
    parts["runtime"] = budgets.RUNTIME_BYTES
    return budgets.MemoryEstimate(parts)


def sae_group_train_request(
    *,
    owner,
    model: LanguageModel,
    dataset: Dataset,
    hooks: list[str] | None = None,
    transcoders: list[dict[str, Any]] | None = None,
    variants: list[dict[str, Any]] | None = None,
    architecture: str = DEFAULT_ARCHITECTURE,
    expansion_factor: int | None = None,
    d_sae: int | None = None,
    k: int | None = None,
    l1_coefficient: float | None = None,
    l0_coefficient: float | None = None,
    lr: float = 3e-4,
    batch_size: int = 4096,
    total_tokens: int | None = None,
    b_dec_init: str = "geometric_median",
    dead_after_steps: int | None = None,
    matryoshka_widths: list[int] | None = None,
    max_length: int | None = None,
    name: str = "",
    shared: bool = False,
) -> SaeGroup:
    """Queue a group: ``model`` (any the caller may see; loaded by the worker that takes the job if
    no worker has it) run over ``dataset`` (the caller's or shared), training an SAE at each of
    ``hooks`` and a transcoder for each of ``transcoders`` (``{"hook_in", "hook_out", "skip"}``),
    each once per entry of ``variants`` (dicts of :data:`VARIANT_FIELDS`; none: one variant).

    Defaults are a researcher's at research scale: TopK, 16x, k = d_in / 12 (64 for GPT-2 small),
    4,096-token batches and 4,000 training tokens per feature of the widest member
    (``engine.sae.default_live_tokens``)."""
    check_label_text(name, field="name")
    members = group_members(hooks=hooks or [], transcoders=transcoders or [], variants=variants or [])
    names = {member["hook"] for member in members} | {m["hook_out"] for m in members if m["hook_out"]}
    hook_names_for(model, hooks=sorted(names), layers=None)
    widths = {point["name"]: point["shape"][-1] for point in hook_points(model)["hook_points"]}
    settings = group_settings(model, dataset, max_length=max_length)
    common = {
        "architecture": architecture, "expansion_factor": expansion_factor, "d_sae": d_sae, "k": k,
        "l1_coefficient": l1_coefficient, "l0_coefficient": l0_coefficient, "lr": lr,
        "matryoshka_widths": matryoshka_widths, "dead_after_steps": dead_after_steps,
    }  # fmt: skip
    sized = []
    for member in members:
        d_in = int(widths[member["hook"]])
        d_out = int(widths[member["hook_out"]]) if member["hook_out"] else d_in
        chosen = {**common, **{key: member[key] for key in VARIANT_FIELDS if key in member}}
        if chosen["d_sae"] is None and chosen["expansion_factor"] is None:
            chosen["expansion_factor"] = DEFAULT_LIVE_EXPANSION
        sized.append((member, chosen, d_in, d_out))
    widest = max(chosen["d_sae"] or chosen["expansion_factor"] * d_in for _, chosen, d_in, _ in sized)
    total_tokens = total_tokens or default_live_tokens(widest)
    configs = []
    for member, chosen, d_in, d_out in sized:
        config = training_hyperparameters(
            architecture=chosen["architecture"],
            d_in=d_in,
            d_sae=chosen["d_sae"],
            expansion_factor=chosen["expansion_factor"],
            k=chosen["k"],
            l1_coefficient=chosen["l1_coefficient"],
            l0_coefficient=chosen["l0_coefficient"],
            lr=chosen["lr"],
            batch_size=batch_size,
            total_tokens=total_tokens,
            b_dec_init=b_dec_init,
            dead_after_steps=chosen["dead_after_steps"],
            matryoshka_widths=chosen["matryoshka_widths"],
            skip=member["skip"],
            default_k_for=default_live_k,
        )
        if member["skip"] and not member["hook_out"]:
            raise ApplicationError("INVALID_PARAMETER", "skip applies to transcoders.")
        check_sae_size(max(d_in, d_out), config["d_sae"])
        configs.append((config, d_in, d_out))
    with transaction.atomic():
        jobs.job_admit(owner=owner, tokens=total_tokens)
        estimate = memory_budget_check(
            group_memory(model, configs, settings=settings),
            what="this group's training",
            worker_name=model_worker_name(model),
        )
        user = owner if getattr(owner, "is_authenticated", False) else None
        group = SaeGroup.objects.create(
            name=name,
            model=model,
            dataset=dataset,
            settings=settings,
            total_tokens=total_tokens,
            total_steps=-(-total_tokens // batch_size),
            memory_estimate_bytes=estimate,
            owner=user,
            shared=shared,
        )
        group.name = group.name or f"{len(members)} on {model.name} ({group.id})"
        for index, ((member, _chosen, d_in, d_out), (config, _, _)) in enumerate(
            zip(sized, configs, strict=True)
        ):
            sae = SparseAutoencoder.objects.create(
                group=group,
                group_index=index,
                model=model,
                model_name=model.display_identifier,
                dataset=dataset,
                hook_name=member["hook"],
                hook_name_out=member["hook_out"] or "",
                architecture=config["architecture"],
                d_in=d_in,
                d_sae=config["d_sae"],
                d_out=d_out if member["hook_out"] else None,
                k=config.get("k"),
                hyperparameters=config,
                total_tokens=total_tokens,
                total_steps=-(-total_tokens // batch_size),
                owner=user,
                shared=shared,
            )
            label = f"{member['hook']} → {member['hook_out']}" if member["hook_out"] else member["hook"]
            sae.name = f"{config['architecture']} {label} ({sae.id})"
            sae.save(update_fields=["name"])
        jobs.job_submit(group, queue=model_job_queue(model.id), fields=["name"])
    return group


def sae_group_cancel(*, group: SaeGroup, actor) -> SaeGroup:
    """A queued group is cancelled at once; a running one stops after its current step (its
    members stop with it)."""
    return jobs.job_cancel(group, actor=actor)


def sae_group_update(*, group: SaeGroup, actor, **changes: Any) -> SaeGroup:
    """Rename or share / unshare the group (its members' sharing follows)."""
    jobs.job_update(group, actor=actor, changes=changes)
    if "shared" in changes:
        for member in group.members.all():
            member.shared = group.shared
            jobs.job_publish(member, "updated", ["shared"])
    return group


def sae_group_delete(*, group: SaeGroup, actor) -> None:
    """Delete an ended group's row (its owner, an admin or the operator: 403 ``NOT_OWNER``); its
    checkpoints follow on commit. A queued or running group must be cancelled first (409
    ``SAE_GROUP_BUSY``), as every job row. Its member SAEs stay, each an SAE of its own (their
    rule: ``group`` is set to null), deleted one by one like any SAE."""
    check_may_change(group, actor, what="SAE group")
    if group.status in SaeGroup.ACTIVE:
        raise ApplicationError("SAE_GROUP_BUSY", "The SAE group is training; cancel it first.", status=409)
    group.delete()
