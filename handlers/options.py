"""Readers of handler options (``--handler-options key=value``): each fails setup with the value it got."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from kinference.errors import HandlerLoadError


def positive_int(handler: str, key: str, value: Any) -> int:
    # bool is an int subclass: top_k=true must not read as 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HandlerLoadError(f"{handler}: handler option {key} must be an integer >= 1, not {value!r}")
    return value


def boolean(handler: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise HandlerLoadError(f"{handler}: handler option {key} must be true or false, not {value!r}")
    return value


def one_of(handler: str, key: str, value: Any, allowed: Collection[str]) -> str:
    if not isinstance(value, str) or value not in allowed:  # a list from YAML is not hashable
        raise HandlerLoadError(f"{handler}: handler option {key} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def with_defaults(handler: str, defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` over ``defaults``; a key ``defaults`` lacks is a typo and fails setup, listing the known ones."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise HandlerLoadError(
            f"{handler}: unknown handler option(s) {', '.join(unknown)}; known: {', '.join(defaults)}"
        )
    return {**defaults, **given}
