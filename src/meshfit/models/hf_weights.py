"""meshfit weights ⇄ Hugging Face weights (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, OLMoE and GPT-2
causal LMs) and their config.json.

A Mixture-of-Experts block's routed experts are three 3-D tensors here (``experts.w1`` [E, F, D], ...) and
one ``nn.Linear`` weight per expert there (``...experts.{j}.w1.weight`` [F, D]): expert j is slice j.

meshfit's Llama block is HF's Llama, Mistral, Qwen2 and Qwen3 block (RMSNorm, rotate-half RoPE, SwiGLU,
GQA; Qwen2's q/k/v biases, Qwen3's q/k norms): tensors are renamed.
meshfit's GPT block is GPT-2's with separate q/k/v projections stored as nn.Linear ([out, in]); GPT-2 keeps
them fused in one Conv1D ([in, 3·out]), so those are concatenated and transposed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshfit.models.config import ModelConfig

_LLAMA = [  # (meshfit, HF) with {i} for the layer index
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attention.wq.bias", "model.layers.{i}.self_attn.q_proj.bias"),  # qkv_bias (Qwen2)
    ("layers.{i}.attention.wk.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    ("layers.{i}.attention.wv.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),  # qk_norm (Qwen3)
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]
# Mixture-of-Experts tensors of each Hugging Face family, {j}: the expert. Routers: one tensor each.
_ROUTERS = {"mixtral": [("layers.{i}.feed_forward.router.gate.weight", "model.layers.{i}.block_sparse_moe.gate.weight")],
            "qwen3_moe": [("layers.{i}.feed_forward.router.gate.weight", "model.layers.{i}.mlp.gate.weight")]}
_ROUTERS["olmoe"] = _ROUTERS["qwen3_moe"]  # OLMoE's files name the MoE tensors as Qwen3-MoE's do
_EXPERTS = {
    "mixtral": [(f"layers.{{i}}.feed_forward.experts.{w}", f"model.layers.{{i}}.block_sparse_moe.experts.{{j}}.{w}.weight")
                for w in ("w1", "w2", "w3")],
    "qwen3_moe": [(f"layers.{{i}}.feed_forward.experts.{w}", f"model.layers.{{i}}.mlp.experts.{{j}}.{hf}.weight")
                  for w, hf in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))],
}
_EXPERTS["olmoe"] = _EXPERTS["qwen3_moe"]
_EXPERT_BIAS = re.compile(r"^layers\.\d+\.feed_forward\.router\.expert_bias$")
_GPT = [  # renamed as they are; Conv1D weights (marked T) are transposed
    ("tok_embeddings.weight", "transformer.wte.weight", False),
    ("pos_embeddings.weight", "transformer.wpe.weight", False),
    ("layers.{i}.attention_norm.{p}", "transformer.h.{i}.ln_1.{p}", False),
    ("layers.{i}.ffn_norm.{p}", "transformer.h.{i}.ln_2.{p}", False),
    ("layers.{i}.attention.wo.weight", "transformer.h.{i}.attn.c_proj.weight", True),
    ("layers.{i}.attention.wo.bias", "transformer.h.{i}.attn.c_proj.bias", False),
    ("layers.{i}.feed_forward.w1.weight", "transformer.h.{i}.mlp.c_fc.weight", True),
    ("layers.{i}.feed_forward.w1.bias", "transformer.h.{i}.mlp.c_fc.bias", False),
    ("layers.{i}.feed_forward.w2.weight", "transformer.h.{i}.mlp.c_proj.weight", True),
    ("layers.{i}.feed_forward.w2.bias", "transformer.h.{i}.mlp.c_proj.bias", False),
    ("norm.{p}", "transformer.ln_f.{p}", False),
    ("output.weight", "lm_head.weight", False),
]
_QKV = ("wq", "wk", "wv")


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    escaped = escaped.replace(r"\{j\}", r"(?P<j>\d+)")
    return re.compile(f"^{escaped}$")


def _rename(name: str, table: list[tuple], src: int, dst: int) -> tuple[str, bool] | None:
    for row in table:
        match = _pattern(row[src]).match(name)
        if match:
            return row[dst].format(**match.groupdict()), (row[2] if len(row) > 2 else False)
    return None


def _table(cfg: ModelConfig) -> list[tuple]:
    if cfg.family == "gpt":
        return _GPT
    return _LLAMA + _ROUTERS[hf_model_type(cfg)] if cfg.moe else _LLAMA


def _expert_rows(cfg: ModelConfig) -> list[tuple[str, str]]:
    return _EXPERTS[hf_model_type(cfg)] if cfg.moe else []


def expert_source(name: str, cfg: ModelConfig) -> str | None:
    """The Hugging Face name of expert {j}'s tensor in meshfit's 3-D expert tensor `name`; None for others."""
    for plain, stored in _expert_rows(cfg):
        match = _pattern(plain).match(name)
        if match:
            return stored.format(i=match.group("i"), j="{j}")
    return None


def _unstack_experts(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor] | None:
    template = expert_source(name, cfg)
    if template is None:
        return None
    return {template.format(j=j): part.contiguous() for j, part in enumerate(tensor.unbind(0))}


def _check_bias(name: str, tensor: torch.Tensor) -> None:
    # Neither Mixtral nor Qwen3-MoE routes with a bias: a trained one changes which experts are chosen.
    if tensor.is_meta or bool((tensor == 0).all()):
        return
    raise ValueError(f"{name} is not zero: the aux-loss-free expert bias changes the routing, and no Hugging "
                     "Face architecture meshfit writes (Mixtral, Qwen3-MoE) has it")


def to_hf(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """meshfit full weights (plain names) → HF tensors; the tied output head is left out, as HF does."""
    table = _table(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        if _EXPERT_BIAS.match(name):
            _check_bias(name, tensor)
            continue
        experts = _unstack_experts(name, tensor, cfg)
        if experts is not None:
            out.update(experts)
            continue
        if cfg.family == "gpt" and re.match(r"^layers\.\d+\.attention\.(wq|wk|wv)\.(weight|bias)$", name):
            continue  # fused below
        renamed = _rename(name, table, 0, 1)
        if renamed is None:
            raise ValueError(f"no Hugging Face name for meshfit tensor {name!r} ({cfg.family} family)")
        hf_name, transpose = renamed
        out[hf_name] = (tensor.t() if transpose else tensor).contiguous()
    if cfg.family == "gpt":
        # The layers present (an export writes a layer at a time): q, k and v are fused into c_attn.
        fused = (re.match(r"^layers\.(\d+)\.attention\.wq\.weight$", name) for name in weights)
        for i in sorted(int(m.group(1)) for m in fused if m):
            base = f"layers.{i}.attention"
            out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat(
                [weights[f"{base}.{k}.weight"].t() for k in _QKV], dim=1).contiguous()
            out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([weights[f"{base}.{k}.bias"] for k in _QKV])
    return out


def from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """HF tensors → meshfit full weights by plain name; raises ValueError naming `source` and the tensor."""
    table = _table(cfg)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        for plain, stored in _expert_rows(cfg):
            if match := _pattern(stored).match(name):
                experts.setdefault(plain.format(i=match.group("i")), {})[int(match.group("j"))] = tensor
                break
        else:
            match = None
        if match:
            continue
        if cfg.family == "gpt" and (m := re.match(r"^transformer\.h\.(\d+)\.attn\.c_attn\.(weight|bias)$", name)):
            parts = tensor.split(cfg.dim, dim=-1)  # [in, 3·out] or [3·out]
            for key, part in zip(_QKV, parts, strict=True):
                out[f"layers.{m.group(1)}.attention.{key}.{m.group(2)}"] = part.t() if part.ndim == 2 else part
            continue
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            continue  # GPT-2's causal-mask buffers in old checkpoints
        renamed = _rename(name, table, 1, 0)
        if renamed is None:
            raise ValueError(f"{source}: tensor {name!r} has no meshfit counterpart ({cfg.family} family)")
        plain, transpose = renamed
        out[plain] = tensor.t() if transpose else tensor
    for plain, parts in experts.items():
        if set(parts) != set(range(cfg.moe_experts)):
            odd = min(set(parts) ^ set(range(cfg.moe_experts)))
            raise ValueError(f"{source}: the model has experts 0 to {cfg.moe_experts - 1}, and tensor "
                             f"{expert_source(plain, cfg).format(j=odd)} is {'missing' if odd not in parts else 'extra'}")
        out[plain] = torch.stack([parts[j] for j in range(cfg.moe_experts)])
    if cfg.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return {k: v.contiguous() for k, v in out.items()}


# Hugging Face architecture of each model_type meshfit writes.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type whose block is `cfg`'s: Qwen3 has q/k norms, Qwen2 q/k/v biases, Mistral a
    sliding window; a plain Llama-family model is a Llama. ValueError for a variant no such class has."""
    if cfg.family == "gpt":
        return "gpt2"
    if cfg.moe:
        return _moe_model_type(cfg)
    if cfg.qk_norm and cfg.qkv_bias:
        raise ValueError("model.qkv_bias and model.qk_norm together: no Hugging Face architecture meshfit writes "
                         "has both (Qwen2 has the biases, Qwen3 the norms)")
    if cfg.qk_norm and cfg.qk_norm_scope != "head":
        raise ValueError(f"model.qk_norm_scope={cfg.qk_norm_scope!r} on a dense model: no Hugging Face architecture "
                         "meshfit writes has it (Qwen3 normalises each head; OLMoE, whose norms span the "
                         "projections, has experts)")
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def _moe_model_type(cfg: ModelConfig) -> str:
    """Mixtral (no q/k norms, every layer sparse, top-k renormalised), Qwen3-MoE (q/k norms per head, the
    first layers may be dense) or OLMoE (q/k norms over the whole projections, every layer sparse, heads
    dim / n_heads wide); ValueError naming what none computes."""
    unlike = [(name, value) for name, value, plain in (
        ("moe_shared_experts", cfg.moe_shared_experts, 0), ("moe_score", cfg.moe_score, "softmax"),
        ("moe_route_scale", cfg.moe_route_scale, 1.0), ("qkv_bias", cfg.qkv_bias, False)) if value != plain]
    kind = ("olmoe" if cfg.qk_norm_scope == "projection" else "qwen3_moe") if cfg.qk_norm else "mixtral"
    if kind == "mixtral":
        unlike += [(n, v) for n, v, plain in (("moe_dense_layers", cfg.moe_dense_layers, 0),
                                              ("moe_norm_topk", cfg.moe_norm_topk, True)) if v != plain]
    if kind == "olmoe":
        unlike += [(n, v) for n, v, plain in (("moe_dense_layers", cfg.moe_dense_layers, 0),
                                              ("head_dim", cfg.head_dim, None)) if v != plain]
    if unlike:
        name, value = unlike[0]
        raise ValueError(f"model.{name}={value!r}: no Hugging Face Mixture-of-Experts architecture meshfit writes "
                         "(Mixtral, Qwen3-MoE, OLMoE) computes it")
    return kind


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """`rope_scaling` as transformers 4 and the Hub's Llama 3.1 files spell it (transformers 5 reads it too)."""
    if cfg.rope_scaling == "none":
        return None
    out: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_original_max_seq_len)
    return out


