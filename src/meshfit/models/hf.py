"""Model shapes from a Hugging Face ``config.json``: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, GPT-2, and the
Mixture-of-Experts Mixtral, Qwen3-MoE and OLMoE.

The folder is the model: every field of the file that changes the function its weights compute is read
into the ModelConfig (head_dim, Qwen2's q/k/v biases, Qwen3's q/k norms, RoPE's theta and scaling,
Mistral's sliding window) or refused with one line naming it (a RoPE scaling, activation, bias or
dropout meshfit's blocks do not have). Both spellings of RoPE are read: transformers 4's ``rope_theta`` +
``rope_scaling`` (the Hub's Llama 3.1 files) and transformers 5's ``rope_parameters``. A field missing
from the file takes the default transformers gives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshfit.models.config import ModelConfig
from meshfit.util.jsonfile import read_json_object

# model_type values whose block is meshfit's Llama block (RMSNorm, RoPE, SwiGLU, GQA) with their variants.
LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe")
GPT_TYPES = ("gpt2",)
CONFIG_FILE = "config.json"

# Fields whose other values change the function, with the values meshfit's blocks compute (None: the field
# may be absent). Checked before anything else is read.
_FIXED: dict[str, dict[str, tuple[Any, ...]]] = {
    "llama": {"attention_bias": (None, False), "mlp_bias": (None, False)},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"attention_bias": (None, False)},
    "mixtral": {"router_jitter_noise": (None, 0, 0.0)},
    "qwen3_moe": {"attention_bias": (None, False), "decoder_sparse_step": (None, 1),
                  "shared_expert_intermediate_size": (None, 0)},
    # OLMoE clamps q, k and v to ±clip_qkv where it is set (OLMo 1 did; OLMoE-1B-7B does not).
    "olmoe": {"attention_bias": (None, False), "clip_qkv": (None,)},
    "gpt2": {"activation_function": (None, "gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (None, True),
             "scale_attn_by_inverse_layer_idx": (None, False), "add_cross_attention": (None, False)},
}
_LLAMA_FIXED = {"hidden_act": (None, "silu", "swish"), "attention_dropout": (None, 0, 0.0),
                "partial_rotary_factor": (None, 1, 1.0), "quantization_config": (None,)}
# The RoPE parameters each rope_type reads, by meshfit field.
_ROPE_KEYS = {"default": {}, "linear": {"factor": "rope_factor"},
              "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                         "high_freq_factor": "rope_high_freq_factor",
                         "original_max_position_embeddings": "rope_original_max_seq_len"}}


class _Fields:
    """The config.json's fields, read with the file's name in every error."""

    def __init__(self, cfg: dict[str, Any], path: Path) -> None:
        self.cfg, self.path = cfg, path

    def need(self, *keys: str) -> Any:
        for key in keys:
            if self.cfg.get(key) is not None:
                return self.cfg[key]
        raise ValueError(f"{self.path}: missing field {' or '.join(repr(k) for k in keys)} for model_type "
                         f"{self.cfg.get('model_type')!r}")

    def get(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key)
        return default if value is None else value

    def refuse(self, field: str, value: Any, why: str) -> ValueError:
        return ValueError(f"{self.path}: {field}={value!r} is not modelled by meshfit: {why}")

    def check_fixed(self, table: dict[str, tuple[Any, ...]]) -> None:
        for key, valid in table.items():
            value = self.cfg.get(key)
            if not any(value == v and type(value) is type(v) or value is v for v in valid):
                shown = ", ".join(repr(v) for v in valid if v is not None) or "absent or null"
                raise self.refuse(key, value, f"meshfit's block computes {shown}")


def _rope(f: _Fields) -> dict[str, Any]:
    """rope_theta and the scaling's ModelConfig fields, from either spelling."""
    params = f.cfg.get("rope_parameters")
    spelling, spec = ("rope_parameters", params) if isinstance(params, dict) else ("rope_scaling",
                                                                                 f.cfg.get("rope_scaling"))
    spec = spec or {}
    if not isinstance(spec, dict):
        raise f.refuse(spelling, spec, "expected an object of RoPE parameters or null")
    theta = spec.get("rope_theta", f.get("rope_theta", 10000.0))
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind not in _ROPE_KEYS:
        raise f.refuse(f"{spelling}.rope_type", kind, f"modelled RoPE types: {', '.join(_ROPE_KEYS)}")
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": "none" if kind == "default" else kind}
    for key, value in spec.items():
        if key in ("rope_type", "type", "rope_theta"):
            continue
        if key == "partial_rotary_factor" and value in (1, 1.0):
            continue
        if key not in _ROPE_KEYS[kind]:
            raise f.refuse(f"{spelling}.{key}", value, f"RoPE type {kind!r} reads "
                           f"{', '.join(_ROPE_KEYS[kind]) or 'no parameters besides rope_theta'}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{f.path}: {spelling}.{key}={value!r} must be a number")
        field = _ROPE_KEYS[kind][key]
        fields[field] = value if field == "rope_original_max_seq_len" else float(value)
    missing = [key for key in _ROPE_KEYS[kind] if _ROPE_KEYS[kind][key] not in fields]
    if missing:
        raise ValueError(f"{f.path}: {spelling} of type {kind!r} lacks {', '.join(missing)}")
    return fields


