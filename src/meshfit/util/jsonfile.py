"""Reading the JSON files users hand to meshfit, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshfit.util.paths import read_text


def read_json_object(path: str | Path, what: str, hint: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; ValueError naming the file when it is missing, a directory, unreadable,
    not JSON or not an object.

    ``what`` names the expected content ("plan file", "model config"); ``hint`` says how to get one.
    """
    path = Path(path)
    text = read_text(path, what, hint)
    try:
        doc = json.loads(text)
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
