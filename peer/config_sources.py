"""Config values from a TOML file and from environment variables, typed by the config dataclasses.

Both sources are keyed by the dataclass fields, like the flags (:mod:`peer.cli`): the field
``max_in_flight`` is the flag ``--max-in-flight``, the file key ``max_in_flight`` and the environment
variable ``MURMURATION_MAX_IN_FLIGHT``. Nothing here knows a field by name, so a new field is
reachable from all three at once.

Values are checked against the field's type before the dataclass sees them; a mistake (unknown key,
wrong type, unreadable file) is a ``ValueError`` whose message is one sentence naming the source.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

ENV_PREFIX = "MURMURATION_"
# MURMURATION_ variables that are not options: fault injection (peer/faults.py), the status client's
# own (peer/status/client.py), and the test suite's switches (scripts/test.sh, tests/e2e/)
OTHER_VARIABLES = frozenset({
    "MURMURATION_INJECT_FAULTS", "MURMURATION_ALLOW_FAULT_INJECTION", "MURMURATION_LIBP2P_PYTHON",
    "MURMURATION_STATUS_CLIENT_REEXECUTED", "MURMURATION_CPU_HOG", "MURMURATION_TEST_WORKERS",
    "MURMURATION_DOCS_SCREENSHOT",
})
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_name(field_name: str) -> str:
    """The environment variable of a field: ``max_in_flight`` → ``MURMURATION_MAX_IN_FLIGHT``."""
    return ENV_PREFIX + field_name.upper()


def init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def read_config_file(cls: type, path: str) -> dict[str, Any]:
    """The values ``path`` (TOML) sets for ``cls``'s fields, checked against their types.

    Raises:
        ValueError: unreadable file, invalid TOML, an unknown key, or a value of the wrong type.
    """
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from e
    fields = {f.name: f for f in init_fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in fields:
            raise ValueError(f"config file {path}: unknown key '{key}'{_suggestion(key, fields)}")
        values[key] = _from_toml(fields[key], value, where=f"config file {path}: key '{key}'")
    return values


def read_env(cls: type, env: Mapping[str, str], *, known: Iterable[str] = ()) -> dict[str, Any]:
    """The values ``MURMURATION_<FIELD>`` variables in ``env`` set for ``cls``'s fields.

    Variables of the ``known`` names (the other entry script's options: the two share the prefix,
    and ``MURMURATION_BOOTSTRAP`` means something to run_peer.py only) and of ``OTHER_VARIABLES``
    are left alone; any other ``MURMURATION_`` variable is a mistake (a typo would otherwise be
    silently ignored).

    Raises:
        ValueError: an unknown ``MURMURATION_`` variable, or a value that does not parse as the field's type.
    """
    names = {env_name(f.name): f.name for f in init_fields(cls)}
    recognised = set(names) | set(known) | OTHER_VARIABLES
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in recognised:
            close = difflib.get_close_matches(name, sorted(recognised), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"environment variable {name} is not an option of this script{hint}; "
                             f"unset it or correct its name")
    values = {}
    for field in init_fields(cls):
        name = env_name(field.name)
        if name in env:
            values[field.name] = _from_text(field, env[name], where=f"environment variable {name}")
    return values


def _from_toml(field: dataclasses.Field, value: Any, *, where: str) -> Any:
    kind = field.type
    if kind in ("str", "str | None") and isinstance(value, str):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "tuple[str, ...]":
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return tuple(value)
    raise ValueError(f"{where} must be {_describe(kind)}, got {value!r:.80}")


def _from_text(field: dataclasses.Field, text: str, *, where: str) -> Any:
    kind = field.type
    try:
        if kind == "str":
            return text
        if kind == "str | None":
            return text or None
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool" and text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
        if kind == "tuple[str, ...]":
            return tuple(text.split())
    except ValueError:
        pass
    raise ValueError(f"{where} must be {_describe(kind)}, got {text!r:.80}")


def _describe(kind: str) -> str:
    return {
        "str": "a string", "str | None": "a string", "int": "an integer", "float": "a number",
        "bool": "true or false",
        "tuple[str, ...]": "a list of strings (in the environment: separated by spaces)",
    }.get(kind, kind)


def _suggestion(key: str, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), list(fields), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
