"""Training from the model: a group of SAEs and transcoders fed by one forward pass over a dataset.

One request names a model, a dataset and the members: hook points (an SAE each), transcoders
(an input and an output hook each), times hyper-parameter variants (each variant a member per
hook and per transcoder). Every front door (API, page, ``manage.py train_sae_group``) calls
:func:`sae_group_train_request`; the group is one job (``saes.tasks.run_sae_group_training``),
and each member a :class:`~saes.models.SparseAutoencoder` row with its own curves and evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from django.db import transaction

from activations.models import Dataset
from activations.selectors import hook_points
from activations.services import hook_names_for
from activations.services.extractions import default_max_length, storage_dtype_for
from engine import budgets
from engine.hooks import every_transcoder_hook, transcoder_hooks
from engine.sae_architectures import (
    DEFAULT_ARCHITECTURE,
    DEFAULT_LIVE_EXPANSION,
    LIVE_TOKENS_BOUNDS,
    architecture_named,
    default_live_k,
    default_live_tokens,
)
from mistudio import jobs
from mistudio.access import check_may_change
from mistudio.budgets import memory_budget_check
from mistudio.errors import ApplicationError
from mistudio.redis_client import get_redis
from mistudio.text import check_label_text
from mistudio.workers import read_heartbeats
from models_app.models import LanguageModel
from models_app.services import model_heads, model_job_queue, model_worker_name
from saes.cache_data import SHUFFLE_BUFFER_BATCHES, evaluation_rows
from saes.models import SaeGroup, SparseAutoencoder
from saes.services import check_sae_size, training_hyperparameters

MAX_GROUP_MEMBERS = 32
# The held-out samples (the dataset's last ones, never trained on): 5 %, from 1 to 256.
HOLDOUT_FRACTION, MAX_HOLDOUT_SAMPLES = 0.05, 256
DEFAULT_GROUP_MAX_LENGTH = 128  # tokens a sample (SAELens' usual context_size)
FORWARD_TOKENS = 4096  # tokens a forward pass reads: samples per pass = this / max_length
WINDOW_SAMPLES = 1024  # samples read from the dataset file, tokenized and planned at a time
# A group on a CPU trains about this long unless asked (the research-scale default, 4,000 tokens a
# feature, is hours there), at the rate of the model's last group or, before one, this one: a
# researcher's demo group on a 2-core CPU ran about 1,000 tokens/s.
CPU_DEFAULT_SECONDS = 600
CPU_TOKENS_PER_SECOND = 1_000
# A group analyses its members when it ends unless told otherwise while its members hold at most
# this many features in all: each analysis is about three forward passes over its reading.
ANALYZE_MEMBERS_MAX_FEATURES = 65_536


def default_analyze_members(total_features: int) -> bool:
    """Whether a group of ``total_features`` features (the sum over its members) analyses its
    members when it ends, unless the request says: yes for small groups."""
    return total_features <= ANALYZE_MEMBERS_MAX_FEATURES


@dataclass(frozen=True)
class Variant:
    """What one variant of a group changes from the request's :class:`GroupSettings` (None: the
    request's value). Each variant is trained once at every site."""

    architecture: str | None = None
    expansion_factor: int | None = None
    d_sae: int | None = None
    k: int | None = None
    l1_coefficient: float | None = None
    l0_coefficient: float | None = None
    lr: float | None = None
    matryoshka_widths: tuple[int, ...] | None = None
    dead_after_steps: int | None = None


# What a variant may change; everything else is the request's.
VARIANT_FIELDS = tuple(field.name for field in fields(Variant))


@dataclass(frozen=True)
class GroupSettings:
    """A group request's training settings, every member's unless its variant changes them.
    None: chosen for the model and the run (:func:`member_settings`, :func:`group_total_tokens`,
    :func:`group_reading`)."""

    architecture: str = DEFAULT_ARCHITECTURE
    expansion_factor: int | None = None
    d_sae: int | None = None
    k: int | None = None
    l1_coefficient: float | None = None
    l0_coefficient: float | None = None
    lr: float = 3e-4
    matryoshka_widths: tuple[int, ...] | None = None
    dead_after_steps: int | None = None
    batch_size: int = 4096
    total_tokens: int | None = None
    b_dec_init: str = "geometric_median"
    max_length: int | None = None

    def with_variant(self, variant: Variant) -> GroupSettings:
        """These settings with what ``variant`` sets in their place."""
        changed = {name: getattr(variant, name) for name in VARIANT_FIELDS}
        return replace(self, **{name: value for name, value in changed.items() if value is not None})


