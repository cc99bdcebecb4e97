"""Frozen dataclasses read back from JSON (plans, cluster specs): every malformed input is a
``ValueError`` that names what was wrong and, when read from a file, the file."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def fields_of(data: Any, cls: type, what: str, *, all_required: bool = False) -> dict[str, Any]:
    """``data`` as the keyword arguments of ``cls``.

    Raises:
      ValueError: if ``data`` is not a JSON object, misses a field without a default (any
        field, with ``all_required``) or has one ``cls`` does not.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__} {data!r:.60}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    required = {
        name
        for name, f in known.items()
        if all_required or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    }
    unknown, missing = sorted(set(data) - set(known)), sorted(required - set(data))
    if unknown or missing:
        found = [f"unknown fields {unknown}"] * bool(unknown) + [f"no {missing}"] * bool(missing)
        raise ValueError(f"{what} has {' and '.join(found)}; expected the fields {sorted(known)}")
    return dict(data)


def build(cls: type[T], what: str, **kwargs: Any) -> T:
    """``cls(**kwargs)``, with a field of the wrong type (which fails inside its checks as a
    ``TypeError``) reported as a ``ValueError``."""
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{what} has a field of the wrong type: {e}") from e


def load_json(path: str | os.PathLike[str], what: str, read: Callable[[Any], T]) -> T:
    """``read(data)`` of the JSON in ``path``; errors name the file.

    Raises:
      OSError: if the file cannot be read.
      ValueError: if it is not JSON, or ``read`` rejects it.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return read(json.loads(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)} is not a {what} JSON file: {e}") from e
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from e
