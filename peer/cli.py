"""Command lines derived from the config dataclasses, so a flag, its default and its help cannot drift.

Each dataclass field becomes ``--field-name``; its ``metadata["help"]`` is the help text and its
default the flag's default. Supported field types: str, int, float, bool (``--flag``/``--no-flag``),
``str | None``, ``tuple[str, ...]`` (repeatable, or several values after one flag).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")
_SCALARS = {"str": str, "int": int, "float": float, "str | None": str}


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of ``cls`` (a dataclass) to ``parser``."""
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
    for field in dataclasses.fields(cls):
        if field.name in skip or not field.init:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = _default_of(field)
        help_text = field.metadata.get("help", "")
        if field.type == "bool":
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif field.type == "tuple[str, ...]":
            group.add_argument(flag, dest=field.name, nargs="+", action="extend", default=None,
                               help=f"{help_text} (default: {list(default) or 'none'})")
        elif field.type in _SCALARS:
            group.add_argument(flag, dest=field.name, type=_SCALARS[field.type], default=default,
                               help=f"{help_text} (default: {default})")
        else:
            raise TypeError(f"no command-line form for {cls.__name__}.{field.name}: {field.type}")


def dataclass_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build ``cls`` from parsed flags; ``ValueError`` from its ``__post_init__`` propagates."""
    values = {}
    for field in dataclasses.fields(cls):
        if not field.init or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if field.type == "tuple[str, ...]":
            value = tuple(value) if value is not None else _default_of(field)
        values[field.name] = value
    values.update(overrides)
    return cls(**values)


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None
