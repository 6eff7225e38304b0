"""Document boundaries inside a window of packed documents (data.document_mask), read from the EOS tokens.

Documents are joined one after another, each closed by its EOS token (`meshfit prepare`, a tokenizer
folder's text): the EOS belongs to the document it ends. Per token of a batch's inputs ``[b, s]``:

* its document id: how many EOS tokens come before it in the window (so a window's first tokens, the tail
  of a document that began in an earlier window, are document 0 of the window);
* its position: how many tokens of its document come before it in the window (0 at a document's first
  token, and at the window's first token), as Megatron-LM's ``--reset-position-ids`` counts;
* whether its prediction counts: the target of an EOS input is the next document's first token, which no
  token of the document before could predict (Megatron-LM's ``--eod-mask-loss``); such targets become
  ``IGNORE`` (cross-entropy's ignore_index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # torch's cross-entropy ignore_index


@dataclass(frozen=True)
class Packed:
    """One batch's inputs and targets with what document masking adds: document ids and positions."""

    inputs: torch.Tensor
    targets: torch.Tensor  # IGNORE where the prediction crosses a boundary
    documents: torch.Tensor | None = None  # None: no document masking (plain causal attention)
    positions: torch.Tensor | None = None

    def map(self, fn) -> Packed:
        """Every tensor through `fn` (a sequence split, a micro-batch slice)."""
        return Packed(*(None if t is None else fn(t) for t in
                        (self.inputs, self.targets, self.documents, self.positions)))

    def split(self, size: int) -> list[Packed]:
        """Micro-batches of `size` rows."""
        parts = [t.split(size) if t is not None else None for t in
                 (self.inputs, self.targets, self.documents, self.positions)]
        return [Packed(parts[0][i], parts[1][i], *(p[i] if p is not None else None for p in parts[2:]))
                for i in range(len(parts[0]))]

    def model_kwargs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The model's keyword inputs beyond the tokens."""
        if self.documents is None:
            return {}
        return {"documents": self.documents.to(device), "positions": self.positions.to(device)}


def pack(inputs: torch.Tensor, targets: torch.Tensor, eos_id: int | None) -> Packed:
    """`inputs` and `targets` (``[b, s]``) with the document ids, positions and target mask of the module's
    docstring; without `eos_id` (no document masking) the batch as it is."""
    if eos_id is None:
        return Packed(inputs, targets)
    eos = inputs == eos_id
    documents = eos.long().cumsum(dim=1) - eos.long()  # EOS tokens before each token, the token excluded
    index = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    first = torch.ones_like(eos)
    first[:, 1:] = eos[:, :-1]  # a document starts after an EOS, and at the window's start
    starts = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    return Packed(inputs, targets.masked_fill(eos, IGNORE), documents, index - starts)


def counted(targets: torch.Tensor) -> torch.Tensor:
    """How many targets count (are not IGNORE)."""
    return (targets != IGNORE).sum()
