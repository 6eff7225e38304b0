"""Loading a run configuration: a TOML, YAML or JSON file, typed sections laid over it (e.g. a plan's), then
repeated ``--set section.key=value`` overrides. Everything is validated here, before any rank starts, so a
bad value is reported once with the field name and what would be valid instead of surfacing as a stack
trace on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from meshfit.config.files import ConfigError, read_config_file
from meshfit.config.sections import SECTIONS, Config
from meshfit.util.did_you_mean import did_you_mean

# Pydantic's wording for a wrong type names its own classes ("instance of TrainSection"); users wrote a
# config file or --set, so say what to write instead.
_TYPE_MESSAGES = {
    "int_parsing": "expected an integer", "int_type": "expected an integer",
    "int_from_float": "expected an integer", "float_parsing": "expected a number", "float_type": "expected a number",
    "bool_parsing": "expected true or false", "bool_type": "expected true or false",
    "string_type": "expected a string", "finite_number": "must be a finite number",
    "missing": "is required", "list_type": "expected a list",
    "model_type": "expected a section of keys (a [table] in TOML, a mapping in YAML or JSON)",
    "dict_type": "expected a section of keys (a [table] in TOML, a mapping in YAML or JSON)",
}

_BOUNDS = {"greater_than": ">", "greater_than_equal": "≥", "less_than": "<", "less_than_equal": "≤"}


def _unknown_key(loc: tuple) -> str:
    section = loc[0] if len(loc) > 1 else None
    if section in SECTIONS:
        valid = list(Config.model_fields[section].annotation.model_fields)
        hint = did_you_mean(loc[-1], valid, prefix=f"{section}.")
        return f"unknown key; {hint}valid keys: {', '.join(valid)}"
    return f"unknown section; {did_you_mean(loc[-1], SECTIONS)}valid sections: {', '.join(SECTIONS)}"


def _format_validation_error(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = _unknown_key(err["loc"])
        elif err["type"] == "literal_error":
            msg = f"must be one of {err['ctx']['expected'].replace(' or ', ', ')}"
        elif err["type"] in _TYPE_MESSAGES:
            msg = _TYPE_MESSAGES[err["type"]]
        elif err["type"] in _BOUNDS:
            msg = f"must be {_BOUNDS[err['type']]} {next(iter(err['ctx'].values())):g}"
        got = err.get("input")
        shown = "" if isinstance(got, dict) or err["type"] == "extra_forbidden" else f" (got {got!r})"
        lines.append(f"{field}: {msg}{shown}" if field else msg)  # a check across sections names its fields
    return ConfigError(f"invalid configuration ({source}):\n  " + "\n  ".join(lines))


def _scalar(text: str) -> Any:
    # Pydantic coerces strings to numbers and booleans; only null needs translating here.
    return None if text.strip().lower() in ("null", "none", "~") else text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings to a raw config mapping (returns a new mapping)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.steps=50")
        if section not in SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}; {did_you_mean(section, SECTIONS)}"
                              f"valid sections: {', '.join(SECTIONS)}")
        if not isinstance(out.setdefault(section, {}), dict):
            raise ConfigError(f"--set {item!r}: the config file's {section!r} is {out[section]!r}, not a section "
                              f"of keys; write it as a table/mapping (e.g. [{section}] in TOML)")
        out[section][name] = _scalar(value)
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                sections: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read a config file (optional), lay typed `sections` over it (e.g. a plan's), then apply the --set
    overrides; raises ConfigError naming each bad field."""
    data = read_config_file(Path(path), SECTIONS) if path else {}
    for section, values in (sections or {}).items():
        if not isinstance(data.get(section) or {}, dict):
            raise ConfigError(f"config file {path}: {section!r} is {data[section]!r}, not a section of keys")
        data[section] = {**(data.get(section) or {}), **values}
    data = apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise _format_validation_error(exc, str(path) if path else "--set") from None


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise _format_validation_error(exc, "dict") from None
