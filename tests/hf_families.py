"""Tiny random Hugging Face models of every family meshfit reads, made with transformers, and the ranks' job
that runs them under meshfit's parallel layouts (importable by spawned ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SEQ = 128  # tokens per sequence: four times the llama3 case's original context, so its scaling matters
VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


def family_configs() -> dict[str, Any]:
    """name -> transformers config of a tiny model of that family (one per variant meshfit models)."""
    import transformers as tf

    return {
        "llama2": tf.LlamaConfig(**{**_COMMON, "num_key_value_heads": 4}, rope_theta=10000.0),  # multi-head
        "llama3.1": tf.LlamaConfig(**_COMMON, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
        "llama3.2": tf.LlamaConfig(**_COMMON, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                                   tie_word_embeddings=True),
        "llama-linear": tf.LlamaConfig(**_COMMON, rope_scaling={"rope_type": "linear", "factor": 4.0}),
        "mistral": tf.MistralConfig(**_COMMON, sliding_window=SEQ),  # a window as long as the sequence
        "qwen2": tf.Qwen2Config(**_COMMON, rope_theta=1000000.0),
        "qwen3": tf.Qwen3Config(**_COMMON, head_dim=24, rope_theta=1000000.0),  # heads wider than dim / heads
        "gpt2": tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None),
    }


def save_random_model(name: str, folder: Path, seed: int = 0) -> Any:
    """Save a random `name` model (biases and norm weights moved off their zero/one initialisation, so that
    each tensor's place matters) to `folder`; returns the transformers model, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_configs()[name]).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return model


def as_transformers4(folder: Path) -> None:
    """Rewrite folder/config.json in transformers 4's RoPE spelling (rope_theta + rope_scaling), as the Hub's
    Llama 3.1 files have it."""
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type") == "default" else params
    path.write_text(json.dumps(cfg))


def tokens(batch: int = 2, seed: int = 1) -> torch.Tensor:
    """`batch` sequences of SEQ + 1 tokens: inputs are [:, :-1], targets [:, 1:]."""
    return torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def reference(model: Any, toks: torch.Tensor) -> dict[str, Any]:
    """transformers' logits on the inputs, its loss (labels = the tokens, shifted inside) and its gradients."""
    model.zero_grad()
    out = model(input_ids=toks, labels=toks)
    out.loss.backward()
    return {"logits": out.logits[:, :-1].detach(), "loss": out.loss.item(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def layouts_job(cases: list[tuple[str, dict[str, Any]]], toks: torch.Tensor) -> dict[str, Any]:
    """On every rank: for each (name, config) build meshfit's run (its model from model.init_from), run the
    inputs' forward, then one forward and backward through the trainer; rank 0 returns each case's full
    logits, loss and gradients in Hugging Face names."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshfit.config import config_from_dict
    from meshfit.models.hf_weights import to_hf
    from meshfit.models.init import canonical_name, strip_padding
    from meshfit.train.dist import init_distributed
    from meshfit.train.run import build_run
    from meshfit.train.trainer import _micro_step

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    out: dict[str, Any] = {}
    env = None
    for name, cfg_dict in cases:
        cfg = config_from_dict(cfg_dict)
        env = env or init_distributed(cfg.train.device)
        run = build_run(cfg, env, None)
        batch = run.local_batch(toks[:, :-1], toks[:, 1:])
        with torch.no_grad():
            logits = full(run.model(batch.inputs))[..., :run.shape.model.vocab_size]
        loss = _micro_step(run, batch, sync=True, scale=None)
        dist.all_reduce(loss)  # context parallelism: each rank's loss is the mean over its own tokens
        grads = {canonical_name(n, run.shape.model): full(p.grad) for n, p in run.model.named_parameters()}
        if env.rank == 0:  # numpy arrays: pickled by value (a tensor would be shared through this rank's memory)
            hf_grads = to_hf(strip_padding(grads, run.shape.model), run.shape.model)
            out[name] = {"logits": logits.numpy(), "loss": loss.item() / env.world_size,
                         "grads": {k: v.numpy() for k, v in hf_grads.items()}}
    return out
