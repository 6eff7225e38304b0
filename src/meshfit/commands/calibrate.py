"""`meshfit calibrate`: this machine's compute, memory and collective rates, as a hardware profile for
`meshfit plan --hardware`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from meshfit.commands.flags import OVERSUBSCRIBE_HELP, positive_int
from meshfit.train.capacity import check_local_ranks
from meshfit.util.paths import PathError

NAME = "calibrate"


def add_parser(sub: Any, epilog: str) -> argparse.ArgumentParser:
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
    cal.add_argument("--oversubscribe", action="store_true", help=OVERSUBSCRIBE_HELP)
    return cal


def run(args: argparse.Namespace) -> int:
    from meshfit.util.paths import check_out_file

    out = args.out
    try:  # before the measurement (tens of seconds), not after it
        if out is not None:
            check_out_file(out, "--out", args.overwrite, "hardware.json")
        check_local_ranks(args.nproc, args.oversubscribe)
        if args.seq_len and not args.model:
            raise PathError("--seq-len is the sequence length of --model's measurement: give --model too")
        model = None
        if args.model:
            from meshfit.commands.plan_flags import resolve_model

            model = resolve_model(args.model, "")[1]
    except ValueError as exc:  # PathError, PlanInputError, a --model file that is not a config.json
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    from meshfit.calibrate.measure import CalibrationError, calibrate
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

    from meshfit.hardware.profile import save_profile

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
