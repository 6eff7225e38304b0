"""`meshfit train`: one rank, --nproc local ranks, a `meshfit plan --out` file, or the ranks of an
enclosing torchrun."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from meshfit.commands.flags import OVERSUBSCRIBE_HELP, default_run_dir, positive_int
from meshfit.config import ConfigError, load_config
from meshfit.train.capacity import check_local_ranks

NAME = "train"


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
    train = sub.add_parser("train", help="train a layout (one rank, --nproc local ranks, or under torchrun)",
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    train.add_argument("--config", metavar="FILE", help="TOML, YAML or JSON config with sections "
                       "model, parallel, train, data")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value (repeatable), e.g. --set train.steps=50")
    train.add_argument("--nproc", type=positive_int, metavar="N",
                       help="launch N local ranks through torchrun's machinery (default: one rank in this "
                            "process, or the ranks of an enclosing torchrun)")
    train.add_argument("--plan", type=Path, metavar="PLAN.json",
                       help="run the layout, model and workload of a `meshfit plan --out` file (--set still "
                            "applies on top, e.g. train.steps or train.device)")
    train.add_argument("--run-dir", type=Path, metavar="DIR",
                       help="where config.yaml, metrics.jsonl, result.json and checkpoints/ go "
                            "(default runs/train-<time>)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest complete checkpoint of --run-dir (or checkpoint.dir), "
                            "under this or any other layout; a damaged one is skipped for the one before; "
                            "with no checkpoint yet it says so and starts at step 0 (requeued jobs)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run already in --run-dir (its metrics, result, config and checkpoints "
                            "are deleted); without it such a start is refused")
    train.add_argument("--resume-from", type=Path, metavar="CHECKPOINT",
                       help="continue from exactly this step-N checkpoint folder (no fallback)")
    train.add_argument("--new-data", action="store_true",
                       help="with --resume/--resume-from: continue on other data than the checkpoint was saved "
                            "on (another data.path, or changed files); the metrics record what changed")
    train.add_argument("--oversubscribe", action="store_true", help=OVERSUBSCRIBE_HELP)
    train.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="with --nproc: restart every rank up to N times after a rank fails; each "
                            "restart resumes from the latest complete checkpoint (default 0)")
    return train


def run(args: argparse.Namespace) -> int:
    from meshfit.train.launch import launch, tell_torchrun, under_torchrun

    overrides, sections = args.overrides, None
    if args.plan:
        from meshfit.planner.planfile import plan_sections, read_plan

        try:
            parts = _plan_parts(read_plan(args.plan))
            sections = plan_sections(*parts)
        except ValueError as exc:
            raise ConfigError(f"--plan {exc}") from None
        world = parts[2].world_size
        if args.nproc is not None and args.nproc != world:
            raise ConfigError(f"--plan {args.plan} lays the model out over {world} ranks, but --nproc is "
                              f"{args.nproc}: use --nproc {world}, or plan for {args.nproc} GPUs")
        if world > 1 and args.nproc is None and not under_torchrun():
            raise ConfigError(f"--plan {args.plan} lays the model out over {world} ranks: add --nproc {world} "
                              f"(local ranks) or launch under torchrun with {world} processes in all")
    config = args.config
    if args.new_data:
        if not (args.resume or args.resume_from):
            raise ConfigError("--new-data continues a run on other data: give it with --resume or --resume-from")
        overrides = [*overrides, "checkpoint.new_data=true"]
    if args.resume or args.resume_from:
        overrides = [*overrides, "checkpoint.resume=true",
                     f"checkpoint.resume_from={args.resume_from if args.resume_from else 'null'}"]
        config = config or (None if args.plan else _own_config(args.run_dir))
    notes = [f"--resume: the run's own settings from {config} (--set changes them)"] \
        if config is not None and config != args.config else []
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be ≥ 0, got {args.max_restarts}")
    if args.nproc and args.nproc > 1 and not under_torchrun():
        check_local_ranks(args.nproc, args.oversubscribe)
    cfg = load_config(config, overrides, sections)
    if args.resume and not args.run_dir and not cfg.checkpoint.dir:
        raise ConfigError("--resume needs the run to continue: give its --run-dir (or checkpoint.dir)")
    run_dir = args.run_dir or default_run_dir("train")
    outcome = launch(cfg, run_dir, args.nproc, max_restarts=args.max_restarts, overwrite=args.overwrite,
                     notes=notes)
    if under_torchrun():
        if outcome.ok and os.environ.get("RANK") == "0":
            _report(outcome, cfg, run_dir, resume_command(run_dir, None, True))  # once for the job
        elif not outcome.ok:
            tell_torchrun(f"error: {outcome.message}")
        # Leave without interpreter teardown (gloo's teardown race); exit code tells torchrun the outcome.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if outcome.ok else 1)
    return _report(outcome, cfg, run_dir, resume_command(run_dir, args.nproc, False))


def _own_config(run_dir: Path | None) -> Path | None:
    """A resume given neither --config nor --plan continues with the settings the run itself recorded
    (RUN_DIR/config.yaml, the resolved config of its last start); --set still applies on top."""
    own = Path(run_dir) / "config.yaml" if run_dir else None
    if own is None or not own.is_file():
        return None
    return own


def _report(outcome: Any, cfg: Any, run_dir: Path, resume_hint: str) -> int:
    """Print how the run ended; the exit code: 0 finished or stopped by SIGTERM, 1 failed, 130 Ctrl-C."""
    if not outcome.ok:
        if outcome.failure is None and not outcome.began and (outcome.signal or _all_interrupted(outcome.exit_codes)):
            print(f"interrupted ({outcome.signal or 'SIGINT'}) before the first step ended; nothing was saved",
                  file=sys.stderr)
            return 130 if (outcome.signal or "SIGINT") == "SIGINT" else 0
        print(f"error: {outcome.message}", file=sys.stderr)
        return 1
    result = outcome.result
    for note in outcome.notes:
        print(note)
    if result.get("status") == "interrupted":
        signal_name = outcome.signal or result.get("signal") or "SIGTERM"
        saved = f"checkpoint {result['checkpoint']}" if result.get("checkpoint") else "no checkpoint (no step ended)"
        print(f"stopped by {signal_name} after step {result['end_step']}; {saved}; continue with "
              f"{resume_hint}")
        return 130 if signal_name == "SIGINT" else 0
    if result["steps"] == 0:
        print(f"nothing to do: the run is already at step {result['end_step']} of {cfg.train.steps}")
    else:
        print(f"done: steps {result['start_step'] + 1}–{result['end_step']}, final loss {result['final_loss']:.4f}; "
              f"metrics in {run_dir}/metrics.jsonl")
    return 0


def resume_command(run_dir: Path, nproc: int | None, torchrun: bool) -> str:
    """The command that continues a run, as it was started: the run's own config.yaml holds its settings
    (however they were given), so only the rank count is repeated. Under torchrun: torchrun's own
    command with --resume."""
    if torchrun:
        return f"--resume --run-dir {run_dir} in the same torchrun command"
    ranks = f" --nproc {nproc}" if nproc and nproc > 1 else ""
    return f"meshfit train --resume --run-dir {run_dir}{ranks}"


def _all_interrupted(codes: dict[int, int]) -> bool:
    return bool(codes) and set(codes.values()) <= {130, -2}


def _plan_parts(parts: tuple) -> tuple:
    model, _name, workload, layout = parts
    return model, workload, layout
