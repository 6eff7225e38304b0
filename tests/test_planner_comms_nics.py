"""Collectives that span nodes run on the NICs of the group's GPUs in a node (planner/timing/comms.py)."""

import pytest

from meshfit.hardware.catalog import Cluster
from meshfit.layout.layout import Layout, Workload
from meshfit.models.presets import get_preset
from meshfit.planner.timing.comms import ALPHA_INTER_S, COLLECTIVE_BW_EFFICIENCY, collective_s, link
from meshfit.planner.timing.estimate import step_time

A100_NIC = 200e9 / 8  # DGX A100: one 200 Gb/s HDR NIC per GPU
A100 = Cluster("A100-80GB", nodes=4, gpus_per_node=8)


def test_a_group_of_whole_nodes_sends_through_all_their_nics():
    # FSDP over 32 GPUs on 4 nodes: each node's 8 GPUs are consecutive in the ring, whose traffic leaves the
    # node through 8 NICs (8 × 25 GB/s), below the 300 GB/s of NVLink.
    bw, alpha = link(A100, 1, 32, "all_gather")
    assert bw == pytest.approx(8 * A100_NIC * COLLECTIVE_BW_EFFICIENCY)
    assert alpha == ALPHA_INTER_S
    # Ranks 2 apart (under TP 2): 4 of the group's GPUs per node, 4 NICs.
    assert link(A100, 2, 16, "reduce_scatter")[0] == pytest.approx(4 * A100_NIC * COLLECTIVE_BW_EFFICIENCY)
    # H100: 8 × 400 Gb/s = 400 GB/s, below NVLink's 450.
    h100 = Cluster("H100-SXM", nodes=2, gpus_per_node=8)
    assert link(h100, 1, 16, "all_reduce")[0] == pytest.approx(400e9 * COLLECTIVE_BW_EFFICIENCY)


def test_one_gpu_per_node_and_point_to_point_use_one_nic():
    # Data-parallel replicas of TP 8 are 8 ranks apart: one GPU of the group per node.
    assert link(A100, 8, 4, "all_reduce")[0] == pytest.approx(A100_NIC * COLLECTIVE_BW_EFFICIENCY)
    # A pipeline send between nodes goes through its GPU's NIC.
    assert link(A100, 1, 16, "send_recv")[0] == pytest.approx(A100_NIC * COLLECTIVE_BW_EFFICIENCY)


def test_more_nics_than_nvlink_stays_at_the_intra_node_rate():
    few_fat_nics = Cluster("A100-80GB", nodes=2, gpus_per_node=16)
    assert link(few_fat_nics, 1, 32, "all_gather")[0] == pytest.approx(300e9 * COLLECTIVE_BW_EFFICIENCY)


def test_zero3_over_four_a100_nodes_gathers_at_the_nodes_nic_rate():
    # A 70B-parameter model gathered in bf16 over 32 ranks: (31/32) · 140 GB at 8 × 25 GB/s × 0.8, plus a
    # latency per hop and call (one 25 GB/s NIC per GPU would take about 6.8 s). llm-foundry trains MPT-70B
    # with FSDP on 32 A100s (4 nodes, micro-batch 2) at 0.91 of its 64-GPU rate per GPU: hidden gathers.
    nbytes = 70e9 * 2
    t = collective_s(A100, "all_gather", 1, 32, nbytes)
    assert t == pytest.approx(31 / 32 * nbytes / (8 * A100_NIC * COLLECTIVE_BW_EFFICIENCY) + 31 * ALPHA_INTER_S)
    assert t < 1.2
    layout = Layout(dp_shard=32, zero_stage=3, micro_batch=2, activation_checkpointing="full")
    work = Workload(seq_len=2048, global_batch=1024)
    st = step_time(get_preset("llama3-70b"), layout, work, A100)
    assert st.dp_comm_s == 0.0  # hidden behind 16 micro-batches of compute
