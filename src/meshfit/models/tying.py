"""Shared behaviour of the decoder models: an output head that can share the embedding's weight."""

from __future__ import annotations

from torch import nn


class TiedHead(nn.Module):
    """Mixin for models with `cfg.tie_embeddings`, `tok_embeddings` and `output` (either may be None)."""

    def tie_weights(self) -> None:
        """Make ``output.weight`` the same Parameter as ``tok_embeddings.weight`` when tied."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse: bool = True):
        # to_empty() (meta -> real device) replaces each parameter separately,
        # which would silently untie the shared weight.
        out = super()._apply(fn, recurse)
        self.tie_weights()
        return out