@dataclass(frozen=True)
class GroupMember:
    """One member of a group request: an SAE at ``hook``, or a transcoder from ``hook`` to
    ``hook_out`` (``skip``: with a linear skip path), trained with its ``variant`` of the settings;
    with ``clt_layers``, a cross-layer transcoder over that many layers (``hook`` layer 0's MLP
    input, ``hook_out`` the last one's MLP output: :func:`clt_member`)."""

    hook: str
    hook_out: str | None = None
    skip: bool = False
    variant: Variant = Variant()
    clt_layers: int | None = None

    @property
    def label(self) -> str:
        if self.clt_layers:
            return f"cross-layer transcoder over {self.clt_layers} layers"
        return f"{self.hook} → {self.hook_out}" if self.hook_out else self.hook

    @property
    def hooks(self) -> list[str]:
        if self.clt_layers:
            return every_transcoder_hook(self.clt_layers)
        return [self.hook, *([self.hook_out] if self.hook_out else [])]


def clt_member(n_layers: int) -> GroupMember:
    """A cross-layer transcoder over every one of ``n_layers`` layers."""
    return GroupMember(
        hook=transcoder_hooks(0)[0], hook_out=transcoder_hooks(n_layers - 1)[1], clt_layers=n_layers
    )


@dataclass(frozen=True)
class GroupReading:
    """How the worker reads the dataset through the model (the group row's ``settings``): tokens
    per sample, samples per forward pass and per window read, the training and held-out split,
    and the dtype the activations are kept in."""

    max_length: int
    forward_batch_size: int
    window_samples: int
    train_samples: int
    holdout_samples: int
    dtype: str


@dataclass(frozen=True)
class MemberPlan:
    """A member sized to the model: its hooks' widths and its training configuration (the
    ``hyperparameters`` of its row)."""

    member: GroupMember
    d_in: int
    d_out: int
    config: dict[str, Any]


def group_members(*, sites: Sequence[GroupMember], variants: Sequence[Variant]) -> tuple[GroupMember, ...]:
    """Every site (a hook's SAE or a transcoder) once per variant, sites first (none: one variant)."""
    return tuple(replace(site, variant=variant) for site in sites for variant in (variants or [Variant()]))


def holdout_samples(sample_count: int) -> int:
    return min(MAX_HOLDOUT_SAMPLES, max(1, round(sample_count * HOLDOUT_FRACTION)))


