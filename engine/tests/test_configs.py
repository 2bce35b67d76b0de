"""Stored configurations come back as their dataclasses, and a key nobody named is an error."""

import dataclasses

import pytest

from engine.attribution.tracing import AttributionConfig
from engine.configs import UnknownConfigKeys, config_from_dict


def test_a_stored_config_round_trips():
    config = AttributionConfig(max_n_logits=5, batch_size=16, matrix_limit_bytes=1 << 20)
    assert config_from_dict(AttributionConfig, dataclasses.asdict(config)) == config


def test_missing_keys_take_the_defaults():
    assert config_from_dict(AttributionConfig, {"batch_size": 8}) == AttributionConfig(batch_size=8)


def test_an_unknown_key_is_refused_by_name():
    with pytest.raises(UnknownConfigKeys, match="AttributionConfig has no batch_sise, colour") as refused:
        config_from_dict(AttributionConfig, {"batch_sise": 8, "colour": "red", "max_n_logits": 3})
    assert refused.value.unknown == ["batch_sise", "colour"]
    assert isinstance(refused.value, ValueError)


def test_retired_keys_are_dropped_and_only_they():
    stored = {"batch_size": 8, "old_setting": 1}
    loaded = config_from_dict(AttributionConfig, stored, retired=("old_setting",))
    assert loaded == AttributionConfig(batch_size=8)
    with pytest.raises(UnknownConfigKeys, match="other"):
        config_from_dict(AttributionConfig, {**stored, "other": 2}, retired=("old_setting",))
