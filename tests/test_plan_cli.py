"""`meshfit plan`: the search, the JSON schema, --explain, plan files and `meshfit train --plan`."""

import json
from pathlib import Path

import pytest
from test_cli import meshfit

from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Layout, Workload, parse_layout
from meshfit.layout.recompute import AC_MODES
from meshfit.models.hf import model_from_hf_config
from meshfit.models.presets import get_preset
from meshfit.planner.memory.estimate import usable_bytes
from meshfit.planner.search import evaluate, search


def in_process(capsys):
    """Call `meshfit ARGS` as `main(ARGS)` in this process; returns what subprocess.run would."""
    from types import SimpleNamespace

    from meshfit.commands.main import main

    def run(*args):
        code = main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return run

LLAMA70B = get_preset("llama3-70b")
H100_64 = Cluster("H100-SXM", nodes=8, gpus_per_node=8)
LONG = Workload(seq_len=8192, global_batch=256)


@pytest.fixture(scope="module")
def plan_70b():
    return search(LLAMA70B, LONG, H100_64, model_name="llama3-70b")


def test_every_layout_kind_is_evaluated_and_ranked(plan_70b):
    layouts = [c.layout for c in plan_70b.candidates]
    assert len(layouts) >= 10_000
    kinds = {(lay.zero_stage, lay.dp_replicate > 1 and lay.dp_shard > 1) for lay in layouts}
    assert {(0, False), (1, False), (2, False), (3, False), (3, True)} <= kinds  # DDP, ZeRO-1/2/3, HSDP
    assert {lay.schedule for lay in layouts if lay.pp > 1} == {"gpipe", "1f1b", "interleaved-1f1b",
                                                                "interleaved-zb", "zbv", "dualpipev"}
    # The attention-core policy is searched with eager attention only (fused attention keeps nothing to drop).
    assert {lay.activation_checkpointing for lay in layouts} == set(AC_MODES) - {"attention"}
    assert any(lay.offload for lay in layouts) and any(lay.sp for lay in layouts)
    assert {lay.tp for lay in layouts} == {1, 2, 4, 8}  # within a node, dividing the 8 KV heads
    usable = usable_bytes(H100_64.gpu)
    fitting = plan_70b.fitting
    assert fitting and all(c.memory.total <= usable for c in fitting)
    assert all(c.memory.total > usable for c in plan_70b.candidates if not c.fits)
    # Fitting layouts come first, fastest first.
    speeds = [c.time.tokens_per_s for c in fitting]
    assert speeds == sorted(speeds, reverse=True) and plan_70b.candidates[:len(fitting)] == fitting
    # A 70B model's replica (16 B/parameter) cannot fit an 80 GB device: no DDP or ZeRO-1 layout fits.
    assert not any(c.layout.zero_stage < 2 and c.layout.tp == c.layout.pp == 1 for c in fitting)


def test_one_layout_is_evaluated_exactly(plan_70b):
    best = plan_70b.best
    again = evaluate(LLAMA70B, best.layout, LONG, H100_64)
    assert again.memory == best.memory and again.time == best.time
    with pytest.raises(ValueError, match="tp=3 must divide"):
        evaluate(LLAMA70B, Layout(dp_shard=8, tp=3, zero_stage=3), LONG, Cluster("H100-SXM", 3, 8))


def test_explain_answers_with_numbers(plan_70b):
    from meshfit.planner.explain import explain

    text = explain(plan_70b)
    assert "Why plain DDP does not work" in text and "does not fit" in text
    assert "Why a bigger local batch makes it worse" in text
    for technique in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "Tensor parallelism", "Pipeline parallelism"):
        assert technique in text
    assert f"Recommended: {plan_70b.best.layout.describe()}" in text


def test_layout_parsing_names_the_bad_key():
    layout = parse_layout("dp_shard=64,zero_stage=2")
    assert (layout.dp_shard, layout.zero_stage) == (64, 2)
    assert parse_layout("dp_shard=8").zero_stage == 3  # the config's default for sharded data parallelism
    assert parse_layout("pp=4,schedule=zbv").virtual_stages == 2
    with pytest.raises(ValueError, match="KEY one of"):
        parse_layout("dp_sharded=2")
    with pytest.raises(ValueError, match="expected an integer"):
        parse_layout("tp=two")
    with pytest.raises(ValueError, match="needs zero_stage 2 or 3"):
        parse_layout("dp_shard=2,zero_stage=1,offload=true")


