"""Every user mistake is a message, never a traceback.

Each case runs `meshfit.commands.main.main(argv)` in this process and checks: the exit code (2: refused input), that
the output names the flag, field or file and what would be valid, that no traceback or internal name
(pydantic's, a dataclass's) reaches the user, and that nothing on disk changed. Every case is refused
before any rank starts; the one tiny training run (`trained`) is shared by the whole module.

A case's argv is a template: {ws} is a scratch folder of bad files (see `_workspace`), {run} the trained
run, {damaged} a copy of it whose latest checkpoint is corrupt, {plan} a valid 2-rank plan file. A needle
starting with "!" must NOT appear in the output.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from meshfit.commands.main import main
from meshfit.config import load_config
from meshfit.util.ranks import snapshot

TINY = "--set model.preset=tiny --set train.steps=2 --set train.seq_len=32"
BPE = "--set model.vocab_size=270 --set data.source=text --set data.tokenizer=bpe"
PIPE = "--nproc 2 --set parallel.pp=2 --set train.global_batch=2"
SMALL_PLAN = "plan --model tiny --gpus-per-node 2 --seq-len 64"
# Names of meshfit's and pydantic's internals that a user never typed.
INTERNAL = ("Traceback", "TrainSection", "ModelSection", "ParallelSection", "Cluster.", "Input should be",
            "instance of", "ModelConfig", "__init__", "UserWarning")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny single-process run with complete checkpoints at steps 1 and 2."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", *TINY.split(), "--set", "checkpoint.interval=1", "--run-dir", str(run)]) == 0
    return run


def _workspace(ws: Path) -> None:
    (ws / "afile").write_text("a file where a folder is expected\n")
    (ws / "adir").mkdir()
    (ws / "adir.json").mkdir()  # a folder named like a config.json
    (ws / "bad.toml").write_text("[train\nsteps=")
    (ws / "bad.yaml").write_text("train: [\n")
    (ws / "bad.json").write_text('{"train":')
    (ws / "list.json").write_text("[1, 2]")
    (ws / "conf.ini").write_text("[train]\n")
    (ws / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81")
    (ws / "sec.toml").write_text("train = 5\n")
    (ws / "typo.yaml").write_text("trian:\n  steps: 1\ntrain:\n  stpes: 3\n")
    (ws / "tiny.yaml").write_text("model:\n  preset: tiny\n")
    (ws / "notplan.json").write_text('{"format": "something else"}')
    (ws / "emptyplan.json").write_text('{"format": "meshfit-plan/1", "model": {}, "workload": {}, "layout": {}}')
    np.save(ws / "f32.npy", np.ones(100, dtype=np.float32))
    np.save(ws / "short.npy", np.arange(10, dtype=np.uint16))
    np.save(ws / "val.npy", np.arange(300, dtype=np.uint16) % 256)  # 9 windows of 32 + 1 tokens
    np.save(ws / "wide.npy", np.arange(300, dtype=np.uint16))  # ids 256-299: beyond tiny's vocabulary
    np.arange(10, dtype=np.uint8).tofile(ws / "odd.bin")
    (ws / "short.txt").write_text("hello\n")
    (ws / "sentence.txt").write_text("hello world, this is a short text. ")  # 35 bytes, 18 BPE tokens (270)
    (ws / "nonempty").mkdir()
    (ws / "nonempty" / "config.json").write_text('{"mine": true}\n')
    (ws / "demo").mkdir()
    (ws / "demo" / "summary.json").write_text("[]\n")


def _damaged(trained: Path, ws: Path, every: bool = False) -> Path:
    """A copy of the trained run with its latest (or every) checkpoint's data file flipped."""
    copy = ws / ("all-damaged" if every else "damaged")
    shutil.copytree(trained, copy)
    for folder in sorted((copy / "checkpoints").glob("step-*"))[0 if every else -1:]:
        data = folder / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    return copy


