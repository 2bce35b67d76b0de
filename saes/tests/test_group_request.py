"""A group request as typed settings and members: what the API, the page and the command hand
the service (every site once per variant, a variant's values over the request's)."""

import pytest

from engine.configs import UnknownConfigKeys
from engine.sae_architectures import DEFAULT_LIVE_EXPANSION
from saes.groups import GroupMember, GroupSettings, Variant, group_members, member_settings
from saes.serializers import group_request, parse_variants

RESID, MLP_IN, MLP_OUT = "blocks.0.hook_resid_post", "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out"


def test_every_site_once_per_variant_sites_first():
    settings, members = group_request(
        {
            "hooks": [RESID],
            "transcoders": [{"hook_in": MLP_IN, "hook_out": MLP_OUT, "skip": True}],
            "variants": [{"k": 4}, {"architecture": "batchtopk", "k": 8, "matryoshka_widths": [2, 4]}],
            "expansion_factor": 2,
            "batch_size": 128,
            "lr": 3e-3,
        }
    )
    assert settings == GroupSettings(expansion_factor=2, batch_size=128, lr=3e-3)
    second = Variant(architecture="batchtopk", k=8, matryoshka_widths=(2, 4))
    assert members == (
        GroupMember(RESID, variant=Variant(k=4)),
        GroupMember(RESID, variant=second),
        GroupMember(MLP_IN, MLP_OUT, skip=True, variant=Variant(k=4)),
        GroupMember(MLP_IN, MLP_OUT, skip=True, variant=second),
    )
    assert len(set(members)) == 4  # frozen, hence hashable
    assert members[3].label == f"{MLP_IN} → {MLP_OUT}"


def test_no_variant_is_one_variant_and_no_site_is_no_member():
    assert group_members(sites=[GroupMember(RESID)], variants=[]) == (GroupMember(RESID),)
    assert group_members(sites=[], variants=[Variant(k=4)]) == ()


def test_a_variant_changes_only_what_it_sets_and_the_width_defaults_to_the_live_expansion():
    settings = GroupSettings(k=16, lr=1e-3, batch_size=64)
    chosen = member_settings(settings, GroupMember(RESID, variant=Variant(k=4)))
    assert chosen == GroupSettings(k=4, lr=1e-3, batch_size=64, expansion_factor=DEFAULT_LIVE_EXPANSION)
    sized = member_settings(settings, GroupMember(RESID, variant=Variant(d_sae=96)))
    assert sized.d_sae == 96 and sized.expansion_factor is None and sized.k == 16


def test_the_text_form_of_variants_reaches_the_same_types():
    _, members = group_request({"hooks": [RESID], "variants": parse_variants("k=4 lr=0.01\nk=8")})
    assert [member.variant for member in members] == [Variant(k=4, lr=0.01), Variant(k=8)]


def test_a_setting_the_request_type_lacks_is_refused():
    with pytest.raises(UnknownConfigKeys, match="momentum"):
        group_request({"hooks": [RESID], "momentum": 0.9})


@pytest.mark.django_db(transaction=True)
def test_the_page_queues_the_same_members_as_the_api(tiny_model, writer, client_for):
    from django.test import Client

    from activations.models import Dataset
    from activations.services import dataset_create_from_texts
    from saes.models import SaeGroup

    texts = [f"sample number {index} says something about cats and dogs" for index in range(40)]
    dataset = dataset_create_from_texts(name="page", texts=texts, owner=writer, source=Dataset.Source.UPLOAD)
    form = {
        "model_id": tiny_model.id, "dataset_id": dataset.id, "hooks": RESID, "expansion_factor": "2",
        "transcoders": f"{MLP_IN} -> {MLP_OUT} skip", "variants": "k=4\narchitecture=batchtopk k=8",
        "batch_size": "64", "total_tokens": "640", "name": "from the page", "shared": "on",
    }  # fmt: skip
    browser = Client()
    browser.force_login(writer)
    response = browser.post("/saes/groups/new/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    group = SaeGroup.objects.get()
    assert group.name == "from the page" and group.shared and group.total_tokens == 640
    assert set(group.settings) == {
        "max_length", "forward_batch_size", "window_samples", "train_samples", "holdout_samples", "dtype"
    }  # fmt: skip
    members = [
        (sae.hook_name, sae.hook_name_out, sae.architecture, sae.k, sae.hyperparameters.get("skip", False))
        for sae in group.members.order_by("group_index")
    ]
    assert members == [
        (RESID, "", "topk", 4, False), (RESID, "", "batchtopk", 8, False),
        (MLP_IN, MLP_OUT, "topk", 4, True), (MLP_IN, MLP_OUT, "batchtopk", 8, True),
    ]  # fmt: skip
    refused = browser.post("/saes/groups/new/", {**form, "hooks": "", "transcoders": ""})
    assert refused.status_code == 400 and "Name at least one hook" in refused.content.decode()


@pytest.mark.django_db
def test_a_group_on_a_cpu_trains_minutes_by_default_at_the_rate_its_model_last_ran(tiny_model, writer):
    """Before: the research-scale default (4,000 tokens a feature; 8.2M on the demo model) was
    hours at a CPU's ~1,000 tokens/s."""
    from activations.services import dataset_create_from_texts
    from saes.groups import CPU_DEFAULT_SECONDS, CPU_TOKENS_PER_SECOND, device_tokens, sae_group_train_request
    from saes.models import SaeGroup

    dataset = dataset_create_from_texts(name="d", texts=["a b c d"] * 8, owner=writer, source="upload")
    sized = device_tokens(tiny_model)  # no worker with a GPU: a CPU's
    assert sized == {
        "device": "cpu", "tokens": CPU_TOKENS_PER_SECOND * CPU_DEFAULT_SECONDS,
        "tokens_per_second": CPU_TOKENS_PER_SECOND, "measured": False,
    }  # fmt: skip
    settings = GroupSettings(expansion_factor=16)  # 1,024 features: 4.1M tokens at research scale
    group = sae_group_train_request(
        owner=writer, model=tiny_model, dataset=dataset, settings=settings, members=[GroupMember(RESID)]
    )
    assert group.total_tokens == CPU_TOKENS_PER_SECOND * CPU_DEFAULT_SECONDS < 4_096_000
    # Once a group has run on the model, its measured rate sizes the next.
    SaeGroup.objects.filter(pk=group.pk).update(status="completed", tokens_per_second=50.0)
    assert device_tokens(tiny_model)["tokens"] == 50 * CPU_DEFAULT_SECONDS
    assert device_tokens(tiny_model)["measured"] is True
