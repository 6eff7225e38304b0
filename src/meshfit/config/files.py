"""Reading a config file (TOML, YAML or JSON) into the mapping of sections that config.py validates, and
the error every refused configuration raises."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import tomllib
import yaml

from meshfit.util.jsonfile import DuplicateKey, loads_unique


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the valid choices."""


_FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}


def _parse_problem(exc: Exception) -> str:
    # YAML's message spans several lines with a copy of the source; its first problem and position suffice.
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.YAMLError) and mark is not None:
        return f"{getattr(exc, 'problem', None) or exc} (line {mark.line + 1}, column {mark.column + 1})"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _toml_problem(exc: tomllib.TOMLDecodeError, text: str) -> str:
    """tomllib's message, with the key of a duplicate named (its message gives only the position)."""
    found = re.search(r"Cannot overwrite a value \(at line (\d+)", str(exc))
    lines = text.splitlines()
    if found and 0 < int(found.group(1)) <= len(lines):
        line = int(found.group(1))
        key = lines[line - 1].partition("=")[0].strip() or lines[line - 1].strip()
        return f"key {key!r} is given twice (again at line {line}); keep one"
    return _parse_problem(exc)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(f"key {key!r} is given twice (lines {seen[key]} and "
                                    f"{key_node.start_mark.line + 1}); keep one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: Path, sections: tuple[str, ...]) -> dict[str, Any]:
    """The mapping of sections in a TOML, YAML or JSON config file; ConfigError naming the file otherwise."""
    valid = "expected a .toml, .yaml, .yml or .json config file"
    if path.is_dir():
        raise ConfigError(f"--config {path} is a directory; {valid} (e.g. {path / 'config.yaml'})")
    if not path.is_file():
        raise ConfigError(f"--config {path}: config file does not exist ({valid})")
    if path.suffix not in _FORMATS:
        raise ConfigError(f"--config {path}: unknown format {path.suffix!r}; {valid}")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        else:
            data = loads_unique(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}); {valid}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} cannot be parsed as TOML: {_toml_problem(exc, text)}") from None
    except (yaml.YAMLError, json.JSONDecodeError, DuplicateKey) as exc:
        raise ConfigError(f"config file {path} cannot be parsed as {_FORMATS[path.suffix]}: "
                          f"{_parse_problem(exc)}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections ({', '.join(sections)})")
    return data