def _window(f: _Fields, kind: str, n_layers: int) -> int | None:
    """The attention window some layer slides, or None where every layer attends to the whole prefix."""
    if kind in ("mistral", "mixtral"):
        return f.cfg.get("sliding_window")
    if kind not in ("qwen2", "qwen3", "qwen3_moe"):
        return None
    layer_types = f.cfg.get("layer_types")
    if isinstance(layer_types, list):  # transformers 5 spells out each layer's kind
        windowed = "sliding_attention" in layer_types
    else:
        windowed = bool(f.cfg.get("use_sliding_window")) and f.get("max_window_layers", 28) < n_layers
    return f.need("sliding_window") if windowed else None


def _head_dim(f: _Fields, kind: str, dim: int, heads: int) -> int | None:
    """The explicit head width, or None where it is dim / heads (the one spelling presets compare with)."""
    head_dim = f.cfg.get("head_dim", 128 if kind == "qwen3" else None)  # Qwen3Config's default
    if head_dim is None or (dim % heads == 0 and head_dim == dim // heads):
        return None
    return head_dim


def _moe(f: _Fields, kind: str) -> dict[str, Any]:
    """The Mixture-of-Experts fields of a Mixtral or Qwen3-MoE config.json (transformers' defaults where a
    field is absent); {} for the dense families."""
    if kind == "mixtral":  # every layer sparse; softmax top-k renormalised (MixtralTopKRouter)
        return {"moe_experts": f.get("num_local_experts", 8), "moe_top_k": f.get("num_experts_per_tok", 2),
                "moe_ffn_hidden": f.need("intermediate_size"),
                "moe_aux_loss_coeff": float(f.get("router_aux_loss_coef", 0.001))}
    if kind == "olmoe":  # every layer sparse, experts intermediate_size wide; softmax top-k not renormalised
        return {"moe_experts": f.get("num_experts", 64), "moe_top_k": f.get("num_experts_per_tok", 8),
                "moe_norm_topk": bool(f.get("norm_topk_prob", False)),
                "moe_aux_loss_coeff": float(f.get("router_aux_loss_coef", 0.01))}
    if kind != "qwen3_moe":
        return {}
    # mlp_only_layers keep the dense MLP (intermediate_size): meshfit models the first n layers dense.
    dense = f.get("mlp_only_layers", [])
    if not isinstance(dense, list) or dense != list(range(len(dense))):
        raise f.refuse("mlp_only_layers", dense, "meshfit keeps the first model.moe_dense_layers layers dense: "
                       "give [] or [0, 1, ..., n-1]")
    return {"moe_experts": f.get("num_experts", f.get("num_local_experts", 128)),
            "moe_top_k": f.get("num_experts_per_tok", 8), "moe_ffn_hidden": f.get("moe_intermediate_size", 768),
            "moe_dense_layers": len(dense), "moe_norm_topk": bool(f.get("norm_topk_prob", False)),
            "moe_aux_loss_coeff": float(f.get("router_aux_loss_coef", 0.001))}


def _olmoe_heads(f: _Fields, dim: int, heads: int) -> None:
    # OLMoE's q and k norms are sized from hidden_size / heads whatever head_dim says: another head_dim
    # gives transformers' model mismatched shapes.
    head_dim = f.cfg.get("head_dim")
    if dim % heads or head_dim not in (None, dim // heads):
        raise f.refuse("head_dim" if head_dim is not None else "hidden_size", head_dim or dim,
                       f"OLMoE's heads are hidden_size / num_attention_heads wide (num_attention_heads={heads})")


def _llama(f: _Fields, kind: str) -> ModelConfig:
    f.check_fixed({**_LLAMA_FIXED, **_FIXED[kind]})
    dim, heads, layers = f.need("hidden_size"), f.need("num_attention_heads"), f.need("num_hidden_layers")
    if kind == "olmoe":
        _olmoe_heads(f, dim, heads)
    kv_heads = f.get("num_key_value_heads", heads) if kind in ("llama", "olmoe") else f.need("num_key_value_heads")
    return ModelConfig(
        family="llama", dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
        vocab_size=f.need("vocab_size"), ffn_hidden=f.need("intermediate_size"),
        max_seq_len=f.need("max_position_embeddings"), tie_embeddings=bool(f.get("tie_word_embeddings", False)),
        norm_eps=float(f.get("rms_norm_eps", 1e-6)), head_dim=_head_dim(f, kind, dim, heads),
        qkv_bias=kind == "qwen2", qk_norm=kind in ("qwen3", "qwen3_moe", "olmoe"),
        qk_norm_scope="projection" if kind == "olmoe" else "head", sliding_window=_window(f, kind, layers),
        **_rope(f), **_moe(f, kind),
    )


def _gpt2(f: _Fields) -> ModelConfig:
    f.check_fixed(_FIXED["gpt2"])
    dim = f.need("n_embd", "hidden_size")
    heads = f.need("n_head", "num_attention_heads")
    # meshfit's GPT block drops out with one probability everywhere.
    drops = {key: f.get(key, 0.1) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(drops.values())) > 1:
        raise f.refuse("attn_pdrop", drops["attn_pdrop"], "meshfit's GPT block drops out with one probability "
                       f"everywhere; here resid_pdrop={drops['resid_pdrop']}, embd_pdrop={drops['embd_pdrop']}")
    return ModelConfig(
        family="gpt", dim=dim, n_layers=f.need("n_layer", "num_hidden_layers"), n_heads=heads,
        n_kv_heads=heads, vocab_size=f.need("vocab_size"), ffn_hidden=f.get("n_inner", 4 * dim),
        max_seq_len=f.need("n_positions", "max_position_embeddings"),
        tie_embeddings=bool(f.get("tie_word_embeddings", True)), dropout=float(drops["resid_pdrop"]),
        norm_eps=float(f.get("layer_norm_epsilon", 1e-5)),
    )


def model_from_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face ``config.json``; raises ValueError naming the file and what is wrong."""
    path = Path(path)
    cfg = read_json_object(path, "file", "give the path of a Hugging Face config.json")
    kind = cfg.get("model_type")
    fields = _Fields(cfg, path)
    if kind in LLAMA_TYPES:
        model = _llama(fields, kind)
    elif kind in GPT_TYPES:
        model = _gpt2(fields)
    else:
        raise ValueError(f"{path}: model_type {kind!r} is not supported; supported: "
                         f"{', '.join(LLAMA_TYPES + GPT_TYPES)} (Llama-, Mistral-, Mixtral-, Qwen-, OLMoE- and "
                         "GPT-2-style decoders)")
    try:
        model.validate()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return model


def hf_config_file(init_from: str | Path) -> Path | None:
    """The config.json that describes model.init_from's model: the folder's own; None for one weights file
    (its shape comes from the model section). ValueError for a folder without one."""
    path = Path(init_from)
    if not path.is_dir():
        return None
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"model.init_from={path}: the folder has no {CONFIG_FILE}, which says what model its "
                         "weights are (give a Hugging Face model folder, or the folder `meshfit export` wrote)")
    return path / CONFIG_FILE