def _llama_family_config(cfg: ModelConfig, kind: str) -> dict[str, Any]:
    out = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "hidden_size": cfg.dim,
           "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_size,
           "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling(cfg), "hidden_act": "silu",
           "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0}
    if kind in ("llama", "qwen3", "qwen3_moe", "olmoe"):
        out.update(attention_bias=False, **({"mlp_bias": False} if kind == "llama" else {}))
    if kind in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    if kind == "mixtral":
        out.update(num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                   intermediate_size=cfg.moe_hidden, router_aux_loss_coef=cfg.moe_aux_loss_coeff,
                   router_jitter_noise=0.0)
    if kind == "qwen3_moe":
        out.update(num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                   moe_intermediate_size=cfg.moe_hidden, norm_topk_prob=cfg.moe_norm_topk, decoder_sparse_step=1,
                   mlp_only_layers=list(range(cfg.moe_dense_layers)), router_aux_loss_coef=cfg.moe_aux_loss_coeff)
    if kind == "olmoe":  # intermediate_size is an expert's width (OLMoE has no dense MLP)
        out.update(num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k, intermediate_size=cfg.moe_hidden,
                   norm_topk_prob=cfg.moe_norm_topk, router_aux_loss_coef=cfg.moe_aux_loss_coeff, clip_qkv=None)
        del out["head_dim"]  # OlmoeConfig has no such field; its heads are hidden_size / heads wide
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        # A window, where set, on every layer (max_window_layers 0): the strictest reading of it.
        windowed = cfg.sliding_window is not None
        out.update(use_sliding_window=windowed, sliding_window=cfg.sliding_window,
                   max_window_layers=0 if windowed else cfg.n_layers)
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for the transformers class of `cfg` (hf_model_type), every modelled field written."""
    dtype_name = str(dtype).removeprefix("torch.")
    kind = hf_model_type(cfg)
    if kind != "gpt2":
        return {**_llama_family_config(cfg, kind), "torch_dtype": dtype_name}
    return {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "n_embd": cfg.dim, "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_inner": cfg.ffn_hidden, "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": None, "eos_token_id": None,
            "torch_dtype": dtype_name}


def save_hf(weights: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path,
            dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write model.safetensors and config.json into out_dir; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in to_hf(weights, cfg).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return [out_dir / "model.safetensors", out_dir / "config.json"]


def hf_source(name: str, cfg: ModelConfig) -> tuple[str, bool, int] | None:
    """Where meshfit tensor `name` is stored in a Hugging Face checkpoint: (tensor name, stored transposed,
    offset of its rows in a fused tensor: GPT-2's q, k and v are column ranges of c_attn); None if nowhere."""
    if cfg.family == "gpt" and (match := re.match(r"^layers\.(\d+)\.attention\.(wq|wk|wv)\.(weight|bias)$", name)):
        layer, which, kind = match.groups()
        return f"transformer.h.{layer}.attn.c_attn.{kind}", kind == "weight", _QKV.index(which) * cfg.dim
    renamed = _rename(name, _table(cfg), 0, 1)
    return None if renamed is None else (renamed[0], renamed[1], 0)


def safetensors_files(path: str | Path) -> list[Path]:
    """The *.safetensors files of a folder (or the one file) that model.init_from names; ValueError if none."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        where = "does not exist" if not path.exists() else "holds no .safetensors files"
        raise ValueError(f"model.init_from={path}: {where} (give the folder `meshfit export` wrote, or one "
                         ".safetensors file)")
    index = path / "model.safetensors.index.json" if path.is_dir() else None
    if index is not None and index.is_file():
        from meshfit.util.jsonfile import read_json_object

        named = read_json_object(index, "safetensors index").get("weight_map")
        if not isinstance(named, dict):
            raise ValueError(f"model.init_from: {index} has no weight_map (tensor name -> shard file)")
        missing = sorted({str(f) for f in named.values()} - {f.name for f in files})
        if missing:
            raise ValueError(f"model.init_from: {index} names shard {missing[0]}, which is not in {path}"
                             + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""))
    return files


_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names of the dtypes weights may be stored in


def check_hf(path: str | Path, cfg: ModelConfig) -> None:
    """model.init_from checked from the safetensors headers alone (no tensor is read): the files are
    present and whole, and their names and shapes are the model's; ValueError naming what is wrong."""
    from meshfit.models.build import build_model
    from meshfit.models.init import check_weights

    path = Path(path)
    shapes: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as handle:  # checks the header against the file size
                for key in handle.keys():
                    part = handle.get_slice(key)
                    if part.get_dtype() not in _FLOAT_DTYPES:  # token ids, quantized codes: not these weights
                        raise ValueError(f"model.init_from: {file} stores {key} as {part.get_dtype()}; the model's "
                                         f"weights are floating point ({', '.join(_FLOAT_DTYPES)})")
                    shapes[key] = torch.empty(part.get_shape(), device="meta")
        except ValueError:
            raise
        except Exception as exc:  # safetensors raises its own error types for damaged headers
            raise ValueError(f"model.init_from: {file} cannot be read as safetensors: {exc}") from None
    check_weights(build_model(cfg, device="meta"), from_hf(shapes, cfg, str(path)), cfg)
