"""`python -m meshfit` is the same as the `meshfit` command."""

from meshfit.cli import main

raise SystemExit(main())