def group_reading(model: LanguageModel, dataset: Dataset, *, max_length: int | None) -> GroupReading:
    """How the model reads the dataset: tokens per sample, samples per forward pass, held-out split."""
    if dataset.sample_count < 2:
        raise ApplicationError(
            "DATASET_TOO_SMALL", "Training from the model needs at least 2 samples: some are held out."
        )
    max_length = default_max_length(model, max_length or DEFAULT_GROUP_MAX_LENGTH)
    held_out = holdout_samples(dataset.sample_count)
    return GroupReading(
        max_length=max_length,
        forward_batch_size=max(1, FORWARD_TOKENS // max_length),
        window_samples=WINDOW_SAMPLES,
        train_samples=dataset.sample_count - held_out,
        holdout_samples=held_out,
        dtype=storage_dtype_for(model),
    )


def check_group_members(members: Sequence[GroupMember]) -> None:
    """At least one member and at most :data:`MAX_GROUP_MEMBERS`."""
    if not members:
        raise ApplicationError("HOOK_REQUIRED", "Name at least one hook or transcoder to train.")
    if len(members) > MAX_GROUP_MEMBERS:
        raise ApplicationError(
            "GROUP_TOO_LARGE",
            f"{len(members)} members (sites x variants); a group trains at most {MAX_GROUP_MEMBERS}.",
            details={"members": len(members), "limit": MAX_GROUP_MEMBERS},
        )


def member_settings(settings: GroupSettings, member: GroupMember) -> GroupSettings:
    """The member's settings: the request's with its variant's, 16x wide unless a width is given."""
    chosen = settings.with_variant(member.variant)
    if chosen.d_sae is None and chosen.expansion_factor is None:
        chosen = replace(chosen, expansion_factor=DEFAULT_LIVE_EXPANSION)
    return chosen


def group_total_tokens(
    settings: GroupSettings, members: Sequence[GroupMember], widths: dict[str, int], *, model: LanguageModel
) -> int:
    """The request's tokens, else 4,000 a feature of the widest member (``default_live_tokens``),
    within what the worker's device trains in minutes (:func:`device_tokens`)."""
    if settings.total_tokens:
        return settings.total_tokens
    chosen = [(member_settings(settings, member), int(widths[member.hook])) for member in members]
    widest = max(each.d_sae or each.expansion_factor * d_in for each, d_in in chosen)
    return default_group_tokens(widest, device_tokens(model))


def default_group_tokens(widest_d_sae: int, sized: dict[str, Any]) -> int:
    """A group's tokens unless asked: 4,000 a feature of its widest member, within what the device
    of :func:`device_tokens` (``sized``) trains in minutes. The form's suggestion is this too."""
    return min(default_live_tokens(widest_d_sae), sized["tokens"])


def group_device(model: LanguageModel) -> str:
    """The device a group on ``model`` would train on: its host worker's when it is loaded, else
    a GPU if any live worker has one, else ``cpu``."""
    beats = read_heartbeats()
    host = model_worker_name(model)
    devices = [str(beat.get("device", "cpu")) for beat in beats if not host or beat["name"] == host]
    return next((device for device in devices if device != "cpu"), "cpu")


def device_tokens(model: LanguageModel) -> dict[str, Any]:
    """The default tokens of a group on ``model``, sized to the device it would train on: on a CPU
    at most :data:`CPU_DEFAULT_SECONDS` of training at the rate of the model's last group (assumed
    :data:`CPU_TOKENS_PER_SECOND` before one has run); on a GPU no cap. With the rate, its basis
    and the device: what the form shows before anything starts."""
    device = group_device(model)
    last = (
        SaeGroup.objects.filter(model=model, status=SaeGroup.Status.COMPLETED, tokens_per_second__gt=0)
        .order_by("-finished_at")
        .values_list("tokens_per_second", flat=True)
        .first()
    )
    rate = float(last) if last else (CPU_TOKENS_PER_SECOND if device == "cpu" else None)
    tokens = int(rate * CPU_DEFAULT_SECONDS) if device == "cpu" else LIVE_TOKENS_BOUNDS[1]
    return {"device": device, "tokens": tokens, "tokens_per_second": rate, "measured": bool(last)}


def member_plan(
    member: GroupMember, settings: GroupSettings, *, widths: dict[str, int], total_tokens: int
) -> MemberPlan:
    """The member's widths and training configuration, validated (``training_hyperparameters``)."""
    chosen = member_settings(settings, member)
    d_in = int(widths[member.hook])
    if member.clt_layers:
        return clt_member_plan(member, chosen, d_model=d_in, total_tokens=total_tokens)
    d_out = int(widths[member.hook_out]) if member.hook_out else d_in
    config = training_hyperparameters(
        architecture=chosen.architecture,
        d_in=d_in,
        d_sae=chosen.d_sae,
        expansion_factor=chosen.expansion_factor,
        k=chosen.k,
        l1_coefficient=chosen.l1_coefficient,
        l0_coefficient=chosen.l0_coefficient,
        lr=chosen.lr,
        batch_size=chosen.batch_size,
        total_tokens=total_tokens,
        b_dec_init=chosen.b_dec_init,
        dead_after_steps=chosen.dead_after_steps,
        matryoshka_widths=list(chosen.matryoshka_widths) if chosen.matryoshka_widths is not None else None,
        skip=member.skip,
        default_k_for=default_live_k,
    )
    if member.skip and not member.hook_out:
        raise ApplicationError("INVALID_PARAMETER", "skip applies to transcoders.")
    check_sae_size(max(d_in, d_out), config["d_sae"])
    return MemberPlan(member=member, d_in=d_in, d_out=d_out, config=config)


CLT_KIND = "clt"  # a CLT member's hyperparameters say so (saes.tasks.training_config)


def clt_member_plan(
    member: GroupMember, chosen: GroupSettings, *, d_model: int, total_tokens: int
) -> MemberPlan:
    """A cross-layer transcoder's plan: TopK with the settings' k (JumpReLU with the tanh penalty
    when the architecture asked learns a threshold, ``l0_coefficient`` its λ), ``d_sae`` features a
    layer. Its row's ``hyperparameters`` are the CltTrainingConfig, with ``kind: clt``."""
    from engine.sae.clt_training import CltTrainingConfig

    d_sae = chosen.d_sae or chosen.expansion_factor * d_model
    jumprelu = architecture_named(chosen.architecture).learns_threshold  # JumpReLU: the tanh recipe
    config = CltTrainingConfig(
        d_sae=d_sae, sparsity="jumprelu" if jumprelu else "topk",
        k=None if jumprelu else (chosen.k or default_live_k(d_model)),
        sparsity_coefficient=chosen.l0_coefficient or CltTrainingConfig.sparsity_coefficient,
        lr=chosen.lr, batch_size=chosen.batch_size, steps=-(-total_tokens // chosen.batch_size),
    )  # fmt: skip
    check_sae_size(d_model, d_sae * member.clt_layers)
    hyperparameters = {**asdict(config), "kind": CLT_KIND}
    return MemberPlan(member=member, d_in=d_model, d_out=d_model, config=hyperparameters)


def group_memory(
    model: LanguageModel, plans: Sequence[MemberPlan], *, reading: GroupReading
) -> budgets.MemoryEstimate:
    """The group's estimated peak: each member's training (``engine.budgets.sae_training``, less
    its own read-ahead), one shuffle buffer of every hook's rows side by side, one forward pass."""
    parts: dict[str, int] = {}
    batch_size = plans[0].config["batch_size"]
    for plan in plans:
        layers = plan.member.clt_layers or 1  # a CLT: as wide as its layers' features, twice
        estimate = budgets.sae_training(
            architecture=plan.config.get("architecture", "topk"),
            d_in=max(plan.d_in, plan.d_out) * layers,
            d_sae=plan.config["d_sae"] * layers,
            batch_size=batch_size,
            buffered_rows=0,
            sample_rows=0,
            evaluation_rows=evaluation_rows(plan.config["d_sae"]),
        )
        for name, size in estimate.parts.items():
            if name != "runtime":
                parts[f"SAEs: {name}"] = parts.get(f"SAEs: {name}", 0) + size
    widths = sum(
        plan.d_in * 2 * plan.member.clt_layers if plan.member.clt_layers
        else plan.d_in + (plan.d_out if plan.d_out != plan.d_in else 0)
        for plan in plans
    )  # fmt: skip
    tokens = reading.forward_batch_size * reading.max_length
    parts["the shuffle buffer"] = SHUFFLE_BUFFER_BATCHES * batch_size * widths * budgets.FLOAT
    parts["one forward pass"] = budgets.forward_pass(
        tokens=tokens,
        hidden=model.hidden_size or 0,
        layers=model.num_layers or 0,
        heads=model_heads(model),
        longest=reading.max_length,
    )
    parts["runtime"] = budgets.RUNTIME_BYTES
    return budgets.MemoryEstimate(parts)


def sae_group_train_request(
    *,
    owner,
    model: LanguageModel,
    dataset: Dataset,
    settings: GroupSettings,
    members: Sequence[GroupMember],
    name: str = "",
    shared: bool = False,
    analyze_members: bool | None = None,
) -> SaeGroup:
    """Queue a group: ``model`` (any the caller may see; loaded by the worker that takes the job if
    no worker has it) run over ``dataset`` (the caller's or shared), training each of ``members``
    (an SAE at a hook or a transcoder, each with its variant of ``settings``; build them with
    :func:`group_members`: every site once per variant).

    Defaults are a researcher's at research scale: TopK, 16x, k = d_in / 12 (64 for GPT-2 small),
    4,096-token batches and 4,000 training tokens per feature of the widest member
    (``engine.sae_architectures.default_live_tokens``). ``analyze_members``: analyse each member
    over the dataset through the model when the group completes (default:
    :func:`default_analyze_members` of the members' features)."""
    check_label_text(name, field="name")
    check_group_members(members)
    names = {name for member in members for name in member.hooks}
    hook_names_for(model, hooks=sorted(names), layers=None)
    widths = {point["name"]: point["shape"][-1] for point in hook_points(model)["hook_points"]}
    reading = group_reading(model, dataset, max_length=settings.max_length)
    total_tokens = group_total_tokens(settings, members, widths, model=model)
    plans = [member_plan(member, settings, widths=widths, total_tokens=total_tokens) for member in members]
    if analyze_members is None:
        analyze_members = default_analyze_members(sum(plan.config["d_sae"] for plan in plans))
    with transaction.atomic():
        jobs.job_admit(owner=owner, tokens=total_tokens)
        estimate = memory_budget_check(
            group_memory(model, plans, reading=reading),
            what="this group's training",
            worker_name=model_worker_name(model),
        )
        user = owner if getattr(owner, "is_authenticated", False) else None
        total_steps = -(-total_tokens // settings.batch_size)
        group = SaeGroup.objects.create(
            name=name,
            model=model,
            dataset=dataset,
            settings=asdict(reading),
            total_tokens=total_tokens,
            total_steps=total_steps,
            memory_estimate_bytes=estimate,
            owner=user,
            shared=shared,
            analyze_members=analyze_members,
        )
        group.name = group.name or f"{len(members)} on {model.name} ({group.id})"
        for index, plan in enumerate(plans):
            member_row_create(group, index, plan, total_steps=total_steps)
        jobs.job_submit(group, queue=model_job_queue(model.id), fields=["name"])
    return group


def member_row_create(
    group: SaeGroup, index: int, plan: MemberPlan, *, total_steps: int
) -> SparseAutoencoder:
    """The member's SAE row, queued with its group (its owner, sharing and tokens the group's)."""
    sae = SparseAutoencoder.objects.create(
        group=group,
        group_index=index,
        model=group.model,
        model_name=group.model.display_identifier,
        dataset=group.dataset,
        hook_name=plan.member.hook,
        hook_name_out=plan.member.hook_out or "",
        # A CLT is saved as the JumpReLU it is at inference.
        architecture="jumprelu" if plan.member.clt_layers else plan.config["architecture"],
        d_in=plan.d_in,
        d_sae=plan.config["d_sae"],
        d_out=plan.d_out if plan.member.hook_out else None,
        k=plan.config.get("k"),
        n_layers=plan.member.clt_layers,
        hyperparameters=plan.config,
        total_tokens=group.total_tokens,
        total_steps=total_steps,
        owner=group.owner,
        shared=group.shared,
    )
    sae.name = f"{sae.architecture} {plan.member.label} ({sae.id})"
    sae.save(update_fields=["name"])
    return sae


def sae_group_cancel(*, group: SaeGroup, actor) -> SaeGroup:
    """A queued group is cancelled at once; a running one stops after its current step (its
    members stop with it)."""
    return jobs.job_cancel(group, actor=actor)


def sae_group_stop(*, group: SaeGroup, actor) -> SaeGroup:
    """Stop a group early and keep it: a running group stops training at its next step, and each
    member is evaluated and saved from what it has learnt (the group ends ``completed``, its
    ``tokens_seen`` short of ``total_tokens``); a queued one has learnt nothing and is cancelled."""
    check_may_change(group, actor, what="SAE group")
    if group.status == SaeGroup.Status.QUEUED:
        return sae_group_cancel(group=group, actor=actor)
    if group.status != SaeGroup.Status.RUNNING:
        raise ApplicationError("JOB_NOT_ACTIVE", f"The group is {group.status}: nothing to stop.", status=409)
    get_redis().set(group.stop_key, 1, ex=7 * 24 * 3600)
    return group


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
