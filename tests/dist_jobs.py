"""Functions that run on every rank of a multi-process test (importable by spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshfit.config import config_from_dict, load_config
from meshfit.train.dist import init_distributed
from meshfit.train.trainer import train

# A small llama-family model and synthetic data: one step is well under a second on one core.
PARITY_BASE = ["model.preset=tiny", "train.steps=10", "train.global_batch=8", "train.seq_len=64",
               "train.lr=3e-3", "train.warmup_steps=2", "train.seed=7"]


def parity_config(*overrides: str) -> dict[str, Any]:
    return load_config(None, [*PARITY_BASE, *overrides]).model_dump()


def train_job(cfg_dict: dict[str, Any], run_dir: str | None = None) -> dict[str, Any]:
    """Train on this rank (the process group is already up) and return the run's result."""
    cfg = config_from_dict(cfg_dict)
    env = init_distributed(cfg.train.device)
    return train(cfg, env, Path(run_dir) if run_dir else None)


def resume_job(cfg_dict: dict[str, Any], root: str) -> dict[str, Any]:
    """10 uninterrupted steps (root/full), then 5 steps + resume + 5 steps (root/split), on these ranks."""
    cfg = config_from_dict(cfg_dict)
    env = init_distributed(cfg.train.device)
    full = train(cfg, env, Path(root) / "full")
    stopped = train(cfg.model_copy(update={"train": cfg.train.model_copy(update={"stop_after": 5})}), env,
                    Path(root) / "split")
    resumed_cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})
    resumed = train(resumed_cfg, env, Path(root) / "split")
    return {"full": full, "first": stopped, "second": resumed}


def resume_layouts_job(cfg_dicts: dict[str, dict[str, Any]], root: str) -> dict[str, Any]:
    """resume_job for several layouts of the same world size, one after the other on these ranks."""
    return {name: resume_job(cfg, f"{root}/{name}") for name, cfg in cfg_dicts.items()}


