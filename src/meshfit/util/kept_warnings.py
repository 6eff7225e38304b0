"""Python warnings (torch's included) kept in a file, off the console: a training rank's in its run
directory, the demo's own in its folder; and the warnings logs of a demo's folder (its own and its ranks'),
so its last lines can say where they are."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any


class KeptWarnings:
    """Python warnings raised in this process go to `path` (created at the first one), not the console,
    each line prefixed with `[who]`; warnings whose message starts with one of `ignore` are dropped."""

    def __init__(self, path: Path, who: str = "demo", ignore: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        self.who = who
        self.ignore = ignore
        self.count = 0

    def __enter__(self) -> KeptWarnings:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        for message in self.ignore:
            warnings.filterwarnings("ignore", message=message)
        warnings.showwarning = self._write
        return self

    def _write(self, message: Any, category: type, filename: str, lineno: int, file: Any = None,
               line: str | None = None) -> None:
        self.count += 1
        with contextlib.suppress(OSError):  # a warning must never end a run
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(f"[{self.who}] {filename}:{lineno}: {category.__name__}: {message}\n")

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


def warning_logs(run_dir: Path) -> list[tuple[Path, int]]:
    """Every non-empty warnings log under run_dir (the demo's and the ranks'), with its line count."""
    found = []
    for path in sorted([run_dir / "warnings.log", *run_dir.glob("*/warnings*.log")]):
        with contextlib.suppress(OSError):
            lines = sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
            if lines:
                found.append((path, lines))
    return found
