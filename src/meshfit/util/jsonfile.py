"""Reading the JSON files users hand to meshfit, with errors that name the file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from meshfit.util.paths import read_text


class DuplicateKey(ValueError):
    """A mapping names one key twice: the later value would silently win."""


def loads_unique(text: str) -> Any:
    """json.loads that refuses a key given twice in one object (json keeps the last), naming its lines."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in items]
        twice = next((key for key in keys if keys.count(key) > 1), None)
        if twice is not None:
            lines = [text.count("\n", 0, m.start()) + 1 for m in re.finditer(rf'"{re.escape(twice)}"\s*:', text)]
            where = f" (lines {', '.join(map(str, lines))})" if len(lines) > 1 else ""
            raise DuplicateKey(f"key {twice!r} is given twice in one object{where}; keep one")
        return dict(items)

    return json.loads(text, object_pairs_hook=pairs)


def read_json_object(path: str | Path, what: str, hint: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file when it is missing, a directory, unreadable,
    not JSON or not an object.

    ``what`` names the expected content ("plan file", "model config"); ``hint`` says how to get one.
    """
    path = Path(path)
    text = read_text(path, what, hint)
    try:
        doc = loads_unique(text)
    except DuplicateKey as exc:
        raise ValueError(f"{path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a JSON {what} ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object ({what})")
    return doc


def json_object_or_none(path: str | Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is absent, unreadable or cut short (a file a rank was
    writing when it was killed): for meshfit's own run files, where that means "not there"."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None