def test_hf_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "intermediate_size": 14336,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0}))
    assert model_from_hf_config(path) == get_preset("llama3-8b")
    path.write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="model_type 't5' is not supported"):
        model_from_hf_config(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not a JSON file"):
        model_from_hf_config(path)


def test_plan_json_schema_and_bad_flags(capsys):
    meshfit = in_process(capsys)  # the command's own code, without a process start per call
    res = meshfit("plan", "--model", "llama3-8b", "--nodes", "2", "--seq-len", "4096", "--json", "--top", "3")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["model"]["params"] == 8_030_261_248 and doc["evaluated"] >= 1000
    cand = doc["candidates"][0]
    assert set(cand) >= {"layout", "fits", "memory", "step_time_s", "tokens_per_s", "mfu", "why"}
    assert set(cand["memory"]) == {"params", "grads", "optim", "activations", "buffers", "total", "at_rest"}
    assert cand["memory"]["total"] == sum(cand["memory"][k] for k in ("params", "grads", "optim", "activations",
                                                                       "buffers"))
    rest = cand["memory"]["at_rest"]
    assert rest["total"] == rest["params"] + rest["grads"] + rest["optim"] <= cand["memory"]["total"]
    # DDP on 16 GPUs under mixed precision: a full fp32 replica and AdamW's two moments between steps (12
    # bytes/param), plus fp32 gradients during the step (16).
    ddp = meshfit("plan", "--model", "llama3-8b", "--nodes", "2", "--seq-len", "4096", "--json",
                  "--layout", "dp_replicate=16")
    memory = json.loads(ddp.stdout)["candidates"][0]["memory"]
    assert memory["at_rest"]["total"] == 12 * 8_030_261_248
    assert memory["grads"] == 4 * 8_030_261_248
    bad = meshfit("plan", "--model", "llama3-8b", "--layout", "dp_shard=16,zero_stage=5", "--nodes", "2")
    assert bad.returncode == 2 and "zero_stage=5 must be 0, 1, 2 or 3" in bad.stderr
    bad = meshfit("plan", "--model", "llama3-9b")
    assert bad.returncode == 2 and "not a preset" in bad.stderr and "llama3-8b" in bad.stderr
    # Flags that are layout keys too apply to --layout (once: a contradiction is refused, tests/test_bad_inputs.py).
    both = meshfit("plan", "--model", "llama3-8b", "--json", "--layout", "dp_shard=8,zero_stage=3,micro_batch=2",
                   "--micro-batch", "2", "--activation-checkpointing", "full")
    assert both.returncode == 0, both.stderr
    layout = json.loads(both.stdout)["candidates"][0]["layout"]
    assert (layout["micro_batch"], layout["activation_checkpointing"]) == (2, "full")


def test_verify_says_whether_the_peak_fits_the_device(capsys):
    meshfit = in_process(capsys)
    args = ("verify", "--model", "tiny", "--seq-len", "64", "--layout", "dp_shard=2,zero_stage=3", "--json")
    fits = json.loads(meshfit(*args).stdout)
    assert fits["fits"] is True and fits["gpu"] == "H100-SXM" and fits["measured"]["total"] < fits["usable_bytes"]
    small = meshfit(*args[:-1], "--gpu-memory", "1MiB")
    assert small.returncode == 0, small.stderr
    needed = fits["measured"]["total"]
    assert "does not fit" in small.stdout and f"{needed / 2**20:.1f} MiB needed" in small.stdout


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_plan_file_runs_with_train(tmp_path):
    plan_file = tmp_path / "plan.json"
    res = meshfit("plan", "--model", "tiny", "--gpus-per-node", "2", "--seq-len", "64", "--global-batch", "8",
                  "--precision", "fp32", "--layout", "dp_shard=2,zero_stage=3,micro_batch=2", "--out", str(plan_file))
    assert res.returncode == 0, res.stderr
    predicted = json.loads(plan_file.read_text())["predicted"]["memory"]["total"]
    res = meshfit("train", "--plan", str(plan_file), "--nproc", "2", "--set", "train.steps=3",
                  "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["world_size"] == 2 and result["zero_stage"] == 3
    assert predicted == pytest.approx(result["peak_mem_bytes"], rel=0.1)
    missing = meshfit("train", "--plan", str(plan_file))
    assert missing.returncode == 2 and "add --nproc 2" in missing.stderr


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_the_cli_and_the_planner_import_without_torch():
    # `meshfit plan` answers in seconds because nothing on its path imports torch (about 2.5 s here).
    import subprocess
    import sys

    code = ("import sys, meshfit.commands.main, meshfit.planner.search, meshfit.planner.explain, meshfit.models; "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_the_run_header_names_the_model_a_plan_file_describes():
    """A plan file spells every dimension out; the header still names the preset it has the shape of."""
    from meshfit.config import load_config
    from meshfit.layout.layout import Layout, Workload
    from meshfit.models import get_preset
    from meshfit.planner.planfile import plan_sections
    from meshfit.train.launch import banner
    from meshfit.train.shape import resolve_run

    work = Workload(seq_len=2048, global_batch=8, precision="mixed")
    for preset in ("llama3-8b", "gpt3-125m"):
        cfg = load_config(None, sections=plan_sections(get_preset(preset), work, Layout(micro_batch=1)))
        assert cfg.model.preset is None  # the plan's model section names no preset
        line = banner(cfg, resolve_run(cfg, 1), Path("runs/x"), 1, None)
        assert line.startswith(f"meshfit train: model {preset}, "), line
    cfg = load_config(None, ["model.preset=llama3-8b", "model.n_layers=4"])
    assert "model custom llama (preset llama3-8b reshaped), " in banner(cfg, resolve_run(cfg, 1), Path("r"), 1, None)
