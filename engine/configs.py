"""Stored JSON configurations back into their dataclasses, refusing what the dataclass does not know.

A job row keeps its configuration as JSON (``asdict`` of a frozen dataclass, or a dict the service
built with the same names). Filtering a row's keys down to the dataclass's fields would silently
drop a misspelt or renamed setting, and a job would then run with a default nobody chose. So a key
the dataclass lacks is an error, unless the caller names it: keys that older versions wrote and
that no longer mean anything (``retired``), or keys stored beside the configuration for other
readers (the same list: the point is that each is written down once, on purpose).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

__all__ = ["UnknownConfigKeys", "config_from_dict"]

Config = TypeVar("Config")


class UnknownConfigKeys(ValueError):
    """A stored configuration holds keys its dataclass does not have and the caller did not retire."""

    def __init__(self, cls: type, unknown: list[str]) -> None:
        self.cls, self.unknown = cls, unknown
        known = ", ".join(field.name for field in dataclasses.fields(cls))
        super().__init__(f"{cls.__name__} has no {', '.join(unknown)} (it has {known})")


def config_from_dict(cls: type[Config], data: Mapping[str, Any], *, retired: Collection[str] = ()) -> Config:
    """``cls(**data)`` less the ``retired`` keys; :class:`UnknownConfigKeys` for any other key
    ``cls`` lacks. Missing keys take the dataclass's defaults, as for any constructor call."""
    names = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names - set(retired))
    if unknown:
        raise UnknownConfigKeys(cls, unknown)
    return cls(**{key: value for key, value in data.items() if key in names})