def nonfinite_cases_job(cases: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    return [nonfinite_job(cfg, fault) for cfg, fault in cases]


def nonfinite_job(cfg_dict: dict[str, Any], fault: str) -> dict[str, Any]:
    """Train 4 steps with `fault` injected in step 3; returns what each step did and whether the parameters
    after a refused step equal those before it."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from meshfit.train.faults import Faults
    from meshfit.train.guard import NonFiniteError, StepGuard
    from meshfit.train.run import build_run
    from meshfit.train.trainer import train_step

    cfg = config_from_dict(cfg_dict)
    env = init_distributed(cfg.train.device)
    run = build_run(cfg, env, None)
    guard = StepGuard(run, Faults(env.rank, {"MESHFIT_FAULT": fault}), None, None)

    def params() -> dict[str, torch.Tensor]:
        return get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True))

    out: dict[str, Any] = {"records": [], "error": None, "unchanged": None}
    for _ in range(4):
        before = {k: v.clone() for k, v in params().items()}
        try:
            record = train_step(run, guard)
        except NonFiniteError as exc:
            out["error"], out["error_step"] = str(exc), run.step + 1
            out["unchanged"] = all(torch.equal(before[k], v) for k, v in params().items())
            return out
        if record.get("skipped"):
            out["unchanged"] = all(torch.equal(before[k], v) for k, v in params().items())
        out["records"].append({k: record.get(k) for k in ("step", "loss", "skipped")})
    return out


def stash_job(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-2 under mixed precision: what the gradient stash holds between micro-batches, and how far the
    accumulated gradients are from those of the same micro-batches accumulated in fp32 (no stash)."""
    import torch
    from torch.distributed.tensor import DTensor

    from meshfit.train.run import build_run
    from meshfit.train.trainer import _micro_step

    cfg = config_from_dict(cfg_dict)
    env = init_distributed(cfg.train.device)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    out: dict[str, Any] = {}
    grads = {}
    for name in ("stash", "fp32"):
        run = build_run(cfg, env, None)
        if name == "fp32":
            run.stash = None
        else:
            out["has_stash"] = run.stash is not None
        if run.stash is not None:
            stash = run.stash.stash

            def counted(stash=stash, run=run):  # how many shards the hook took during backward itself
                out.setdefault("stashed_during_backward", len(run.stash.acc))
                return stash()
            run.stash.stash = counted
        parts = run.local_batch(*run.batches.next_batch()).split(run.shape.micro_batch)
        for i, part in enumerate(parts):
            _micro_step(run, part, sync=(i == len(parts) - 1), scale=None)
            if i == 0 and name == "stash":
                params = run.stash.params  # the sharded parameters (the module holds gathered ones now)
                out["grads_after_first"] = sum(p.grad is not None for p in params)
                out["stash_tensors"] = len(run.stash.acc)
                out["stash_dtypes"] = sorted({str(a.dtype) for a in run.stash.acc.values()})
                out["stash_bytes"] = sum(a.numel() * a.element_size() for a in run.stash.acc.values())
                out["shard_elements"] = sum(local(p).numel() for p in params)
        grads[name] = torch.cat([local(p.grad).flatten().float() for p in run.model.parameters()])
        out[f"{name}_grad_dtype"] = str(next(run.model.parameters()).grad.dtype)
    diff = (grads["stash"] - grads["fp32"]).norm() / grads["fp32"].norm()
    out["relative_difference"] = float(diff)
    return out


def announced_save_job(cfg_dict: dict[str, Any], run_dir: str) -> str:
    """Train with every checkpoint save announced (thresholds at zero); returns what rank 0 printed."""
    import contextlib
    import io

    from meshfit.train import checkpoint

    checkpoint.ANNOUNCE_BYTES, checkpoint.ANNOUNCE_S = 0, 0.0
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        train_job(cfg_dict, run_dir)
    return printed.getvalue()


def ddp_buffers_job() -> dict[str, Any]:
    """Wrap a module with a buffer in meshfit's DDP on these ranks; each rank then writes its rank into the
    buffer and runs a forward and backward. Returns the warnings DDP raised and the buffer afterwards."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn

    from meshfit.parallel.data_parallel import apply_ddp
    from meshfit.parallel.dims import ParallelDims

    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("table", torch.zeros(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) + self.table.sum()

    meshes = ParallelDims(dp_replicate=dist.get_world_size(), dp_shard=1, tp=1, pp=1).build_mesh("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = apply_ddp(WithBuffer(), meshes)
    model.module.table.fill_(float(dist.get_rank()))
    model(torch.ones(2, 4)).sum().backward()
    return {"warnings": [str(w.message) for w in caught], "buffer": model.module.table.tolist()}


def peaks_job(cfg_dicts: list[dict[str, Any]]) -> list[int]:
    """Train each config in turn on these ranks; every run's peak (bytes, most-loaded rank)."""
    peaks = []
    for cfg_dict in cfg_dicts:
        cfg = config_from_dict(cfg_dict)
        peaks.append(train(cfg, init_distributed(cfg.train.device), None)["peak_mem_bytes"])
    return peaks


def init_from_job(cfg_dicts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Build each run (model.init_from set) on these ranks; return what each rank read and the block of
    every full tensor that each of its parameters holds."""
    from torch.distributed.tensor import DTensor

    from meshfit.models.init import canonical_name, local_region
    from meshfit.train.run import build_run

    out = {}
    for case, cfg_dict in cfg_dicts.items():
        cfg = config_from_dict(cfg_dict)
        run = build_run(cfg, init_distributed(cfg.train.device), None)
        blocks = []
        for module in (list(run.model) if run.pipe else [run.model]):
            for raw, param in module.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                offsets, _ = local_region(param)
                # numpy: a tensor would travel to the test process in shared memory, gone when the rank exits
                blocks.append((canonical_name(raw, run.shape.model), offsets, local.detach().numpy().copy()))
        out[case] = {"bytes_read": run.init_from.bytes_read, "blocks": blocks}
    return out


def train_layouts_job(cfg_dicts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """train_job for several layouts of the same world size, one after the other on these ranks."""
    return {name: train_job(cfg) for name, cfg in cfg_dicts.items()}


def moe_steps_job(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Train cfg's steps (no run folder); the losses, gradient norms, tokens per expert (every layer's, in the
    records), the expert biases afterwards of the layers this rank holds ({layer: bias}), and each expert
    weight's (global shape, shape held here)."""
    from torch.distributed.tensor import DTensor

    from meshfit.models.moe import MoE
    from meshfit.models.moe_stats import moe_blocks
    from meshfit.parallel.compile import compiled_blocks
    from meshfit.train.run import build_run
    from meshfit.train.trainer import train_step

    cfg = config_from_dict(cfg_dict)
    run = build_run(cfg, init_distributed(cfg.train.device), None)
    records = [train_step(run) for _ in range(cfg.train.steps)]
    moes = [m for m in run.model.modules() if isinstance(m, MoE)]
    shapes = {name: (tuple(p.shape), tuple((p.to_local() if isinstance(p, DTensor) else p).shape))
              for m in moes for name, p in m.experts.named_parameters()}
    return {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records],
            "tokens": [r["moe_tokens_max"] for r in records], "shapes": shapes,
            "aux_losses": [r["moe_aux_loss"] for r in records], "compiled": compiled_blocks(run.model),
            "dropped": sum(r["moe_dropped_tokens"] for r in records),
            "biases": {layer: m.router.expert_bias.tolist() for layer, m in moe_blocks(run.model)},
            "moe_layers": records[-1]["moe_layers"]}


def moe_layouts_job(cfg_dicts: dict[str, dict[str, Any]],
                    resume: tuple[dict[str, Any], dict[str, Any], str] | None = None) -> dict[str, Any]:
    """moe_steps_job for each layout on these ranks; with `resume` (a, b, folder): then the first 5 steps
    under config a, saved in the folder, and the rest resumed there under config b (losses: "resumed").
    a or b None: that part runs in another launch (another world size), this one runs the other."""
    out: dict[str, Any] = {name: moe_steps_job(cfg) for name, cfg in cfg_dicts.items()}
    if resume is not None:
        losses: list[float] = []
        if resume[0] is not None:
            first = config_from_dict(resume[0])
            stop = first.model_copy(update={"train": first.train.model_copy(update={"stop_after": 5})})
            losses += train(stop, init_distributed(first.train.device), Path(resume[2]))["losses"]
        if resume[1] is not None:
            second = config_from_dict(resume[1])
            again = second.model_copy(update={"checkpoint": second.checkpoint.model_copy(update={"resume": True})})
            losses += train(again, init_distributed(second.train.device), Path(resume[2]))["losses"]
        out["resumed"] = losses
    return out
