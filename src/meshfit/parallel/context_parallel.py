"""Context parallelism: each rank of the ``cp`` mesh dimension holds a part of every sequence.

The sequence is cut into 2·cp equal chunks; cp rank i holds chunks i and 2·cp−1−i. Under a causal mask a
query attends to every key before it, so late chunks cost more than early ones: pairing an early chunk
with a late one gives every rank the same attention work (Megatron-LM's and torchtitan's load balance).

Attention across ranks gathers the keys and values of the whole sequence on every cp rank (an all-gather
per layer, a reduce-scatter of their gradients in backward), as Llama 3 was trained, rather than passing
them around a ring: with grouped-query attention the keys and values are a fraction of the queries' size
(1/4 for Llama-3 8B), the collective is one call that both gloo and NCCL run, and each local query chunk
then attends to a prefix of the gathered sequence with one softmax, exact by construction (no partial
results to merge). The price is the gathered keys and values, held for backward: 2·s·kv_width per layer
next to the rank's own s/cp-long activations; the planner counts them.

The model stays unaware of all this: `apply_context_parallel` replaces each block's attention core and
tells the position tables (RoPE, learned positions) which global positions the local tokens have.

Packed documents (data.document_mask): the positions come with the tokens (split like them), and the
model's block-causal mask is built here instead, once per forward: the document ids of the whole sequence
are all-gathered (b·s integers), and the mask pairs the rank's queries with every key, a key visible when
it is in the query's document and not after it in the sequence (b·s²/cp values in the activations' dtype,
kept by every block's attention for backward, as one mask). Each chunk's attention takes its rows and its prefix of columns.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as fc
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshfit.models.layers import AttentionCore
from meshfit.models.masks import additive, same_document

# torch ≥ 2.12 names it all_gather_single_autograd; 2.11 has only the older name.
_all_gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
_all_gather_ids = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # no gradient: document ids


def cp_degree_error(cp: int, seq_len: int) -> str | None:
    """None if `cp` can split `seq_len`-long sequences into 2·cp equal chunks; else what would work."""
    if seq_len % (2 * cp) == 0:
        return None
    valid = [d for d in range(1, seq_len // 2 + 1) if seq_len % (2 * d) == 0]
    fits = [seq_len // (2 * cp) * 2 * cp, (seq_len // (2 * cp) + 1) * 2 * cp]
    degrees = (f", or parallel.cp one of {', '.join(map(str, valid[:12]))}" if valid
               else " (no parallel.cp splits an odd length)")
    return (f"parallel.cp={cp} cuts each sequence into 2·cp = {2 * cp} equal chunks (two per rank, for the causal "
            f"load balance), which train.seq_len={seq_len} does not divide; use train.seq_len "
            f"{' or '.join(str(f) for f in fits if f > 0)}{degrees}")


def chunk_order(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that cp rank `rank` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def local_positions(local_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions of the `local_len` tokens cp rank `rank` holds (two chunks of local_len / 2)."""
    chunk = local_len // 2
    first, second = chunk_order(cp, rank)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def shard_sequence(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's two chunks of `t` along dim 1 (the sequence): [b, s, ...] -> [b, s / cp, ...]."""
    chunks = t.chunk(2 * cp, dim=1)
    first, second = chunk_order(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=1).contiguous()


def _global_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """Sequence-first [cp·2c, …] gathered in rank order (chunks 0, 2cp−1, 1, 2cp−2, …) -> the sequence's
    own order."""
    pairs = gathered.view(cp, 2, gathered.shape[0] // (2 * cp), *gathered.shape[1:])
    early, late = pairs[:, 0], pairs[:, 1].flip(0)  # chunks 0..cp−1, then cp..2cp−1
    return torch.cat([early, late]).flatten(0, 1)


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's query chunks over the whole sequence's keys and values.

    Takes and returns ``[b, heads, s/cp, head_dim]`` as the `AttentionCore` it replaces; runs that core
    (its kernel, dropout and grouped heads) once per local chunk, on the prefix of the sequence the chunk
    may see."""

    def __init__(self, core: AttentionCore, mesh: DeviceMesh) -> None:
        super().__init__()
        self.core = core
        self.cp = mesh.size()
        self.rank = mesh.get_local_rank()
        self._group = mesh.get_group()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        # The gather runs along dim 0 (the only dimension torch's autograd all-gather supports), so the
        # sequence is moved there first.
        keys, values = (_global_order(_all_gather(t.movedim(2, 0).contiguous(), 0, self._group), self.cp)
                        .movedim(0, 2) for t in (k, v))
        chunk = q.shape[2] // 2
        outs = []
        for j, index in enumerate(chunk_order(self.cp, self.rank)):
            end = (index + 1) * chunk  # the chunk's queries are the last `chunk` positions of keys[:end]
            rows = slice(j * chunk, (j + 1) * chunk)
            part = None if mask is None else mask[:, :, rows, :end]
            outs.append(self.core(q[:, :, rows], keys[:, :, :end], values[:, :, :end], part))
        return torch.cat(outs, dim=2)


class ContextParallelMask:
    """A model's additive document mask under context parallelism (see the module's docstring):
    ``[b, 1, s/cp, s]``, the rank's queries (its two chunks, in the order it holds them) by the sequence's keys in order."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.cp = mesh.size()
        self.rank = mesh.get_local_rank()
        self._group = mesh.get_group()

    def __call__(self, documents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        gathered = _all_gather_ids(documents.movedim(1, 0).contiguous(), 0, self._group)
        keys = _global_order(fc.wait_tensor(gathered), self.cp).movedim(0, 1)  # [b, s]
        query_index = local_positions(documents.shape[1], self.cp, self.rank, documents.device)
        key_index = torch.arange(keys.shape[1], device=documents.device)
        return additive(same_document(documents, keys) & (key_index[None, :] <= query_index[:, None]), dtype)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, seq_len: int) -> None:
    """Split every block's attention across the 1-D `cp` mesh and tell the position tables (RoPE's, GPT's
    learned positions) the global positions of this rank's tokens of `seq_len`-long sequences, in place
    (on meta, after tensor parallelism, before recompute and sharding)."""
    for block in model.layers.values():
        block.attention.core = ContextParallelAttention(block.attention.core, mesh)
    model.mask_builder = ContextParallelMask(mesh)
    rows = local_positions(seq_len // mesh.size(), mesh.size(), mesh.get_local_rank())
    for module in model.modules():
        if hasattr(module, "position_rows"):
            module.position_rows = rows
