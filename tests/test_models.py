"""Tests for meshfit.models: sizes, forward semantics, and layout-independent init."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshfit.models import (
    GPT,
    PRESETS,
    Llama,
    ModelConfig,
    build_model,
    flops_per_token,
    get_preset,
    init_weights,
    num_params,
)

TINY = ("tiny", "tiny-gpt")


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # deduplicates tied weights


def built(name: str, seed: int = 0, cfg: ModelConfig | None = None) -> nn.Module:
    cfg = cfg or get_preset(name)
    model = build_model(cfg, "cpu")
    init_weights(model, seed, cfg)
    return model.eval()


def tokens(cfg: ModelConfig, b: int = 2, s: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt", "small", "small-gpt"])
def test_num_params_exact_on_built_cpu_model(name: str) -> None:
    cfg = get_preset(name)
    assert count(build_model(cfg, "cpu")) == num_params(cfg)


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_matches_meta_model_for_every_preset(name: str) -> None:
    cfg = get_preset(name)
    cfg.validate()
    assert count(build_model(cfg)) == num_params(cfg)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama3-1b", 1_235_814_400),
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
    ],
)
def test_llama3_presets_have_published_counts(name: str, expected: int) -> None:
    assert num_params(get_preset(name)) == expected


def test_gpt3_presets_have_published_sizes() -> None:
    assert 174.6e9 <= num_params(get_preset("gpt3-175b")) <= 175.2e9
    assert 124.5e6 <= num_params(get_preset("gpt3-125m")) <= 125.5e6
    for name in PRESETS:
        if name.startswith("gpt3-"):
            assert get_preset(name).head_size in (64, 80, 96, 128)


def test_meta_construction_of_70b_is_fast_and_allocates_nothing() -> None:
    start = time.perf_counter()
    model = build_model(get_preset("llama3-70b"))
    assert time.perf_counter() - start < 5.0
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


def test_flops_per_token_formula() -> None:
    cfg = get_preset("tiny")
    non_embedding = num_params(cfg) - cfg.vocab_size * cfg.dim  # untied: output head stays
    expected = 6 * non_embedding + 12 * cfg.n_layers * cfg.dim * 128
    assert flops_per_token(cfg, 128) == expected
    # The output matmul is counted whether or not its weight is tied.
    untied = ModelConfig(**{**get_preset("gpt3-125m").__dict__, "tie_embeddings": False})
    assert flops_per_token(untied, 2048) == flops_per_token(get_preset("gpt3-125m"), 2048)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("name", TINY)
def test_forward_shape(name: str) -> None:
    cfg = get_preset(name)
    logits = built(name)(tokens(cfg, b=3, s=11))
    assert logits.shape == (3, 11, cfg.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", TINY)
def test_forward_is_causal(name: str) -> None:
    cfg = get_preset(name)
    model = built(name)
    x = tokens(cfg, b=1, s=12)
    y = x.clone()
    y[0, 7] = (x[0, 7] + 1) % cfg.vocab_size
    with torch.no_grad():
        lx, ly = model(x), model(y)
    torch.testing.assert_close(lx[:, :7], ly[:, :7])
    assert not torch.allclose(lx[:, 7:], ly[:, 7:])


@pytest.mark.parametrize("name", TINY)
def test_sequence_longer_than_max_seq_len_is_rejected(name: str) -> None:
    cfg = ModelConfig(**{**get_preset(name).__dict__, "max_seq_len": 8})
    with pytest.raises(ValueError, match="max_seq_len"):
        built(name, cfg=cfg)(tokens(cfg, s=9))


def test_gqa_equals_mha_with_duplicated_kv_heads() -> None:
    gqa_cfg = get_preset("tiny")  # 4 query heads share 2 kv heads
    mha_cfg = ModelConfig(**{**gqa_cfg.__dict__, "n_kv_heads": gqa_cfg.n_heads})
    gqa, mha = built("tiny", cfg=gqa_cfg), built("tiny", seed=1, cfg=mha_cfg)
    n_rep, hd = gqa_cfg.n_heads // gqa_cfg.n_kv_heads, gqa_cfg.head_size
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # kv head j serves query heads j*n_rep .. j*n_rep+n_rep-1.
            state[key] = value.view(-1, hd, gqa_cfg.dim).repeat_interleave(n_rep, 0).reshape(-1, gqa_cfg.dim)
    mha.load_state_dict(state)
    x = tokens(gqa_cfg)
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x))


def _shard_linear(linear: nn.Linear, rows: slice | None = None, cols: slice | None = None) -> nn.Linear:
    weight = linear.weight[rows or slice(None), cols or slice(None)]
    bias = None
    if linear.bias is not None:
        bias = linear.bias[rows] if rows is not None else linear.bias / 2  # row-parallel: bias split in the sum
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


@pytest.mark.parametrize("name", TINY)
def test_attention_runs_on_tensor_parallel_shards(name: str) -> None:
    """Two head-sharded copies of attention sum to the full output (head counts come from shapes)."""
    cfg = get_preset(name)
    full = built(name).layers["0"].attention
    rope = (built(name).rope.cos, built(name).rope.sin) if cfg.family == "llama" else ()
    x = torch.randn(2, 10, cfg.dim)
    q_rows, kv_rows = cfg.n_heads * cfg.head_size // 2, cfg.n_kv_heads * cfg.head_size // 2
    total = 0
    for rank in range(2):
        shard = type(full)(cfg)
        q, kv = slice(rank * q_rows, (rank + 1) * q_rows), slice(rank * kv_rows, (rank + 1) * kv_rows)
        shard.wq, shard.wk, shard.wv = (_shard_linear(full.wq, q), _shard_linear(full.wk, kv), _shard_linear(full.wv, kv))
        shard.wo = _shard_linear(full.wo, cols=q)
        with torch.no_grad():
            total = total + shard.eval()(x, *rope)
    with torch.no_grad():
        torch.testing.assert_close(total, full.eval()(x, *rope), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", TINY)
def test_pipeline_stages_run_on_hidden_states(name: str) -> None:
    cfg = ModelConfig(**{**get_preset(name).__dict__, "n_layers": 3})
    full, first, last = built(name, cfg=cfg), built(name, cfg=cfg), built(name, cfg=cfg)
    x = tokens(cfg)
    # Stage 0: embeddings + layer 0; stage 1: layers 1, 2 + norm + output.
    del first.layers["1"], first.layers["2"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    if cfg.family == "gpt":
        last.pos_embeddings = None
    with torch.no_grad():
        hidden = first(x)
        assert hidden.shape == (2, 16, cfg.dim)
        torch.testing.assert_close(last(hidden), full(x))


# ---------------------------------------------------------------- init


@pytest.mark.parametrize("name", TINY)
def test_init_is_deterministic_and_ignores_global_rng(name: str) -> None:
    torch.manual_seed(1)
    a = built(name, seed=7)
    torch.manual_seed(2)
    torch.rand(100)
    b = built(name, seed=7)
    assert_same_state(a, b)
    c = built(name, seed=8)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


@pytest.mark.parametrize("name", TINY)
def test_meta_then_to_empty_matches_cpu_build(name: str) -> None:
    cfg = get_preset(name)
    model = build_model(cfg)
    model.to_empty(device="cpu")
    init_weights(model, 0, cfg)  # also recomputes the RoPE tables
    reference = built(name)
    assert_same_state(model, reference)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens(cfg)), reference(tokens(cfg)))


def test_init_values_follow_the_scheme() -> None:
    cfg = get_preset("small-gpt")
    model = built("small-gpt")
    layer = model.layers["0"]
    assert torch.equal(layer.attention_norm.weight, torch.ones(cfg.dim))
    assert torch.equal(layer.attention.wq.bias, torch.zeros(cfg.dim))
    assert abs(layer.attention.wq.weight.std().item() - 0.02) < 0.002
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert abs(layer.feed_forward.w2.weight.std().item() - residual_std) < 0.1 * residual_std
    # Different names draw different values even for equal shapes.
    assert not torch.equal(layer.attention.wq.weight, layer.attention.wk.weight)


def test_init_ignores_wrapper_prefixes() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu")
    model.layers["1"] = checkpoint_wrapper(model.layers["1"])
    parent = nn.Module()
    parent.module = nn.Module()
    parent.module._orig_mod = model
    assert any("_checkpoint_wrapped_module" in n for n, _ in parent.named_parameters())
    init_weights(parent, 0, cfg)
    reference = built("tiny")
    for name, param in reference.named_parameters():
        wrapped = name.replace("layers.1.", "layers.1._checkpoint_wrapped_module.")
        assert torch.equal(model.get_parameter(wrapped), param), name


@pytest.mark.parametrize("name", TINY)
def test_init_of_a_pipeline_stage_matches_the_full_model(name: str) -> None:
    cfg = get_preset(name)
    stage = build_model(cfg, "cpu")
    del stage.layers["0"]
    stage.tok_embeddings = None  # output.weight is now untied from any embedding
    init_weights(stage, 0, cfg)
    full = built(name)
    for key, value in stage.state_dict().items():
        assert torch.equal(value, full.state_dict()[key]), key


def test_init_casts_to_parameter_dtype() -> None:
    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu").to(torch.bfloat16)
    init_weights(model, 0, cfg)
    reference = built("tiny")
    torch.testing.assert_close(model.output.weight, reference.output.weight.to(torch.bfloat16))


def test_init_on_meta_parameters_is_rejected() -> None:
    cfg = get_preset("tiny")
    with pytest.raises(ValueError, match="to_empty"):
        init_weights(build_model(cfg), 0, cfg)


@pytest.fixture
def world1_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if created:
            dist.destroy_process_group()


def test_init_of_dtensor_parameters_equals_plain(world1_mesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = get_preset("tiny")
    model = build_model(cfg, "cpu")
    plan = {"tok_embeddings": RowwiseParallel(), "output": ColwiseParallel()}
    for i in model.layers:
        plan |= {
            f"layers.{i}.attention.wq": ColwiseParallel(),
            f"layers.{i}.attention.wk": ColwiseParallel(),
            f"layers.{i}.attention.wv": ColwiseParallel(),
            f"layers.{i}.attention.wo": RowwiseParallel(),
            f"layers.{i}.feed_forward.w1": ColwiseParallel(),
            f"layers.{i}.feed_forward.w3": ColwiseParallel(),
            f"layers.{i}.feed_forward.w2": RowwiseParallel(),
        }
    parallelize_module(model, world1_mesh, plan)
    init_weights(model, 0, cfg)
    reference = built("tiny")
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens(cfg)), reference(tokens(cfg)))
    # Replicated placement too.
    model.norm.weight = nn.Parameter(distribute_tensor(torch.zeros(cfg.dim), world1_mesh, [Replicate()]))
    init_weights(model, 0, cfg)
    placements = set()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) or "norm" in name, name
        if isinstance(param, DTensor):
            placements.add(param.placements[0])
            param = param.full_tensor()
        assert torch.equal(param, reference.get_parameter(name)), name
    assert {Shard(0), Shard(1), Replicate()} <= placements


@pytest.mark.parametrize("name", TINY)
def test_fsdp2_meta_materialization_matches_plain(world1_mesh, name: str) -> None:
    from torch.distributed.fsdp import fully_shard

    cfg = get_preset(name)
    model = build_model(cfg)
    for layer in model.layers.values():
        fully_shard(layer, mesh=world1_mesh)
    fully_shard(model, mesh=world1_mesh)
    model.to_empty(device="cpu")
    init_weights(model, 0, cfg)
    assert count(model) == num_params(cfg)  # tying survived sharding and to_empty
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens(cfg)), built(name)(tokens(cfg)))


# ---------------------------------------------------------------- tying


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tied_embeddings_share_storage(device: str) -> None:
    cfg = get_preset("tiny-gpt")
    model = build_model(cfg, device)
    if device == "meta":
        model.to_empty(device="cpu")  # must not untie
    init_weights(model, 0, cfg)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert count(model) == num_params(cfg)
    untied = build_model(get_preset("tiny"), "cpu")
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_build_model_returns_family_class() -> None:
    assert isinstance(build_model(get_preset("tiny")), Llama)
    assert isinstance(build_model(get_preset("tiny-gpt")), GPT)
    assert list(build_model(get_preset("small")).layers) == ["0", "1", "2", "3"]


# ---------------------------------------------------------------- validation


def _with(**changes) -> ModelConfig:
    return ModelConfig(**{**get_preset("tiny").__dict__, **changes})


@pytest.mark.parametrize(
    "cfg, pattern",
    [
        (_with(dim=64, n_heads=12, n_kv_heads=5), r"model\.dim=64 must be divisible by model\.n_heads=12; valid n_heads: 1, 2, 4, 8, 16, 32, 64"),
        (_with(dim=96, n_heads=12, n_kv_heads=5), r"model\.n_heads=12 must be divisible by model\.n_kv_heads=5; valid n_kv_heads: 1, 2, 3, 4, 6, 12"),
        (_with(dim=60, n_heads=4, n_kv_heads=4), r"model\.n_heads=4 .*head_dim=15.*valid n_heads: 1, 2, 3, 5, 6, 10, 15, 30"),
        (_with(family="bert"), r"model\.family='bert'.*valid family: llama, gpt"),
        (_with(vocab_size=0), r"model\.vocab_size=0 must be a positive integer"),
        (_with(n_layers=-1), r"model\.n_layers=-1 must be a positive integer"),
        (_with(dropout=0.1), r"model\.dropout=0\.1 must be 0\.0 for family 'llama'"),
        (_with(family="gpt", n_kv_heads=2), r"model\.n_kv_heads=2 must equal model\.n_heads=4.*valid n_kv_heads: 4"),
        (_with(family="gpt", dropout=1.5), r"model\.dropout=1\.5 must be in \[0, 1\)"),
        (_with(head_dim=0), r"model\.head_dim=0 must be a positive integer or null"),
        (_with(head_dim=15), r"model\.head_dim=15 must be even \(RoPE rotates pairs of channels\)"),
        (_with(sliding_window=-4), r"model\.sliding_window=-4 must be a positive integer or null"),
        (_with(qk_norm="yes"), r"model\.qk_norm='yes' must be true or false"),
        (_with(rope_scaling="yarn"), r"model\.rope_scaling='yarn'; valid: none, linear, llama3"),
        (_with(rope_scaling="linear"), r"model\.rope_scaling='linear' needs model\.rope_factor"),
        (_with(rope_scaling="linear", rope_factor=2.0, rope_original_max_seq_len=64),
         r"model\.rope_original_max_seq_len=64 applies to model\.rope_scaling llama3, not 'linear'; set it to null"),
        (_with(rope_factor=2.0), r"model\.rope_factor=2\.0 applies to model\.rope_scaling linear or llama3, not 'none'"),
        (_with(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=4.0, rope_high_freq_factor=1.0,
               rope_original_max_seq_len=64), r"model\.rope_low_freq_factor=4\.0 and model\.rope_high_freq_factor=1\.0 "
                                              r"must satisfy 0 < low < high"),
        (_with(family="gpt", n_kv_heads=4, qkv_bias=True),
         r"model\.qkv_bias=True applies to family 'llama' only; for family 'gpt' leave it false"),
    ],
)
def test_validate_names_field_and_valid_values(cfg: ModelConfig, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        cfg.validate()
    with pytest.raises(ValueError, match=pattern):
        build_model(cfg)


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'.*tiny, tiny-gpt.*llama3-405b"):
        get_preset("nope")


def test_padded_vocabulary_keeps_the_real_rows_and_masks_the_padding():
    import dataclasses

    from meshfit.models.config import pad_vocab_for_tp
    from meshfit.models.init import strip_padding
    from meshfit.models.loss import lm_loss

    cfg = dataclasses.replace(get_preset("tiny-gpt"), vocab_size=257)
    padded = pad_vocab_for_tp(cfg, 4)
    assert (padded.padded_vocab, pad_vocab_for_tp(padded, 2)) == (260, padded)  # 4 also serves tp = 2
    plain, wide = build_model(cfg, "cpu"), build_model(padded, "cpu")
    init_weights(plain, seed=3, cfg=cfg)
    init_weights(wide, seed=3, cfg=padded)
    table = wide.tok_embeddings.weight.detach()
    assert torch.equal(table[:257], plain.tok_embeddings.weight.detach()) and not table[257:].any()
    tokens = torch.randint(0, 257, (2, 16))
    loss_plain = lm_loss(plain(tokens), tokens, 257)
    loss_wide = lm_loss(wide(tokens), tokens, 257)
    assert torch.allclose(loss_plain, loss_wide, atol=1e-6)
    loss_wide.backward()
    assert not wide.tok_embeddings.weight.grad[257:].any()  # padded rows never learn
    stripped = strip_padding(dict(wide.named_parameters()), padded)
    assert stripped["tok_embeddings.weight"].shape[0] == 257
