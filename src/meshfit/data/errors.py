"""Error type for bad training data."""

from __future__ import annotations


class DataError(ValueError):
    """A data file or data setting cannot be used.

    By convention every message starts with the offending file (as given, or
    resolved when it helps) and says what a valid input would look like, so a
    user can fix the problem without reading the loader's source.
    """