def _folders(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _run(template: str, request: pytest.FixtureRequest, ws: Path) -> tuple[int, str, dict[Path, tuple]]:
    """Run one case; returns the exit code, the output and (before, after) states of the watched folders."""
    places = {"ws": ws}
    if "{run}" in template:
        places["run"] = request.getfixturevalue("trained")
    if "{damaged}" in template:
        places["damaged"] = _damaged(request.getfixturevalue("trained"), ws)
    if "{all_damaged}" in template:
        places["all_damaged"] = _damaged(request.getfixturevalue("trained"), ws, every=True)
    if "{plan}" in template:
        places["plan"] = ws / "plan.json"
        assert main([*SMALL_PLAN.split(), "--global-batch", "8", "--precision", "fp32", "--layout",
                     "dp_shard=2", "--out", str(places["plan"])]) == 0
    watched = [ws] + ([places["run"]] if "run" in places else [])
    before = {w: (snapshot(w), _folders(w)) for w in watched}
    capsys = request.getfixturevalue("capsys")
    capsys.readouterr()
    code = main([part.format(**places) for part in shlex.split(template)])
    out, err = capsys.readouterr()
    return code, out + err, {w: (before[w], (snapshot(w), _folders(w))) for w in watched}


def _check(template: str, code: int, needles: tuple[str, ...], request: pytest.FixtureRequest, ws: Path) -> str:
    got, text, states = _run(template, request, ws)
    assert got == code, text
    for bad in INTERNAL:
        assert bad not in text, f"{bad!r} in:\n{text}"
    for needle in needles:
        if needle.startswith("!"):
            assert needle[1:] not in text, f"{needle[1:]!r} in:\n{text}"
        else:
            assert needle in text, f"{needle!r} not in:\n{text}"
    for (files, folders), (files_after, folders_after) in states.values():
        if code == 0:  # a command that worked may add files, never change or remove one
            assert all(files_after.get(name) == data for name, data in files.items())
        else:  # a refused one leaves everything as it was, and creates nothing
            assert (files_after, folders_after) == (files, folders)
    return text


@pytest.fixture
def ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _workspace(tmp_path)
    monkeypatch.chdir(tmp_path)  # a default run directory would land here, and be caught
    return tmp_path


# /proc: a folder that exists and where no file can be created, even by root (permissions would not do).
NEEDS_PROC = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")


def case(case_id: str, template: str, *needles: str, code: int = 2, marks=()):
    return pytest.param(template, code, needles, id=case_id, marks=marks)


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: train.device=cuda is valid")

CONFIG_FILES = [
    case("config-is-a-directory", "train --config {ws}/adir", "--config", "is a directory", ".toml, .yaml"),
    case("config-missing", "train --config {ws}/missing.toml", "missing.toml", "does not exist", ".toml"),
    case("config-unknown-extension", "train --config {ws}/conf.ini", "conf.ini", "'.ini'", ".toml, .yaml"),
    case("config-bad-toml", "train --config {ws}/bad.toml", "bad.toml", "cannot be parsed as TOML"),
    case("config-bad-yaml", "train --config {ws}/bad.yaml", "bad.yaml", "cannot be parsed as YAML", "line 2"),
    case("config-bad-json", "train --config {ws}/bad.json", "bad.json", "cannot be parsed as JSON"),
    case("config-not-utf8", "train --config {ws}/binary.yaml", "binary.yaml", "not UTF-8 text", ".yaml"),
    case("config-top-level-list", "train --config {ws}/list.json", "list.json", "mapping of sections",
         "model, parallel"),
    case("config-section-not-a-table", "train --config {ws}/sec.toml", "train: expected a section of keys",
         "[table]"),
    case("config-section-not-a-table-with-set", "train --config {ws}/sec.toml --set train.steps=3",
         "'train' is 5", "not a section"),
    case("config-typos-did-you-mean", "train --config {ws}/typo.yaml", "trian: unknown section",
         "did you mean 'train'?", "train.stpes: unknown key", "did you mean 'train.steps'?"),
]

SET_SYNTAX = [
    case("set-no-equals", "train --set train.steps", "--set 'train.steps'", "section.key=value"),
    case("set-no-section", "train --set steps=3", "--set 'steps=3'", "section.key=value"),
    case("set-unknown-section", "train --set trian.steps=3", "unknown section 'trian'", "did you mean 'train'?",
         "valid sections: model"),
    case("set-unknown-key", "train --set train.stpes=3", "train.stpes: unknown key",
         "did you mean 'train.steps'?", "valid keys: steps"),
    case("set-steps-not-int", "train --set train.steps=abc", "train.steps: expected an integer", "'abc'"),
    case("set-tp-float", "train --set parallel.tp=1.5", "parallel.tp: expected an integer", "'1.5'"),
    case("set-budget-not-size", "train --set train.memory_budget=lots", "train.memory_budget", "300MiB"),
    case("set-budget-overflows", "train --set train.memory_budget=1e400GiB", "train.memory_budget",
         "larger than any machine's memory", "1 EiB"),
    case("set-bool-not-bool", "train --set metrics.tensorboard=maybe", "metrics.tensorboard",
         "expected true or false"),
    case("set-zero-stage-4", "train --set parallel.zero_stage=4", "parallel.zero_stage", "0 (DDP)", "3 (+"),
    case("set-ac-mode", "train --set parallel.activation_checkpointing=some", "parallel.activation_checkpointing",
         "'selective'", "'full'"),
    case("set-schedule", "train --set pipeline.schedule=foo", "pipeline.schedule", "'gpipe'", "'1f1b'"),
    case("set-family", "train --set model.family=bert", "model.family", "'llama', 'gpt'"),
    case("set-device", "train --set train.device=tpu", "train.device", "'auto', 'cpu', 'cuda'"),
    case("set-precision", "train --set train.precision=fp16", "train.precision", "'fp32', 'bf16'"),
    case("set-preset-unknown", "train --set model.preset=nope", "model.preset", "valid presets: tiny"),
    case("set-preset-typo", "train --set model.preset=lama3-8b", "model.preset", "did you mean 'llama3-8b'?"),
    case("set-attention", "train --set model.attention=fast", "model.attention='fast'", "flash, eager"),
]

# Zero or negative where a positive (or non-negative) value is needed: (override, field, what is valid).
BOUNDS = [(o, f, h) for o, f, h in [
    ("train.steps=0", "train.steps", "positive"), ("train.steps=-1", "train.steps", "positive"),
    ("train.global_batch=0", "train.global_batch", "positive"), ("train.seq_len=0", "train.seq_len", "positive"),
    ("train.micro_batch=0", "train.micro_batch", "positive"), ("train.log_every=0", "train.log_every", "positive"),
    ("train.memory_tracked_steps=0", "train.memory_tracked_steps", "positive"),
    ("train.stop_after=0", "train.stop_after", "positive"), ("train.timeout_s=0", "train.timeout_s", "positive"),
    ("train.memory_budget=0", "train.memory_budget", "positive size"), ("train.lr=0", "train.lr", "> 0"),
    ("train.lr=-1", "train.lr", "> 0"), ("train.warmup_steps=-1", "train.warmup_steps", "≥ 0"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio", "≤ 1"), ("train.weight_decay=-1", "train.weight_decay", "≥ 0"),
    ("train.grad_clip=-1", "train.grad_clip", "≥ 0"), ("train.peak_flops=0", "train.peak_flops", "> 0"),
    ("train.seed=-1", "train.seed", "≥ 0"), ("checkpoint.interval=-1", "checkpoint.interval", "≥ 0"),
    ("checkpoint.keep_latest=1", "checkpoint.keep_latest", "≥ 2"), ("parallel.tp=0", "parallel.tp", "-1"),
    ("parallel.dp_shard=-2", "parallel.dp_shard", "positive degree"),
    ("parallel.ac_every=0", "parallel.ac_every", "≥ 1"),
    ("pipeline.microbatches=0", "pipeline.microbatches", "positive"),
    ("pipeline.virtual_stages=0", "pipeline.virtual_stages", "positive"), ("model.dim=0", "model.dim", "positive"),
    ("model.n_layers=-1", "model.n_layers", "positive"), ("model.vocab_size=0", "model.vocab_size", "positive"),
    ("model.max_seq_len=0", "model.max_seq_len", "positive"), ("model.norm_eps=-1", "model.norm_eps", "> 0"),
    ("model.pad_vocab_to=0", "model.pad_vocab_to", "positive"), ("model.dropout=2", "model.dropout", "[0, 1)"),
]]

DATA = [
    case("data-tokens-without-path", "train --set data.source=tokens", "data.path is required", ".npy or .bin"),
    case("data-path-missing", "train --set data.source=tokens --set data.path={ws}/nope.npy", "nope.npy",
         "does not exist", ".npy or .bin"),
    case("data-tokens-float", "train --set data.source=tokens --set data.path={ws}/f32.npy", "f32.npy",
         "float32", "uint16, uint32, int32 or int64"),
    case("data-tokens-size-vs-dtype", "train --set data.source=tokens --set data.path={ws}/odd.bin "
         "--set data.token_dtype=uint32", "odd.bin", "10 bytes", "multiple of 4", "data.token_dtype"),
    case("data-tokens-too-short", f"train {TINY} --set data.source=tokens --set data.path={{ws}}/short.npy",
         "short.npy", "has 10 tokens", "train.seq_len + 1 = 33"),
    case("data-text-too-short", f"train {TINY} --set data.source=text --set data.path={{ws}}/short.txt",
         "short.txt", "6 tokens", "train.seq_len + 1 = 33", "!token array"),
    case("data-bpe-text-fewer-bytes-than-a-sequence", f"train {TINY} {BPE} --set data.path={{ws}}/short.txt "
         "--run-dir {ws}/r", "short.txt", "at most 6 tokens with data.tokenizer=bpe", "train.seq_len + 1 = 33"),
    case("data-bpe-text-fewer-tokens-than-a-sequence", f"train {TINY} {BPE} --set data.path={{ws}}/sentence.txt "
         "--run-dir {ws}/r", "sentence.txt", "gives 18 tokens with data.tokenizer=bpe", "train.seq_len + 1 = 33",
         "!meshfit train:"),
    case("data-text-folder-without-txt", "train --set data.source=text --set data.path={ws}/adir", "adir",
         "no .txt files"),
    case("data-tokens-wrong-extension", "train --set data.source=tokens --set data.path={ws}/short.txt",
         "short.txt", "'.txt'", ".npy, .bin"),
    case("init-from-missing", "train --set model.init_from={ws}/nope", "model.init_from", "does not exist",
         "meshfit export"),
    case("device-cuda-without-cuda", "train --set train.device=cuda", "train.device=cuda", "no CUDA device",
         "train.device=cpu", marks=no_cuda),
]

LAYOUT = [
    case("world-size-mismatch", "train --nproc 2 --set parallel.tp=4", "dp_shard is unset", "tp=4",
         "world size is 2", "divisors: 1, 2"),
    case("world-size-mismatch-explicit", "train --nproc 2 --set parallel.tp=4 --set parallel.dp_shard=1",
         "world size is 2", "-1"),
    case("tp-not-dividing-heads", "train --nproc 3 --set parallel.tp=3", "parallel.tp=3", "model.n_heads=4",
         ": 1, 2"),
    case("two-rest-degrees", "train --set parallel.tp=-1 --set parallel.dp_shard=-1", "at most one degree",
         "dp_shard, tp"),
    case("pipeline-microbatches-valid-list-holds-only-valid", f"train {PIPE} --set pipeline.microbatches=1",
         "pipeline.microbatches=1", "fewer than pp=2", "valid values: 2", "!valid values: 1"),
    case("pipeline-microbatches-not-dividing", f"train {PIPE} --set pipeline.microbatches=3",
         "pipeline.microbatches=3", "does not divide", "valid values: 2"),
    case("pipeline-no-valid-microbatches", "train --nproc 4 --set parallel.pp=4 --set model.n_layers=4 "
         "--set train.global_batch=2", "pipeline.microbatches", "no value works", "train.global_batch",
         "gpipe"),
    case("sp-without-tp", "train --set parallel.sp=true", "parallel.sp=true", "parallel.tp > 1"),
    case("seq-len-over-model", "train --set train.seq_len=100000", "train.seq_len=100000", "max_seq_len=256"),
]

PLAN_FILE = [
    case("plan-file-missing", "train --plan {ws}/missing.json", "--plan", "missing.json", "meshfit plan"),
    case("plan-file-is-a-directory", "train --plan {ws}/adir", "--plan", "adir is a directory, not a plan file"),
    case("plan-file-corrupt", "train --plan {ws}/bad.json", "bad.json", "not a JSON plan file"),
    case("plan-file-not-a-plan", "train --plan {ws}/notplan.json", "notplan.json", "meshfit-plan/1"),
    case("plan-file-not-an-object", "train --plan {ws}/list.json", "list.json", "JSON object"),
    case("plan-file-without-fields", "train --plan {ws}/emptyplan.json --nproc 2", "emptyplan.json",
         "missing field(s) model.family"),
    case("plan-file-other-world-size", "train --plan {plan} --nproc 4", "2 ranks", "--nproc is 4",
         "--nproc 2"),
    case("plan-file-needs-nproc", "train --plan {plan}", "--plan", "add --nproc 2"),
]

RUN_DIR = [
    case("run-dir-is-a-file", "train --run-dir {ws}/afile", "--run-dir", "is a file", "another path"),
    case("run-dir-under-a-file", "train --run-dir {ws}/afile/sub", "--run-dir", "afile is a file"),
    case("new-run-into-a-run", f"train {TINY} --run-dir {{run}}", "already holds a run", "--resume",
         "--overwrite", "another --run-dir"),
    case("resume-and-overwrite", "train --resume --overwrite --run-dir {ws}/r", "--resume", "--overwrite",
         "give one"),
    case("resume-without-run-dir", "train --resume", "--resume needs", "--run-dir"),
    case("resume-other-model", f"train {TINY} --resume --run-dir {{run}} --set model.preset=small",
         "cannot resume", "model.dim: saved 64, now 256"),
    case("resume-other-batch", "train --resume --run-dir {run} --set model.preset=tiny --set train.global_batch=4",
         "cannot resume", "train.global_batch: saved 8, now 4", "the run's own settings"),
    case("resume-other-batch-and-config", "train --resume --run-dir {run} --config {ws}/tiny.yaml",
         "cannot resume", "train.seq_len: saved 32, now 128", "without --config or --plan resumes with the run's "
         "own settings"),
    case("resume-from-not-a-checkpoint", "train --resume-from {ws}/adir --run-dir {ws}/r", "--resume-from",
         "meshfit.json is missing"),
    case("resume-from-a-run-folder", "train --resume-from {run} --run-dir {ws}/r", "--resume-from",
         "step-00000002 (the latest)", "--resume --run-dir"),
    case("resume-from-missing", "train --resume-from {ws}/nope --run-dir {ws}/r", "--resume-from",
         "does not exist", "step-N"),
    case("resume-from-a-corrupt-shard", f"train {TINY} --resume-from {{damaged}}/checkpoints/step-00000002 "
         "--run-dir {ws}/r",
         "--resume-from", "step-00000002/__0_0.distcp is corrupt", "SHA-256", "!meshfit train:"),
    case("resume-every-checkpoint-damaged", f"train {TINY} --resume --run-dir {{all_damaged}}",
         "--resume: no intact checkpoint", "step-00000001/__0_0.distcp", "step-00000002/__0_0.distcp",
         "!meshfit train:"),
    case("resume-from-a-file", "train --resume-from {ws}/afile --run-dir {ws}/r", "--resume-from", "is a file"),
    case("checkpoint-dir-is-a-file", "train --set checkpoint.dir={ws}/afile", "checkpoint.dir", "is a file"),
    case("max-restarts-negative", "train --max-restarts -1", "--max-restarts", "≥ 0"),
    case("nproc-zero", "train --nproc 0", "--nproc", "positive integer"),
    case("nproc-not-a-number", "train --nproc x", "--nproc", "positive integer"),
]

PLAN_FLAGS = [
    case("plan-nodes-zero", "plan --model tiny --nodes 0", "--nodes", "positive integer"),
    case("plan-gpus-per-node-negative", "plan --model tiny --gpus-per-node -1", "--gpus-per-node",
         "positive integer"),
    case("plan-gpu-memory-not-size", "plan --model tiny --gpu-memory abc", "--gpu-memory", "MiB"),
    case("plan-gpu-memory-zero", "plan --model tiny --gpu-memory 0", "--gpu-memory", "positive size"),
    case("plan-gpu-memory-overflows", "plan --model tiny --gpu-memory 1e400GiB", "--gpu-memory",
         "larger than any machine's memory", "80GiB"),
    case("plan-gpu-memory-beyond-an-exabyte", "plan --model tiny --gpu-memory 2000000TiB", "--gpu-memory",
         "larger than any machine's memory"),
    case("verify-gpu-memory-overflows", "verify --model tiny --layout dp_shard=2 --gpu-memory 1e400GiB",
         "--gpu-memory", "larger than any machine's memory"),
    case("plan-hardware-is-a-directory", "plan --model tiny --hardware {ws}/adir", "--hardware",
         "adir is a directory, not a hardware profile"),
    case("verify-hardware-is-a-directory", "verify --model tiny --layout dp_shard=2 --hardware {ws}/adir",
         "--hardware", "adir is a directory, not a hardware profile"),
    case("plan-model-json-is-a-directory", "plan --model {ws}/adir.json", "--model", "adir.json is a directory"),
    case("calibrate-model-json-is-a-directory", "calibrate --model {ws}/adir.json", "--model",
         "adir.json is a directory", "!calibrating"),
    case("plan-out-exists", f"{SMALL_PLAN} --out {{ws}}/afile", "--out", "exists", "--overwrite"),
    case("plan-out-unwritable", f"{SMALL_PLAN} --out /proc/meshfit-plan.json", "--out /proc/meshfit-plan.json",
         "cannot be written", marks=NEEDS_PROC),
    case("train-run-dir-unwritable", "train --run-dir /proc/meshfit-run", "--run-dir /proc/meshfit-run",
         "cannot be written", marks=NEEDS_PROC),
    case("demo-run-dir-unwritable", "demo --run-dir /proc/meshfit-demo", "--run-dir /proc/meshfit-demo",
         "cannot be written", marks=NEEDS_PROC),
    case("calibrate-out-exists", "calibrate --out {ws}/afile", "--out", "exists", "--overwrite", "!calibrating"),
    case("plan-cpu-offload", "plan --model tiny --gpu cpu --gpu-memory 80MiB --gpus-per-node 2 --layout "
         "dp_shard=2,offload=true", "offload=true", "on CPU ranks the host is the same memory", "!calibrating"),
    case("verify-cpu-offload", "verify --model tiny --seq-len 64 --gpu cpu --gpu-memory 80MiB --layout "
         "dp_shard=2,offload=true", "offload=true", "on CPU ranks the host is the same memory"),
    case("plan-gpu-tflops-negative", "plan --model tiny --gpu-tflops=-1", "--gpu-tflops", "positive number"),
    case("plan-link-zero", "plan --model tiny --intra-node-gbps 0", "--intra-node-gbps", "positive number"),
    case("plan-seq-len-zero", "plan --model tiny --seq-len 0", "--seq-len", "positive integer"),
    case("plan-global-batch-zero", "plan --model tiny --global-batch 0", "--global-batch", "positive integer"),
    case("plan-micro-batch-zero", "plan --model tiny --micro-batch 0", "--micro-batch", "positive integer"),
    case("plan-dropout", "plan --model tiny --dropout 2", "--dropout", "[0, 1)"),
    case("plan-precision", "plan --model tiny --precision fp8", "--precision", "'mixed'"),
    case("plan-optimizer", "plan --model tiny --optimizer lion", "--optimizer", "'adamw'"),
    case("plan-top-zero", "plan --model tiny --top 0", "--top", "positive integer"),
    case("plan-gpu-unknown", "plan --model tiny --gpu NOPE", "--gpu", "valid GPUs: A100-40GB"),
    case("plan-gpu-typo", "plan --model tiny --gpu h100", "--gpu", "did you mean 'H100-SXM'?"),
    case("plan-model-unknown", "plan --model NOPE", "--model 'NOPE'", "presets: tiny"),
    case("plan-model-typo", "plan --model lama3-8b", "--model", "did you mean 'llama3-8b'?"),
    case("plan-model-json-missing", "plan --model {ws}/missing.json", "missing.json", "config.json"),
    case("plan-dims-bad", "plan --model tiny --dims n_heads=7", "--dims", "valid n_heads: 1, 2, 4"),
    case("plan-dims-unknown-key", "plan --model tiny --dims foo=3", "--dims", "unknown key 'foo'", "n_layers"),
    case("plan-layout-tp-heads", f"{SMALL_PLAN} --gpus-per-node 3 --layout tp=3", "--layout tp=3",
         "model.n_heads=4", ": 1, 2"),
    case("plan-layout-unknown-key", "plan --model tiny --layout foo=1", "--layout", "unknown key 'foo'",
         "dp_shard"),
    case("plan-layout-typo", "plan --model tiny --layout tpp=2", "--layout", "did you mean 'tp'?"),
    case("plan-layout-not-int", "plan --model tiny --layout dp_shard=x", "--layout dp_shard='x'",
         "expected an integer"),
    case("plan-layout-zero-stage", "plan --model tiny --layout zero_stage=4", "--layout zero_stage=4",
         "0, 1, 2 or 3"),
    case("plan-layout-world", f"{SMALL_PLAN} --layout dp_shard=4", "--layout spans 4 GPUs", "--gpus-per-node 2"),
    case("plan-global-batch-vs-dp", f"{SMALL_PLAN} --global-batch 3 --layout dp_replicate=2", "--global-batch 3",
         "valid: 2, 4, 6"),
    case("plan-batch-tokens", "plan --model tiny --seq-len 64 --global-batch-tokens 100", "--global-batch-tokens",
         "--seq-len"),
    case("plan-out-is-a-directory", "plan --model tiny --out {ws}/adir", "--out", "is a directory", "plan.json"),
    case("plan-out-under-a-file", "plan --model tiny --out {ws}/afile/plan.json", "--out", "afile is a file"),
    case("verify-without-layout", "verify --model tiny", "--layout", "dp_shard=64"),
    case("verify-seq-len-over-model", "verify --model tiny --seq-len 4096 --layout dp_shard=2", "--seq-len 4096",
         "max_seq_len=256", "--dims max_seq_len=…"),
    case("plan-seq-len-over-model", "plan --model tiny --seq-len 4096", "--seq-len 4096", "max_seq_len=256",
         "--dims max_seq_len=…"),
    case("verify-global-batch-vs-dp", "verify --model tiny --seq-len 64 --layout dp_shard=2 --global-batch 3",
         "--global-batch 3", "valid: 2, 4"),
    case("verify-layout-tp-heads", "verify --model tiny --seq-len 64 --layout tp=3", "--layout tp=3", ": 1, 2"),
    case("verify-layout-vs-cluster", "verify --model tiny --seq-len 64 --gpus-per-node 2 --layout dp_shard=4",
         "--layout spans 4 GPUs", "--gpus-per-node 2", "make the two equal"),
    case("plan-micro-batch-twice", f"{SMALL_PLAN} --layout dp_shard=2,micro_batch=1 --micro-batch 2",
         "--micro-batch 2 contradicts micro_batch=1 in --layout", "give it once"),
    case("plan-micro-batch-twice-hyphen", f"{SMALL_PLAN} --layout dp_shard=2,micro-batch=1 --micro-batch 2",
         "--micro-batch 2 contradicts micro_batch=1 in --layout"),
    # Refused before `--gpu cpu` calibrates this machine (seconds of collectives that would be wasted).
    case("plan-cpu-micro-batch-twice", "plan --model tiny --gpu cpu --gpu-memory 80MiB --gpus-per-node 2 --layout "
         "dp_shard=2,micro_batch=1 --micro-batch 2", "--micro-batch 2 contradicts micro_batch=1", "!calibrating"),
    case("verify-checkpointing-twice", "verify --model tiny --seq-len 64 --layout dp_shard=2,activation_checkpointing=op "
         "--activation-checkpointing full", "--activation-checkpointing full contradicts activation_checkpointing=op"),
]

EXPORT = [
    case("export-out-is-a-file", "export {run} --out {ws}/afile", "--out", "is a file"),
    case("export-out-under-a-file", "export {run} --out {ws}/afile/sub", "--out", "afile is a file"),
    case("export-out-holds-an-export", "export {run} --out {ws}/nonempty", "--out", "config.json",
         "--overwrite"),
    case("export-out-unwritable", "export {run} --out /proc/meshfit-hf", "--out /proc/meshfit-hf cannot be written",
         marks=NEEDS_PROC),
    case("export-no-checkpoint", "export {ws}/adir --out {ws}/hf", "adir", "no complete checkpoint",
         "run folder"),
    case("export-missing-path", "export {ws}/nope --out {ws}/hf", "nope", "does not exist"),
    case("export-a-file", "export {ws}/afile --out {ws}/hf", "afile", "is a file"),
    case("export-dtype", "export {run} --out {ws}/hf --dtype fp8", "--dtype", "'bf16'"),
    case("export-every-checkpoint-damaged", "export {all_damaged} --out {ws}/hf", "no intact checkpoint to export",
         "is corrupt", "!resume"),
    case("export-damaged-falls-back", "export {damaged} --out {ws}/hf", "skipped a damaged checkpoint",
         "step-00000002", "exporting the one before it", "step-00000001", "wrote", "!resum", "!warn", code=0),
]

EVAL_ARGS = "--data {ws}/val.npy --seq-len 32 --windows 8"
EVAL = [
    case("eval-model-missing", f"eval {{ws}}/nope {EVAL_ARGS}", "MODEL", "nope does not exist", "Hugging Face folder"),
    case("eval-model-a-file", f"eval {{ws}}/afile {EVAL_ARGS}", "MODEL", "afile is a file", "checkpoint folder"),
    case("eval-model-not-a-model", f"eval {{ws}}/adir {EVAL_ARGS}", "MODEL", "holds neither", "run folder"),
    case("eval-hf-config-without-weights", f"eval {{ws}}/nonempty {EVAL_ARGS}", "MODEL", "no *.safetensors"),
    case("eval-corrupt-checkpoint", f"eval {{damaged}}/checkpoints/step-00000002 {EVAL_ARGS}", "MODEL",
         "step-00000002/__0_0.distcp is corrupt"),
    case("eval-every-checkpoint-damaged", f"eval {{all_damaged}} {EVAL_ARGS}", "no intact checkpoint to evaluate"),
    case("eval-data-missing", "eval {run} --data {ws}/nope.npy --seq-len 32 --windows 8", "--data", "does not exist",
         ".npy"),
    case("eval-data-float", "eval {run} --data {ws}/f32.npy --seq-len 32 --windows 2", "--data", "float32"),
    case("eval-ids-beyond-vocabulary", "eval {run} --data {ws}/wide.npy --seq-len 32 --windows 8", "--data",
         "token id 256", "vocab_size=256"),
    case("eval-more-windows-than-the-file", "eval {run} --data {ws}/val.npy --seq-len 32 --windows 10",
         "--windows 10", "holds 300 tokens", "9 windows of --seq-len + 1 = 33", "--windows ≤ 9"),
    case("eval-seq-len-beyond-positions", "eval {run} --data {ws}/val.npy --seq-len 300 --windows 1", "--seq-len 300",
         "max_seq_len=256", "≤ 256"),
    case("eval-windows-zero", "eval {run} --data {ws}/val.npy --seq-len 32 --windows 0", "--windows 0", "at least 1"),
    case("eval-set-the-model", f"eval {{run}} {EVAL_ARGS} --set model.dim=32", "model.dim", "come from MODEL"),
    case("eval-set-seq-len", f"eval {{run}} {EVAL_ARGS} --set train.seq_len=8", "train.seq_len", "--seq-len"),
    case("eval-windows-uneven-over-ranks", "eval {run} --data {ws}/val.npy --seq-len 32 --windows 5 --nproc 2",
         "--windows 5", "2 data-parallel ranks", "--windows 4 or 6"),
    case("eval-layout-typo", f"eval {{run}} {EVAL_ARGS} --layout tpp=2", "--layout", "did you mean 'tp'"),
    case("eval-out-exists", f"eval {{run}} {EVAL_ARGS} --out {{ws}}/afile", "--out", "already exists"),
    case("eval-damaged-falls-back", f"eval {{damaged}} {EVAL_ARGS}", "skipped a damaged checkpoint",
         "evaluating the one before it", "step-00000001", "loss ", "perplexity", "!warn", code=0),
]

OTHER_COMMANDS = [
    case("show-missing", "show {ws}/nope", "nope", "does not exist", "run directory"),
    case("show-a-file", "show {ws}/afile", "afile", "is a file", "metrics.jsonl"),
    case("demo-nproc-3", "demo --nproc 3 --run-dir {ws}/d", "--nproc 3", "2 or 4 ranks"),
    case("demo-nproc-64", "demo --nproc 64 --run-dir {ws}/d", "--nproc 64", "2 or 4 ranks"),
    case("demo-earlier-output", "demo --run-dir {ws}/demo", "summary.json", "--overwrite"),
    case("demo-run-dir-is-a-file", "demo --run-dir {ws}/afile", "--run-dir", "is a file"),
    case("command-typo", "trian", "unknown command 'trian'", "did you mean 'train'?", "plan, verify"),
    case("option-unknown", "plan --nodess 2", "unrecognized arguments", "--nodess"),
    case("no-command", "", "COMMAND"),
]

ALL = CONFIG_FILES + SET_SYNTAX + DATA + LAYOUT + PLAN_FILE + RUN_DIR + PLAN_FLAGS + EXPORT + EVAL + OTHER_COMMANDS


@pytest.mark.parametrize("template, code, needles", ALL)
def test_bad_input_is_one_message(template: str, code: int, needles: tuple[str, ...],
                                  request: pytest.FixtureRequest, ws: Path) -> None:
    text = _check(template, code, needles, request, ws)
    if code == 2:
        assert "error:" in text


@pytest.mark.parametrize("override, field, valid", BOUNDS, ids=[o for o, _, _ in BOUNDS])
def test_out_of_range_value_names_the_field(override: str, field: str, valid: str,
                                            request: pytest.FixtureRequest, ws: Path) -> None:
    _check(f"train --set {override}", 2, (f"{field}", valid, "error:"), request, ws)


BEFORE_RANKS = [c for c in ALL if c.id in ("resume-from-a-corrupt-shard", "data-bpe-text-fewer-tokens-than-a-sequence")
                or (c.id.startswith("eval-") and c.values[1] == 2
                    and c.id != "eval-every-checkpoint-damaged")]  # one error line, then each damaged file


@pytest.mark.parametrize("template, code, needles", BEFORE_RANKS)
def test_damaged_checkpoints_short_bpe_text_and_bad_evals_are_one_line_before_any_rank_starts(
        template: str, code: int, needles: tuple[str, ...], request: pytest.FixtureRequest, ws: Path) -> None:
    text = _check(template, code, needles, request, ws)
    assert text.count("\n") == 1 and text.startswith("error: "), text  # no banner, no rank's report


def test_grad_clip_zero_means_no_clipping_and_is_accepted() -> None:
    assert load_config(None, ["train.grad_clip=0"]).train.grad_clip == 0  # documented: 0 = off


def test_plan_prints_small_times_in_small_units(request: pytest.FixtureRequest, ws: Path) -> None:
    text = _check(f"{SMALL_PLAN} --global-batch 8 --precision fp32 --explain --top 3", 0,
                  ("µs", "step time", "107K parameters"), request, ws)
    assert " 0.00 " not in text and "0.00 s" not in text
