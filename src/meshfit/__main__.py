"""`python -m meshfit` is the same as the `meshfit` command (both start here).

Only the standard library is imported before Ctrl-C is handled: torch takes seconds to import, and an
interrupt during that import must end the command quietly (exit 130), not with a traceback.
"""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from meshfit.commands.main import main

        code = main()
    except KeyboardInterrupt:
        print("interrupted (SIGINT); nothing was saved", file=sys.stderr)
        code = 130
    raise SystemExit(code)


if __name__ == "__main__":
    run()
