"""The demo's second scene: sequences long enough that activations, not weights, exceed a rank.

ZeRO-3 shards weights, gradients and optimizer states, but every rank still runs whole sequences: the
activations of one 1,024-token sequence of the demo's model take more than its sharded model states.
The scene's budget is its own (`LONG_BUDGET`), set between what ZeRO-3 needs at this length and what the
same ZeRO-3 needs with each sequence split over the ranks (context parallelism); full recompute is shown
as the other answer, which pays one more forward per step. Results go to DIR/long_sequences.json and
DIR/long_memory.png; each layout runs in DIR/<layout> as the first scene's do.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from meshfit.demo.chart import memory_chart
from meshfit.demo.scene import run_scene
from meshfit.demo.tables import parity_text
from meshfit.demo.trial import Entry, Trial
from meshfit.layout.layout import Layout
from meshfit.util.units import fmt_bytes, parse_bytes

LONG_SEQ_LEN = 1024  # 8× the first scene's sequences
# Between ZeRO-3 at this length (~174 MiB on 2 ranks: 142 MiB of it activations) and ZeRO-3 over
# context-parallel ranks (~129 MiB), measured on 2 CPU ranks.
LONG_BUDGET = "140MiB"


def long_trials(nproc: int) -> list[Trial]:
    """One sequence per data-parallel rank per micro-batch, the same global batch (nproc sequences)."""
    seq = dict(global_batch=nproc, seq_len=LONG_SEQ_LEN)
    return [
        Trial("long-zero3", Layout(dp_shard=nproc, zero_stage=3, micro_batch=1),
              "ZeRO-3: state sharded, but every rank holds a whole sequence's activations", **seq),
        Trial("long-zero3-ac", Layout(dp_shard=nproc, zero_stage=3, activation_checkpointing="full", micro_batch=1),
              "+ full recompute: blocks keep only their inputs, at one more forward per step", **seq),
        Trial("long-cp", Layout(cp=nproc, zero_stage=3, micro_batch=1),
              f"each sequence split over the {nproc} ranks (context parallelism), ZeRO-3 over them", **seq),
    ]


def run_long_scene(run_dir: Path, nproc: int, console: Console) -> list[Entry]:
    limit = parse_bytes(LONG_BUDGET)
    entries = run_scene(f"Long sequences. The same model on {LONG_SEQ_LEN}-token sequences, one per rank, under a "
                        f"budget of {fmt_bytes(limit)}: weights are no longer the problem, activations are.",
                        long_trials(nproc), LONG_BUDGET, run_dir, console)
    zero3, cp = entries[0], entries[-1]
    acts = [max((m.get("activations", 0) for m in e.mem), default=0) for e in (zero3, cp)]
    if all(acts):
        console.print(f"Activations per rank: {fmt_bytes(acts[0])} with ZeRO-3 alone, {fmt_bytes(acts[1])} with "
                      f"each sequence split over {nproc} ranks (each keeps its 1/{nproc} of the sequence, plus "
                      "the whole sequence's keys and values, gathered for attention).")
    if text := parity_text(entries):
        console.print(text)
    (run_dir / "long_sequences.json").write_text(json.dumps(
        {"budget_bytes": limit, "seq_len": LONG_SEQ_LEN, "layouts": [e.to_json() for e in entries]}, indent=2))
    memory_chart([e.to_json() for e in entries], limit, run_dir / "long_memory.png")
    return entries
