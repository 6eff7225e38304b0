"""Sizes, paths and wording of plan / verify / calibrate: bounded sizes, files that exist or cannot be
written, a measurement that cannot be saved, CPU ranks spoken of as CPU ranks, verify's title, BPE's note."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshfit.calibrate import measure as calibrate_mod
from meshfit.commands.main import main
from meshfit.data.files import _bpe_tokenizer, tokenizer_note
from meshfit.hardware.profile import HardwareProfile, Link, load_profile, save_profile
from meshfit.util.paths import PathError, check_out_file, read_text
from meshfit.util.units import MAX_BYTES, parse_bytes

PLAN = ["plan", "--model", "tiny", "--gpus-per-node", "2", "--seq-len", "64", "--global-batch", "8",
        "--precision", "fp32", "--layout", "dp_shard=2"]


def _profile(model: bool = True) -> HardwareProfile:
    """A CPU profile of two ranks (rates made up, shaped as `meshfit calibrate` writes them)."""
    link = Link(bus_bytes_per_s=1e9, latency_s=1e-4)
    rates = {"fp32": 1e10, "bf16": 1e10}
    return HardwareProfile(device="cpu", device_name="test", backend="gloo", ranks=2, threads_per_rank=1,
                           matmul_flops=rates, attention_flops=rates, elementwise_bytes_per_s=1e10,
                           collectives={2: {"all_reduce": link, "all_gather": link, "reduce_scatter": link,
                                            "send_recv": link}},
                           model_flops=rates if model else None, seq=64 if model else 0)


# ---- sizes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1e400GiB", "2000000TiB", float("inf"), 10**400, MAX_BYTES + 1])
def test_a_size_beyond_an_exabyte_is_refused(value):
    with pytest.raises(ValueError, match="larger than any machine's memory .*1 EiB"):
        parse_bytes(value)


def test_sizes_up_to_an_exabyte_and_not_a_number():
    assert parse_bytes(MAX_BYTES) == MAX_BYTES and parse_bytes("1024TiB") == 2**50
    assert parse_bytes("1.5 GiB") == 3 * 2**29 and parse_bytes(300) == 300
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(math.nan)
    with pytest.raises(ValueError, match="cannot read 'inf' as a size"):
        parse_bytes("inf")


# ---- paths ------------------------------------------------------------------------------------------------


def test_out_file_check_leaves_nothing_behind(tmp_path):
    new = tmp_path / "new.json"
    check_out_file(new, "--out", False, "x.json")
    assert not new.exists()  # the probe file is removed again
    old = tmp_path / "old.json"
    old.write_text("keep me")
    with pytest.raises(PathError, match=r"--out .*old.json exists: replace it with --overwrite"):
        check_out_file(old, "--out", False, "x.json")
    check_out_file(old, "--out", True, "x.json")
    assert old.read_text() == "keep me"  # opened in place, not truncated
    with pytest.raises(PathError, match="the folder .*nope does not exist"):
        check_out_file(tmp_path / "nope" / "a.json", "--out", False, "x.json")
    check_out_file(tmp_path / "nope" / "a.json", "--out", False, "x.json", make_parents=True)
    assert not (tmp_path / "nope").exists()


def test_reading_a_directory_or_binary_file_names_it(tmp_path):
    with pytest.raises(PathError, match=r"is a directory, not a hardware profile"):
        read_text(tmp_path, "hardware profile")
    (tmp_path / "b.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PathError, match=r"b.json: not a plan file \(byte 0 is not UTF-8 text\)"):
        read_text(tmp_path / "b.json", "plan file")


def test_plan_out_replaces_a_file_only_with_overwrite(tmp_path, capsys):
    out = tmp_path / "plan.json"
    out.write_text("an earlier plan")
    assert main([*PLAN, "--out", str(out)]) == 2
    assert out.read_text() == "an earlier plan"
    assert "exists: replace it with --overwrite" in capsys.readouterr().err
    assert main([*PLAN, "--out", str(out), "--overwrite"]) == 0
    assert json.loads(out.read_text())["format"] == "meshfit-plan/1"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, a folder where no file can be created")
def test_calibrate_refuses_an_unwritable_out_before_measuring(monkeypatch, capsys):
    def measured(*args, **kwargs):
        raise AssertionError("the measurement started")

    monkeypatch.setattr(calibrate_mod, "calibrate", measured)
    assert main(["calibrate", "--out", "/proc/meshfit-hw.json"]) == 2
    err = capsys.readouterr().err
    assert "error: --out /proc/meshfit-hw.json cannot be written" in err and "calibrating" not in err


def test_a_measurement_that_cannot_be_saved_is_kept(tmp_path, monkeypatch, capsys):
    out = tmp_path / "hw.json"
    monkeypatch.setattr(calibrate_mod, "calibrate", lambda *args, **kwargs: _profile())
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    real_save = save_profile

    def save(profile, path):  # the folder vanished while the ranks measured
        if Path(path) == out:
            raise FileNotFoundError(2, "No such file or directory")
        real_save(profile, path)

    monkeypatch.setattr("meshfit.hardware.profile.save_profile", save)
    assert main(["calibrate", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    kept = list((tmp_path / "tmp").glob("meshfit-hardware-*.json"))
    assert len(kept) == 1 and load_profile(kept[0]) == _profile()
    assert f"--out {out} could not be written after the measurement" in captured.err
    assert f"it is kept in {kept[0]}" in captured.err and "Traceback" not in captured.err
    assert HardwareProfile.model_validate_json(captured.out) == _profile()  # and printed


# ---- wording ----------------------------------------------------------------------------------------------


def test_cpu_plan_speaks_of_cpu_ranks_and_says_what_mfu_is_relative_to(tmp_path, capsys):
    hw = tmp_path / "hw.json"
    save_profile(_profile(), hw)
    args = ["plan", "--model", "tiny", "--gpu", "cpu", "--gpu-memory", "80MiB", "--gpus-per-node", "2",
            "--seq-len", "64", "--global-batch", "8", "--hardware", str(hw)]
    assert main([*args, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "on 2 CPU ranks (1 × 2)" in out and "usable per CPU rank" in out
    assert "MFU is relative to this machine's measured training rate of the calibrated model" in out
    assert "every one of the 2 CPU ranks holds that full replica" in out
    assert "GPU" not in out and "CUDA" not in out
    assert main([*args, "--layout", "dp_shard=4"]) == 2
    assert "--layout spans 4 CPU ranks" in capsys.readouterr().err
    save_profile(_profile(model=False), hw)
    assert main(args) == 0
    assert "MFU is relative to this machine's measured matmul rate" in capsys.readouterr().out


def test_verify_title_in_whole_phrases_and_cpu_wording(capsys):
    assert main(["verify", "--model", "tiny", "--seq-len", "64", "--global-batch", "4", "--gpu", "cpu",
                 "--gpu-memory", "80MiB", "--layout", "dp_shard=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 100 for line in lines), lines
    assert lines[0].startswith("tiny, zero3 dp=2") and lines[0].endswith("at 2 ranks: rank 0")
    assert lines[1] == "predicted vs measured by a fake-tensor run of the real code"
    text = "\n".join(lines)
    assert "each CPU rank: fits" in text and "CUDA" not in text and "train.memory_budget" in text


def test_bpe_with_256_tokens_learns_no_merges_and_says_so():
    tok = _bpe_tokenizer(Path("t.txt"), ["the cat sat on the mat " * 20], 256, None)
    assert json.loads(tok.to_str())["model"]["merges"] == []  # the fact the note states
    assert "learns no merges" in tokenizer_note("bpe", 256)
    assert tokenizer_note("bpe", 512) is None and tokenizer_note("byte", 256) is None
