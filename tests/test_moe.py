"""The Mixture-of-Experts block: grouped and per-expert kernels agree, capacity drops and counts, routing
modes, the load-balancing loss, the expert-bias hook, exact parameter counts, and refused settings."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from meshfit.commands.main import main
from meshfit.config import ConfigError, load_config
from meshfit.layout.stage_split import layer_flops
from meshfit.models import (
    build_model,
    flops_per_token,
    get_preset,
    init_weights,
    num_params,
)
from meshfit.models.config import num_active_params
from meshfit.models.moe import MoE, load_balancing_loss
from meshfit.models.moe_stats import end_step, set_aux_loss_scale, uncounted
from meshfit.planner.memory.shares import _shares
from meshfit.train.metrics import tensorboard_scalars
from meshfit.train.shape import resolve_run

TINY = get_preset("tiny-moe")


def _block(**fields) -> MoE:
    cfg = dataclasses.replace(TINY, **fields)
    model = build_model(cfg, "cpu")
    init_weights(model, 0, cfg)
    return model.layers["1"].feed_forward.train()


def _run(block: MoE, kernel: str, x: torch.Tensor) -> list[torch.Tensor]:
    block.experts.kernel = kernel
    block.zero_grad()
    x = x.detach().clone().requires_grad_()
    y = block(x)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    return [y.detach(), x.grad, block.experts.w1.grad, block.experts.w2.grad, block.router.gate.weight.grad]


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_grouped_and_loop_kernels_agree(capacity: float | None) -> None:
    block = _block(moe_capacity_factor=capacity)
    x = torch.randn(2, 24, TINY.dim, generator=torch.Generator().manual_seed(1))
    assert block.experts._grouped(x.view(-1, TINY.dim), block.experts.w1, block.experts.w2, block.experts.w3)
    for a, b in zip(_run(block, "grouped", x), _run(block, "loop", x), strict=True):
        assert (a - b).abs().max().item() < 1e-6


def test_unaligned_widths_fall_back_to_the_loop() -> None:
    block = _block(moe_ffn_hidden=6)  # 24-byte rows: torch._grouped_mm refuses them
    x = torch.randn(48, TINY.dim)
    assert not block.experts._grouped(x, block.experts.w1, block.experts.w2, block.experts.w3)
    assert block(x.view(2, 24, -1)).shape == (2, 24, TINY.dim)


def test_capacity_drops_copies_and_counts_them() -> None:
    x = torch.randn(2, 32, TINY.dim, generator=torch.Generator().manual_seed(2))
    dropless, roomy, tight = _block(), _block(moe_capacity_factor=8.0), _block(moe_capacity_factor=0.25)
    with torch.no_grad():
        assert torch.equal(dropless(x), roomy(x))  # room for every copy: nothing dropped, same output
        assert not torch.allclose(dropless(x), tight(x))
    tight(x)
    counts = tight.counted
    capacity = -(-0.25 * 64 * 2 // 8)  # ceil(factor · tokens · k / experts) = 4 per expert
    kept = torch.clamp(counts["tokens"], max=capacity).sum()
    assert counts["dropped"].item() == counts["tokens"].sum().item() - kept.item() > 0


def test_balanced_routing_loads_every_expert_equally_and_the_aux_loss_is_its_coefficient() -> None:
    block = _block()
    block.router.balanced = True
    block(torch.randn(1, 32, TINY.dim))
    assert block.counted["tokens"].tolist() == [8.0] * 8  # 64 copies over 8 experts
    # Switch/GShard: E · Σ f_e P_e = Σ P_e = 1 when f_e = 1/E, whatever the scores.
    assert block.counted["aux_loss"].item() == pytest.approx(TINY.moe_aux_loss_coeff, rel=1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_the_aux_loss_trains_in_the_block_with_the_loss_scale(scale: float) -> None:
    # The router's gradient with the auxiliary loss on is the one without it plus scale · d(aux)/d(router),
    # and the block's output is the same: the loss trains where the block is, as if added to the step's loss.
    x = torch.randn(2, 16, TINY.dim, generator=torch.Generator().manual_seed(3))
    g = torch.randn(2, 16, TINY.dim, generator=torch.Generator().manual_seed(4))
    on, off = _block(moe_aux_loss_coeff=0.5), _block(moe_aux_loss_coeff=0.0)
    set_aux_loss_scale(torch.nn.ModuleList([on]), scale)
    outs = []
    for block in (on, off):
        y = block(x)
        (y * g).sum().backward()
        outs.append(y.detach())
    assert torch.equal(outs[0], outs[1])
    scores, _, _ = on.router(x.view(-1, TINY.dim))
    demand = on.counted["tokens"]
    (aux_grad,) = torch.autograd.grad(load_balancing_loss(scores, demand) * 0.5, on.router.gate.weight)
    expected = off.router.gate.weight.grad + scale * aux_grad
    assert aux_grad.abs().max() > 1e-4
    assert (on.router.gate.weight.grad - expected).abs().max().item() < 1e-6


def test_a_forward_uncounted_counts_nothing() -> None:
    block = _block()
    with uncounted(torch.nn.ModuleList([block])):
        block(torch.randn(1, 16, TINY.dim))
    assert block.counted == {}
    block(torch.randn(1, 16, TINY.dim))
    assert block.counted["micro_batches"].item() == 1


def test_expert_bias_favours_the_underloaded_experts_once_per_step() -> None:
    block = _block(moe_bias_update_rate=0.1)
    block.router.balanced = False
    block(torch.randn(1, 32, TINY.dim))
    load = block.counted["tokens"].clone()
    seen = []
    counts = end_step(torch.nn.ModuleList([block]), reduce_sum=lambda t: seen.append(t.clone()) or t.mul_(2))
    assert len(seen) == 1 and counts.tokens[0].tolist() == (2 * load).tolist()  # the ranks' sum is what counts
    assert torch.equal(block.router.expert_bias, 0.1 * torch.sign(load.mean() - load))
    assert block.counted == {}  # restarted
    assert end_step(torch.nn.ModuleList([block])) is None  # nothing counted since


def test_a_stage_holding_some_blocks_sums_every_layer_with_the_other_stages() -> None:
    # Two pipeline stages, each holding one MoE layer of three: the sum over the stages gives every layer's
    # counts to both (a stage without any block takes part with zeros), and each moves its own bias only.
    first, second = _block(moe_bias_update_rate=0.1), _block(moe_bias_update_rate=0.1)
    for block in (first, second):
        block(torch.randn(1, 32, TINY.dim))
    rows = {}

    def stages(name):
        def add(t):
            rows[name] = t.clone()
            if len(rows) == 3:  # the last stage to call adds everyone's rows (an all-reduce's outcome)
                t.copy_(sum(rows.values()))
        return add
    loads = [first.counted["tokens"].clone(), second.counted["tokens"].clone()]
    cut = lambda block, layer: torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({str(layer): torch.nn.ModuleDict({"mlp": block})})})
    none = torch.nn.Linear(1, 1)
    end_step(none, stages("none"), layers=[1, 2, 3], experts=8)
    end_step(cut(first, 1), stages("first"), layers=[1, 2, 3], experts=8)
    counts = end_step(cut(second, 3), stages("second"), layers=[1, 2, 3], experts=8)
    assert counts.layers == [1, 2, 3] and counts.tokens[0].tolist() == loads[0].tolist()
    assert counts.tokens[1].sum().item() == 0 and counts.tokens[2].tolist() == loads[1].tolist()
    assert torch.equal(second.router.expert_bias, 0.1 * torch.sign(loads[1].mean() - loads[1]))
    assert torch.equal(first.router.expert_bias, 0.1 * torch.sign(loads[0].mean() - loads[0]))


def test_a_recomputed_forward_counts_nothing_twice() -> None:
    block = _block()
    x = torch.randn(1, 16, TINY.dim, requires_grad=True)
    # The whole forward runs again (by default recompute stops at the last saved tensor, before the counting).
    with set_checkpoint_early_stop(False):
        checkpoint(block, x, use_reentrant=False).sum().backward()
    assert block.counted["tokens"].sum().item() == 16 * TINY.moe_top_k
    assert block.counted["micro_batches"].item() == 1


def test_step_record_and_tensorboard_scalars() -> None:
    block = _block()
    block(torch.randn(1, 16, TINY.dim))
    rec = end_step(torch.nn.ModuleList([block])).record()
    assert rec["moe_dropped_tokens"] == 0 and len(rec["moe_load"]) == 1 and rec["moe_load"][0] >= 1.0
    scalars = tensorboard_scalars({"loss": 1.0, "grad_norm": 1.0, "lr": 1.0, "tokens_per_s": 1.0,
                                   "step_time_s": 1.0, "peak_mem_bytes": 0, **rec})
    assert scalars["moe/max_load"] == rec["moe_load"][0] and "moe/aux_loss" in scalars


@pytest.mark.parametrize("name", ["tiny-moe", "small-moe"])
def test_parameter_counts_are_the_built_models(name: str) -> None:
    cfg = get_preset(name)
    model = build_model(cfg, "meta")
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)]
    unused = sum(e.w1.numel() + e.w2.numel() + e.w3.numel() for e in experts) * (1 - cfg.moe_top_k / cfg.moe_experts)
    assert num_active_params(cfg) == num_params(cfg) - unused
    assert flops_per_token(cfg, 64) < flops_per_token(dataclasses.replace(cfg, moe_top_k=cfg.moe_experts), 64)
    assert _shares(cfg, 64, 1, 1, 1, False)[0].params == num_params(cfg)  # the planner's states count


def test_the_stage_split_weighs_a_moe_block_by_its_active_experts() -> None:
    # Every expert active and no dense block: the block computes as a dense SwiGLU as wide as all its
    # experts together, plus the router's matmul.
    every = dataclasses.replace(TINY, moe_dense_layers=0, moe_top_k=TINY.moe_experts)
    wide = dataclasses.replace(TINY, moe_experts=None, moe_dense_layers=0,
                               ffn_hidden=TINY.moe_experts * TINY.moe_hidden)
    assert layer_flops(every, 64) == layer_flops(wide, 64) + 2 * TINY.dim * TINY.moe_experts
    # The first block dense: the mean of its cost and the MoE blocks' stands for each block.
    dense = dataclasses.replace(TINY, moe_experts=None, moe_dense_layers=0)
    moe = dataclasses.replace(TINY, moe_dense_layers=0)
    assert layer_flops(TINY, 64) == pytest.approx((layer_flops(dense, 64) + layer_flops(moe, 64)) / 2)


@pytest.mark.parametrize("overrides, needle", [
    (["model.moe_top_k=9"], "model.moe_top_k=9 exceeds model.moe_experts=8"),
    (["model.moe_capacity_factor=0"], "model.moe_capacity_factor=0.0 must be > 0"),
    (["model.moe_capacity_factor=-1"], "model.moe_capacity_factor=-1.0 must be > 0"),
    (["model.moe_experts=0"], "model.moe_experts=0 must be a positive integer"),
    (["model.moe_ffn_hidden=0"], "model.moe_ffn_hidden=0 must be a positive integer"),
    (["model.preset=tiny-gpt", "model.moe_experts=4"], "model.moe_experts=4: family 'gpt' has no"),
    (["model.preset=tiny-gpt", "model.moe_top_k=4"], "model.moe_top_k=4: family 'gpt' has no"),
    (["model.preset=tiny", "model.moe_score=sigmoid"], "model.moe_score='sigmoid': it applies to Mixture"),
    (["model.moe_score=relu"], "model.moe_score='relu'; valid: softmax, sigmoid"),
    # Pipelines take Mixture-of-Experts models; the pipeline's own rules still hold.
    (["parallel.pp=2", "pipeline.schedule=interleaved-1f1b"], "= 2 × 2 = 4 stages, but the model has 2 layers"),
    (["parallel.tp=2", "model.qk_norm=true", "model.qk_norm_scope=projection"],
     "parallel.tp=2: the model's q/k norms normalise the whole projections"),
    (["parallel.tp=2", "parallel.ep=2"], "parallel.ep=2 must divide parallel.dp_shard × parallel.cp = 1 × 1"),
    (["parallel.cp=2", "train.seq_len=30"], "parallel.cp=2 cuts each sequence into 2·cp = 4 equal chunks"),
    (["parallel.ep=3"], "parallel.ep=3 must divide parallel.dp_shard × parallel.cp = 2 × 1"),
    (["model.moe_experts=3", "parallel.ep=2"], "parallel.ep=2 must divide model.moe_experts=3"),
    (["parallel.ep=2", "parallel.zero_stage=0"], "parallel.ep=2 must divide parallel.dp_shard × parallel.cp = 1 × 1"),
    (["parallel.ep=2", "parallel.offload=true"], "parallel.ep=2 does not support parallel.offload"),
    (["model.preset=tiny", "parallel.ep=2"], "parallel.ep=2 splits Mixture-of-Experts experts, but the model"),
])
def test_bad_settings_are_one_line_naming_the_field(overrides: list[str], needle: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    argv = ["model.preset=tiny-moe", "train.seq_len=64", "train.global_batch=4", *overrides]
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        resolve_run(load_config(None, argv), 2)
    sets = [a for o in argv for a in ("--set", o)]
    assert main(["train", "--nproc", "2", *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_plan_leaves_moe_blocks_whole(sp: bool) -> None:
    # tiny-moe: block 0 dense (its MLP split by tp), block 1 a MoE block (router and experts whole).
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from meshfit.parallel.tensor_parallel import tp_plan

    plan = tp_plan(TINY, sp=sp, loss_parallel=False)
    assert {"layers.0.feed_forward.w1", "layers.0.feed_forward.w3", "layers.1.attention.wq"} <= plan.keys()
    assert not any(name.startswith("layers.1.feed_forward.") for name in plan)
    moe_input = plan.get("layers.1.feed_forward")
    # Under sequence parallelism the block takes this rank's slice as a plain tensor (no gather).
    assert (moe_input is None) if not sp else (isinstance(moe_input, PrepareModuleInput)
                                               and moe_input.use_local_output
                                               and moe_input.desired_input_layouts == moe_input.input_layouts)


def test_planner_proposes_tp_cp_and_pp_for_moe_models() -> None:
    # The memory model keeps the MoE MLP whole on every tp rank (tests/test_moe_planner.py checks it against
    # dry runs), so the search proposes every degree for MoE models as for dense ones.
    from meshfit.hardware.catalog import Cluster
    from meshfit.layout.layout import Workload
    from meshfit.planner.search import enumerate_layouts

    node, work = Cluster("H100-SXM", nodes=1, gpus_per_node=8), Workload(seq_len=65536, global_batch=8)
    moe = {(lay.tp, lay.cp, lay.pp) for lay in enumerate_layouts(get_preset("small-moe"), work, node, micro_batch=1)}
    assert any(tp > 1 for tp, _, _ in moe) and any(cp > 1 for _, cp, _ in moe) and any(pp > 1 for _, _, pp in moe)