"""A local launch listens on 127.0.0.1 alone: nothing of a `meshfit train --nproc N` run (the launcher's
rendezvous and process-group stores, the ranks' collectives) can be reached from another machine."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def _listening() -> dict[str, str]:
    """Every listening TCP socket of this machine: inode → local address, as ip:port."""
    found = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            address, port = fields[1].split(":")
            ip = (".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)) if width == 8
                  else f"[{address}]")
            found[fields[9]] = f"{ip}:{int(port, 16)}"
    return found


def _sockets_of(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return inodes


def _tagged(tag: str) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"PROBE_TAG={tag}".encode() in entry.joinpath("environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket tables")
def test_a_local_launch_listens_on_loopback_only(tmp_path):
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "r"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "meshfit", "train", "--nproc", "2", "--set", "train.steps=100000",
         "--run-dir", str(run_dir)], env=dict(os.environ, PROBE_TAG=tag),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (run_dir / "metrics.jsonl").exists(), "the ranks did not start training"
        processes = _tagged(tag)
        listening = _listening()
        ours = sorted(listening[inode] for inode in _sockets_of(processes) if inode in listening)
    finally:
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=90)
    assert len(processes) >= 3, processes  # the launcher and its 2 ranks
    # The launcher hosts two stores (rendezvous, process group); each rank listens for gloo's pairs.
    assert len(ours) >= 4, ours
    assert all(address.startswith("127.0.0.1:") for address in ours), ours
    assert launcher.returncode == 128 + signal.SIGINT, err  # stopped as asked, after a checkpoint
