"""'Did you mean …?' for the names users type: config sections and keys, presets, GPUs, --layout keys,
commands. A typo then gets the one likely fix next to the full list of valid names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to `word` (case-insensitive), or None when none is close enough to suggest."""
    by_lower = {str(c).lower(): str(c) for c in choices}
    word = str(word).lower()
    # A name cut short ("h100" for "H100-SXM") is the likeliest intent, ahead of one edit away ("H200").
    prefixed = [c for c in by_lower if c.startswith(word)] if len(word) >= 2 else []
    if prefixed:
        return by_lower[prefixed[0]]
    found = difflib.get_close_matches(word, list(by_lower), n=1, cutoff=0.6)
    return by_lower[found[0]] if found else None


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """'did you mean 'PREFIXx'? ' for the closest choice (ready to put before a list of valid names), or ''."""
    match = closest(word, choices)
    return f"did you mean {prefix + match!r}? " if match else ""
