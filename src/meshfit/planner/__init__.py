"""Planning a layout before renting the cluster: the search over layouts and its explanation, on top of
the per-rank memory model (`memory/`) and the step-time model (`timing/`).

Pure arithmetic on plain numbers and dataclasses (no torch import at module level), so it runs anywhere and
can reason about models far too large to build; it reaches parallel/ and the models only inside functions.
"""
