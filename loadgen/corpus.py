"""Request payloads: the built-in generated text corpus (handlers/corpus.py), or the user's JSON-lines file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from kinference.handlers.corpus import BUILTIN_SIZE, PROFILES, builtin_corpus

__all__ = ["BUILTIN_SIZE", "PROFILES", "builtin_corpus", "read_jsonl"]


def read_jsonl(path: Path) -> list[Any]:
    """One request value per non-empty line, each a JSON document."""
    values = []
    with Path(path).open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                values.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON document: {exc}") from exc
    if not values:
        raise ValueError(f"{path} holds no payloads")
    return values
