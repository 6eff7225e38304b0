"""Command line: `meshfit plan`, `meshfit verify`, `meshfit train`, `meshfit export` and `meshfit demo`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from meshfit.capacity import RANK_MIN_BYTES, RANKS_PER_CORE, check_local_ranks
from meshfit.config import ConfigError, load_config
from meshfit.names import did_you_mean
from meshfit.paths import PathError
from meshfit.plan_cli import add_plan_arguments, positive_int

_EPILOG = """\
examples:
  meshfit demo                                     the seed scenario on local CPU ranks
  meshfit plan --model llama3-70b --nodes 8 --seq-len 8192 --explain
  meshfit plan --model llama3-8b --layout dp_shard=8,zero_stage=3 --out plan.json
  meshfit verify --model llama3-8b --layout dp_shard=64,zero_stage=3 --seq-len 2048
  meshfit calibrate --nproc 2 --out hw.json        measure this machine for the planner
  meshfit plan --model small --gpu cpu --gpu-memory 80MiB --gpus-per-node 2 --hardware hw.json
  meshfit train --plan plan.json --nproc 8         run a plan (here: 8 local ranks)
  meshfit train --set model.preset=small --nproc 2 --set parallel.dp_replicate=2
  meshfit train --config run.toml --set train.steps=100 --run-dir runs/exp1
  meshfit train --config run.toml --run-dir runs/exp1 --resume --nproc 4   continue, any layout
  meshfit export runs/exp1 --out hf/exp1          latest checkpoint as HF safetensors
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m meshfit train --config run.toml           multi-node: one launch per node
"""


_OVERSUBSCRIBE = (f"start more local ranks than this machine holds ({RANKS_PER_CORE} per core, at least "
                  f"{RANK_MIN_BYTES // 2**20} MiB of available memory each; refused without it)")


def _default_run_dir(kind: str) -> Path:
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshfit", description="Plan, verify and train models that do not fit in one device's memory.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train a layout (one rank, --nproc local ranks, or under torchrun)",
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
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
    train.add_argument("--oversubscribe", action="store_true", help=_OVERSUBSCRIBE)
    train.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="with --nproc: restart every rank up to N times after a rank fails; each "
                            "restart resumes from the latest complete checkpoint (default 0)")
    plan = sub.add_parser("plan", help="rank every layout of a model on a cluster by predicted memory and speed",
                          formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
    add_plan_arguments(plan, single_layout=False)
    plan.add_argument("--explain", action="store_true", help="explain which techniques are needed and why")
    plan.add_argument("--top", type=positive_int, default=None, metavar="N",
                      help="rows in the table (default 10) / candidates in --json (default all)")
    verify = sub.add_parser("verify", help="dry-run one layout's real code at full world size with fake tensors",
                            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
    add_plan_arguments(verify, single_layout=True)
    export = sub.add_parser("export", help="write a checkpoint's weights as Hugging Face safetensors + config.json")
    export.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a step-N checkpoint folder, a checkpoints folder or a run folder (latest intact)")
    export.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    export.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="dtype of the written tensors (default fp32)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace model.safetensors and config.json already in --out (refused without it)")
    demo = sub.add_parser("demo", help="the seed scenario: a model over a per-rank memory budget")
    demo.add_argument("--run-dir", type=Path, metavar="DIR", help="output folder (default runs/demo-<time>)")
    demo.add_argument("--nproc", type=positive_int, default=2, metavar="N", help="local CPU ranks: 2 (default) or 4")
    demo.add_argument("--overwrite", action="store_true", help="replace an earlier demo's output in --run-dir")
    demo.add_argument("--oversubscribe", action="store_true", help=_OVERSUBSCRIBE)
    cal = sub.add_parser("calibrate", help="measure this machine's compute, memory and collective rates for "
                         "`meshfit plan --hardware`")
    cal.add_argument("--nproc", type=positive_int, default=2, metavar="N",
                     help="local ranks that measure at once, as training's would (default 2)")
    cal.add_argument("--out", type=Path, metavar="FILE", help="write the profile (JSON) here (default: print it)")
    cal.add_argument("--dim", type=positive_int, metavar="H",
                     help="hidden size of the measured matmuls and attention (default 512 on CPU, 4096 on GPU)")
    cal.add_argument("--model", metavar="PRESET|config.json",
                     help="also measure this model's own training rate (its first two blocks, embeddings, head "
                          "and loss), which the planner then uses for compute, and with --nproc ≥ 2 the same "
                          "blocks tensor-parallel (about 20 s more on 2 CPU ranks); sets --dim")
    cal.add_argument("--seq-len", type=positive_int, default=None, metavar="S",
                     help="sequence length for --model (default 2048; 256 on CPU)")
    cal.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="what to measure: CPU ranks (gloo) or one GPU per rank (NCCL); auto: cuda when present")
    cal.add_argument("--quick", action="store_true",
                     help="shorter measurements (a third of the time; its compute rates read 20–25%% high)")
    cal.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    cal.add_argument("--oversubscribe", action="store_true", help=_OVERSUBSCRIBE)
    show = sub.add_parser("show", help="summary table and plots (loss, tokens/s, per-rank memory) of runs")
    show.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories of meshfit train")
    show.add_argument("--out", type=Path, metavar="DIR", help="folder for the PNG plots (default: the run "
                      "directory for one run, else show-<time>); existing plots are kept, never overwritten")
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
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
    if args.resume or args.resume_from:
        overrides = [*overrides, "checkpoint.resume=true"]
        if args.resume_from:
            overrides.append(f"checkpoint.resume_from={args.resume_from}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be ≥ 0, got {args.max_restarts}")
    if args.nproc and args.nproc > 1 and not under_torchrun():
        check_local_ranks(args.nproc, args.oversubscribe)
    cfg = load_config(args.config, overrides, sections)
    if args.resume and not args.run_dir and not cfg.checkpoint.dir:
        raise ConfigError("--resume needs the run to continue: give its --run-dir (or checkpoint.dir)")
    run_dir = args.run_dir or _default_run_dir("train")
    outcome = launch(cfg, run_dir, args.nproc, max_restarts=args.max_restarts, overwrite=args.overwrite)
    if under_torchrun():
        if outcome.ok and os.environ.get("RANK") == "0":
            _report(outcome, cfg, run_dir)  # the closing line, once for the job
        elif not outcome.ok:
            tell_torchrun(f"error: {outcome.message}")
        # Leave without interpreter teardown (gloo's teardown race); exit code tells torchrun the outcome.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if outcome.ok else 1)
    return _report(outcome, cfg, run_dir)


def _report(outcome: Any, cfg: Any, run_dir: Path) -> int:
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
        print(f"stopped by {signal_name} after step {result['end_step']}; {saved}; continue with --resume "
              f"--run-dir {run_dir}")
        return 130 if signal_name == "SIGINT" else 0
    if result["steps"] == 0:
        print(f"nothing to do: the run is already at step {result['end_step']} of {cfg.train.steps}")
    else:
        print(f"done: steps {result['start_step'] + 1}–{result['end_step']}, final loss {result['final_loss']:.4f}; "
              f"metrics in {run_dir}/metrics.jsonl")
    return 0


def _all_interrupted(codes: dict[int, int]) -> bool:
    return bool(codes) and set(codes.values()) <= {130, -2}


def _cmd_export(args: argparse.Namespace) -> int:
    from meshfit.export import export
    from meshfit.train.checkpoint_store import CheckpointError

    notes: list[str] = []
    try:
        files = export(args.checkpoint, args.out, args.dtype, overwrite=args.overwrite, notes=notes)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _plan_parts(parts: tuple) -> tuple:
    model, _name, workload, layout = parts
    return model, workload, layout


def _cmd_plan(args: argparse.Namespace) -> int:
    from meshfit.plan_cli import cmd_plan, run

    return run(cmd_plan, args)


def _cmd_verify(args: argparse.Namespace) -> int:
    from meshfit.plan_cli import cmd_verify, run

    if not args.layout:
        print("error: meshfit verify needs --layout KEY=VAL,… (e.g. dp_shard=64,zero_stage=3)", file=sys.stderr)
        return 2
    return run(cmd_verify, args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from meshfit.demo import check_demo_args, demo_trials, run_demo

    run_dir = args.run_dir or _default_run_dir("demo")
    check_demo_args(run_dir, args.nproc, args.overwrite)  # which rank counts mean something comes first
    most = max(trial.nproc for trial in demo_trials(args.nproc))
    check_local_ranks(most, args.oversubscribe, f"--nproc {args.nproc}" if most == args.nproc else
                      f"the demo's layouts run up to {most} ranks")
    return run_demo(run_dir, nproc=args.nproc, overwrite=args.overwrite)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from meshfit.paths import check_out_file

    out = args.out
    try:  # before the measurement (tens of seconds), not after it
        if out is not None:
            check_out_file(out, "--out", args.overwrite, "hardware.json")
        check_local_ranks(args.nproc, args.oversubscribe)
        if args.seq_len and not args.model:
            raise PathError("--seq-len is the sequence length of --model's measurement: give --model too")
        model = None
        if args.model:
            from meshfit.plan_cli import resolve_model

            model = resolve_model(args.model, "")[1]
    except ValueError as exc:  # PathError, PlanInputError, a --model file that is not a config.json
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    from meshfit.calibrate import CalibrationError, calibrate
    from meshfit.train.dist import wants_cuda

    cuda = wants_cuda(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but no CUDA device is visible to torch on this machine", file=sys.stderr)
        return 2
    seq = args.seq_len or (2048 if cuda else 256)
    print(f"calibrating {'GPUs' if cuda else 'CPU ranks'} on {args.nproc} local rank(s)…", file=sys.stderr)
    try:
        profile = calibrate(args.nproc, dim=args.dim, quick=args.quick, model=model, seq=seq,
                            device="cuda" if cuda else "cpu")
    except CalibrationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if out is None:
        print(profile.model_dump_json(indent=2))
        return 0
    return _save_profile(profile, out)


def _save_profile(profile: Any, out: Path) -> int:
    """Write the profile to `out`; when that fails after all (the file system changed during the
    measurement), keep the measurement: a file in the temporary folder, and the JSON on stdout."""
    import tempfile

    from meshfit.planner.profile import save_profile

    try:
        save_profile(profile, out)
    except OSError as exc:
        kept = Path(tempfile.gettempdir()) / f"meshfit-hardware-{time.strftime('%Y%m%d-%H%M%S')}.json"
        try:
            save_profile(profile, kept)
            where = f"it is kept in {kept} (use it with `meshfit plan --hardware {kept}`) and printed below"
        except OSError:
            where = "it is printed below: save it as a .json file"
        print(f"error: --out {out} could not be written after the measurement ({exc.strerror or exc}); "
              f"{where}", file=sys.stderr)
        print(profile.model_dump_json(indent=2))
        return 1
    print(f"wrote {out} ({profile.seconds:.0f} s of measurement); use it with "
          f"`meshfit plan --hardware {out}`", file=sys.stderr)
    if profile.lacks():  # what the time model will take from datasheet or generic figures instead
        print(f"the profile lacks {'; '.join(profile.lacks())}", file=sys.stderr)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from meshfit.show import ShowError, show

    try:
        show(args.runs, args.out)
    except ShowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    commands = {"train": _cmd_train, "plan": _cmd_plan, "verify": _cmd_verify, "export": _cmd_export,
                "demo": _cmd_demo, "show": _cmd_show, "calibrate": _cmd_calibrate}
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        print(f"error: unknown command {argv[0]!r}; {did_you_mean(argv[0], commands)}commands: "
              f"{', '.join(commands)} (meshfit --help says what each does)", file=sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage and the error (or --help); its code is ours
        return int(exc.code or 0)
    try:
        return commands[args.command](args)
    except (ConfigError, PathError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.command == "train":
            from meshfit.train.launch import tell_torchrun

            tell_torchrun(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        print("interrupted (SIGINT); nothing was saved", file=sys.stderr)
        return 130
