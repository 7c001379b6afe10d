"""Command lines derived from the config dataclasses, so a flag, its default and its help cannot drift.

Each dataclass field becomes ``--field-name``; its ``metadata["help"]`` is the help text and its
default the flag's default. Supported field types: str, int, float, bool (``--flag``/``--no-flag``),
``str | None``, ``tuple[str, ...]`` (repeatable, or several values after one flag).

:func:`config_parser` and :func:`load_config` add the other two sources, a TOML file (``--config``)
and ``MURMURATION_<FIELD>`` environment variables (:mod:`peer.config_sources`), with the precedence
flags > environment > file > the dataclass defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from peer.config import BootstrapConfig, PeerConfig
from peer.config_sources import ENV_PREFIX, env_name, init_fields, read_config_file, read_env

T = TypeVar("T")
_SCALARS = {"str": str, "int": int, "float": float, "str | None": str}
_UNSET = object()  # marks a flag the command line did not give
SOURCES_HELP = (
    "Every option can also be set in a TOML file given with --config (key: the option's name with "
    "underscores, e.g. max_in_flight = 8) or in an environment variable " + ENV_PREFIX + "<NAME> "
    "(e.g. " + ENV_PREFIX + "MAX_IN_FLIGHT=8; lists separated by spaces). "
    "Flags override the environment, which overrides the file."
)


def config_parser(cls: type, *, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """A parser with one flag per field of ``cls``, plus ``--config``, and the sources in its epilog."""
    parser = argparse.ArgumentParser(description=cls.__doc__, epilog=SOURCES_HELP)
    parser.add_argument("--config", metavar="PATH.toml", default=None,
                        help="TOML file with option values (flags and environment variables override it)")
    add_dataclass_arguments(parser, cls, skip=skip)
    return parser


def load_config(
    parser: argparse.ArgumentParser, cls: type[T], argv: Sequence[str] | None = None, *,
    env: Mapping[str, str] | None = None,
) -> tuple[T, argparse.Namespace]:
    """Parse ``argv`` and build ``cls`` from flags > environment > ``--config`` file > defaults.

    Returns:
        the config and the parsed namespace (for flags that are not config fields, like ``--dry-run``).

    Raises:
        ValueError: a bad file, key, value or combination, in one sentence (``parser.error`` it).
    """
    names = [f.name for f in init_fields(cls)]
    # argparse keeps attributes already on the namespace, so a flag not given stays _UNSET
    # (repeatable flags default to None already)
    preset = argparse.Namespace(**{name: _UNSET for name in names if parser.get_default(name) is not None})
    args = parser.parse_args(argv, namespace=preset)
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(read_config_file(cls, args.config))
    # the other script's variables are not mistakes (the two scripts share the environment)
    known = [env_name(f.name) for other in (PeerConfig, BootstrapConfig) for f in init_fields(other)]
    values.update(read_env(cls, os.environ if env is None else env, known=known))
    for name in names:
        value = getattr(args, name, _UNSET)
        if value is not _UNSET and value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    for name in names:  # what the rest of the script reads from args: the effective value
        setattr(args, name, values.get(name, parser.get_default(name)))
    return cls(**values), args


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
