"""Expert load over training with and without the aux-loss-free expert bias (and with the auxiliary loss).

    python benchmarks/moe/load_balance.py [--preset small-moe] [--steps 200] [--seq-len 128] [--batch 8]
                                          [--rates 0.001,0.01] [--out load_balance.png] [--no-aux]

Each run trains the same model from the same initialisation on the same text (made here: documents on a
few topics, each topic with its own words, so a router has something to tell apart), one process:

* `none`: no balancing at all (`moe_aux_loss_coeff=0`, `moe_bias_update_rate=0`);
* `bias R`: the aux-loss-free expert bias (DeepSeek-V3), `moe_bias_update_rate=R` for each of --rates, no
  auxiliary loss. A bias moves R per step: it takes about (score gap) / R steps to turn a router that sends
  every token to the same experts, so a 200-step run needs a larger R than DeepSeek-V3's 0.001;
* `aux`: the Switch/GShard auxiliary loss (`moe_aux_loss_coeff=0.01`), no bias (left out with --no-aux).

Reads each run's metrics.jsonl (`moe_load`: max / mean tokens per expert, per MoE layer; 1.0 is balanced),
saves a plot of every layer's load over the steps and prints it at steps 1, 50, 100 and the last.
Figures, not a test: one seed, one text.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

# One thread: on a shared 2-core host a second OpenMP thread waits on the other work far more than it helps.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from meshfit.config import load_config  # noqa: E402
from meshfit.train.launch import launch  # noqa: E402

NONE = ["model.moe_aux_loss_coeff=0", "model.moe_bias_update_rate=0"]
AUX = ["model.moe_aux_loss_coeff=0.01", "model.moe_bias_update_rate=0"]
TOPICS, WORDS_PER_TOPIC = 6, 300


def make_text(folder: Path, megabytes: float, seed: int = 0) -> Path:
    """Documents of words drawn by a flattened Zipf law (p ∝ 1 / (rank + 10)), each document on one topic;
    each topic spells its words with its own 8 letters (neighbouring topics share 4), so the bytes of a
    sequence say its topic: structure a router can learn to split. (With few distinct bytes and a steep
    Zipf law, every token's hidden state is nearly the same and any router sends all to the same experts.)"""
    rng = np.random.default_rng(seed)
    alphabet = "etaoinshrdlucmfwypvbgkjqxz"
    topics = []
    for t in range(TOPICS):
        letters = np.array(list((alphabet * 2)[t * 4: t * 4 + 8]))
        topics.append(["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(WORDS_PER_TOPIC)])
    weights = 1.0 / (np.arange(WORDS_PER_TOPIC) + 10.0)
    weights /= weights.sum()
    folder.mkdir(parents=True, exist_ok=True)
    size, doc = 0, 0
    while size < megabytes * 1e6:
        words = topics[doc % TOPICS]
        ids = rng.choice(len(words), size=int(rng.integers(100, 600)), p=weights)
        body = " ".join(words[i] for i in ids) + ".\n"
        (folder / f"{doc:05d}.txt").write_text(body)
        size, doc = size + len(body), doc + 1
    return folder


def variants(rates: list[float], aux: bool) -> dict[str, list[str]]:
    runs = {"none": NONE}
    runs.update({f"bias {rate:g}": ["model.moe_aux_loss_coeff=0", f"model.moe_bias_update_rate={rate}"]
                 for rate in rates})
    return {**runs, "aux": AUX} if aux else runs


def train_run(name: str, overrides: list[str], text: Path, run_dir: Path) -> list[dict]:
    began = time.perf_counter()
    outcome = launch(load_config(None, overrides + ["data.source=text", f"data.path={text}"]), run_dir, 1)
    if not outcome.ok:
        raise SystemExit(f"run {name} failed: {outcome.message}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "moe_load" in r]
    print(f"{name}: {len(records)} steps in {time.perf_counter() - began:.0f} s, last loss {records[-1]['loss']:.3f}")
    return records


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = runs[next(iter(runs))][0]["moe_layers"]
    fig, axes = plt.subplots(1, len(layers), figsize=(4.5 * len(layers), 3.6), sharey=True, squeeze=False)
    for col, layer in enumerate(layers):
        ax = axes[0][col]
        for name, records in runs.items():
            ax.plot([r["step"] for r in records], [r["moe_load"][col] for r in records], label=name, lw=1)
        ax.axhline(1.0, color="grey", lw=0.5, ls="--")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("max / mean tokens per expert")
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(runs: dict[str, list[dict]], steps: list[int]) -> None:
    layers = runs[next(iter(runs))][0]["moe_layers"]
    print(f"{'run':10s} {'step':>5s} " + " ".join(f"{'layer ' + str(i):>8s}" for i in layers) + f" {'mean':>7s}")
    for name, records in runs.items():
        by_step = {r["step"]: r for r in records}
        for step in steps:
            loads = by_step[step]["moe_load"]
            print(f"{name:10s} {step:5d} " + " ".join(f"{v:8.3f}" for v in loads) + f" {sum(loads) / len(loads):7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-moe")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rates", default="0.001,0.01", help="bias update rates, one run each")
    parser.add_argument("--out", type=Path, default=Path("load_balance.png"))
    parser.add_argument("--no-aux", action="store_true")
    args = parser.parse_args()
    runs_to_train = variants([float(r) for r in args.rates.split(",") if r], not args.no_aux)
    base = [f"model.preset={args.preset}", f"train.steps={args.steps}", f"train.global_batch={args.batch}",
            f"train.micro_batch={args.batch}", f"train.seq_len={args.seq_len}", "train.lr=1e-3",
            "train.warmup_steps=10", "train.seed=3", "train.log_every=1000", "train.memory_tracking=off",
            "checkpoint.at_end=false"]
    with tempfile.TemporaryDirectory() as tmp:
        text = make_text(Path(tmp) / "text", 2.0)
        runs = {name: train_run(name, base + overrides, text, Path(tmp) / name.replace(" ", "-"))
                for name, overrides in runs_to_train.items()}
    title = f"{args.preset}, {args.batch} × {args.seq_len} tokens a step, one process"
    plot(runs, args.out, title)
    print(f"{title}; plot: {args.out}")
    print("max / mean tokens per expert, per MoE layer (1.0: balanced)")
    table(runs, sorted({1, 50, 100, args.steps} & set(range(1, args.steps + 1))))


if __name__ == "__main__":
    main()
