"""Pipeline memory that does not grow with a step's micro-batch count.

torch.distributed.pipelining keeps, per micro-batch of a step, a receive buffer for the stage input and
one for the output gradient (allocated once, for every micro-batch, and kept between steps), and its
multi-stage runtime keeps every send's work, and with it the sent tensor, until the end of the step. With
m micro-batches that is O(m) boundary tensors on every rank, whatever the schedule keeps in flight.

Two pieces bound it by what the schedule keeps in flight, without changing what is computed or sent:

* ``LeanStage`` (a ``PipelineStage``) allocates a receive buffer when the schedule asks for the receive
  and drops its own reference once the micro-batch's forward (activation) or backward (gradient) has used
  it: the autograd graph keeps what backward still needs, nothing else does.
* ``SendWaits`` takes over the multi-stage runtime's SEND_F / SEND_B actions (the same ops, issued at the
  same point) and waits for each send as soon as the peer has provably posted its receive: a happens-before
  analysis of every rank's action list (``pipeline_order_with_comms``) says after which of this rank's own
  computations that is known. Waiting then never blocks on the peer's progress, so it cannot deadlock.

Both lean on torch internals that are not public API; where one is missing (another torch version) the
piece is not installed and torch's own behaviour remains.
"""

from __future__ import annotations

import bisect
import copy
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules

try:  # private in torch; without it sends are left to torch
    from torch.distributed.pipelining.schedules import _batch_p2p, _ComputationType
except ImportError:  # pragma: no cover - depends on the torch version
    _batch_p2p = _ComputationType = None


def _wait(works: list) -> None:
    """Wait as torch's schedules wait for their transfers (looked up at call time, so that timing or
    tracing torch's waits sees these too)."""
    wait = getattr(_schedules, "_wait_batch_p2p", None)
    if wait is not None:
        wait(works)
    else:  # pragma: no cover - depends on the torch version
        for work in works:
            work.wait()


def _placeholder(buffer: torch.Tensor) -> torch.Tensor:
    """A storage-less stand-in with the buffer's shape and dtype (meta device)."""
    return torch.empty_like(buffer, device="meta", requires_grad=False)


class LeanStage(PipelineStage):
    """A PipelineStage whose receive buffers live only while their micro-batch needs them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send_waits: SendWaits | None = None  # set by SendWaits.install

    # -- receive buffers: placeholders between uses ------------------------------------------------
    @staticmethod
    def _buffers(infos):
        """The receive entries that hold a buffer (torch versions differ in how root inputs are marked)."""
        return [info for info in infos if not getattr(info, "is_root_arg", False)
                and isinstance(getattr(info, "buffer", None), torch.Tensor)]

    def _release(self, infos) -> None:
        for info in self._buffers(infos):
            if info.buffer.device.type != "meta":
                info.buffer = _placeholder(info.buffer)

    def _allocate(self, infos) -> None:
        for info in self._buffers(infos):
            if info.buffer.device.type == "meta":
                info.buffer = torch.empty_like(info.buffer, device=self.device)

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        # torch allocates a buffer per micro-batch here: build one, and share its metadata as placeholders.
        super()._setup_forward_recv_info(1, has_backward)
        self._release(self.args_recv_info[0])
        for chunk in range(1, num_microbatches):
            self.args_recv_info[chunk] = tuple(copy.copy(info) for info in self.args_recv_info[0])

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any):
        out = super()._prepare_forward_infra(*args, **kwargs)
        for infos in self.args_recv_info.values():  # torch versions that allocate elsewhere
            self._release(infos)
        return out

    def _create_grad_recv_info(self, *args: Any, **kwargs: Any):
        infos = super()._create_grad_recv_info(*args, **kwargs)
        self._release(infos)  # one at a time: no transient of every micro-batch's buffer
        return infos

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        # A forward-only pass (schedule.eval) receives no gradient, as torch's own method says: nothing to
        # allocate, and before a first backward (`meshfit eval`) not even the entries to allocate exist.
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        self._allocate(self.grad_recv_info[mb_index])  # a None gradient zero-fills the buffer
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    # -- compute: drop the buffers once used; wait for sends known to be received -----------------
    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        self._reached("F", fwd_chunk_id)
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            if not self.is_first:  # the received input is saved by autograd where backward needs it
                self._release(self.args_recv_info[fwd_chunk_id])

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        self._reached("B", bwd_chunk_id)
        try:
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            if not self.is_last and bwd_chunk_id in self.grad_recv_info:
                self._release(self.grad_recv_info[bwd_chunk_id])
            loss = kwargs.get("loss")
            if self.is_last and self.has_backward and isinstance(loss, torch.Tensor) and not loss._is_view():
                # The schedule keeps every micro-batch's loss to the end of the step; its spent graph
                # (AccumulateGrad nodes) would keep the received input alive with it.
                loss.detach_()

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        self._reached("W", bwd_chunk_id)
        return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    def _reached(self, kind: str, mb: int) -> None:
        if self.send_waits is not None:
            self.send_waits.reached(self.stage_index, kind, mb)


_KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}


def _computes(action) -> list:
    """The computations an action runs, in order (an overlapped F+B action runs its sub-actions)."""
    if action.sub_actions:
        return [a for a in action.sub_actions if a.computation_type.name in _KIND]
    return [action] if action.computation_type.name in _KIND else []


# A computation that runs after a receive: (its RECV action, the peer's SEND action, the peer's stage offset).
_RECEIVES = {"FORWARD": ("RECV_F", "SEND_F", -1), "FULL_BACKWARD": ("RECV_B", "SEND_B", 1),
             "BACKWARD_INPUT": ("RECV_B", "SEND_B", 1)}


def _waits_for(computation, own: dict) -> tuple[str, int, int] | None:
    """The peer's send that ``computation`` waits for (None when its input comes from this rank)."""
    spec = _RECEIVES.get(computation.computation_type.name)
    if spec is None or (spec[0], computation.stage_index, computation.microbatch_index) not in own:
        return None
    return spec[1], computation.stage_index + spec[2], computation.microbatch_index


def wait_points(order: dict[int, list], rank: int) -> dict[tuple[int, str, int], list[tuple[str, int, int]]]:
    """For each send of ``rank`` (key ``(SEND_F|SEND_B, stage, mb)``), the first of its own computations
    ``(stage, "F"|"B"|"W", mb)`` by whose start the peer has certainly posted the matching receive.

    Vector clocks over every rank's action list: a computation that waits for a receive happens after the
    peer's matching send action, hence after everything the peer did before it. Sends with no such point
    (the last ones of a step) are absent: they are waited for at the end of the step, as torch does."""
    index = {r: {} for r in order}  # rank -> (type, stage, mb) -> position in its list
    for r, actions in order.items():
        for i, a in enumerate(actions):
            index[r][(a.computation_type.name, a.stage_index, a.microbatch_index)] = i
    ranks = sorted(order)
    where = {key: r for r, keys in index.items() for key in keys}
    clock = {r: [-1] * len(ranks) for r in ranks}
    send_clock: dict[tuple[str, int, int], list[int]] = {}
    mine: list[tuple[int, tuple[int, str, int], list[int]]] = []  # (position, computation, clock after)
    pos = {r: 0 for r in ranks}
    progressed = True
    while progressed:
        progressed = False
        for r in ranks:
            actions = order[r]
            while pos[r] < len(actions):
                a = actions[pos[r]]
                deps = [_waits_for(c, index[r]) for c in _computes(a)]
                if any(d is not None and d not in send_clock for d in deps):
                    break  # the peer has not sent it yet in this simulation
                clock[r][ranks.index(r)] = pos[r]
                # Computations of an overlapped action run one after the other, each after its own receive.
                for c, d in zip(_computes(a), deps, strict=True):
                    if d is not None:
                        clock[r] = [max(x, y) for x, y in zip(clock[r], send_clock[d], strict=True)]
                    if r == rank:
                        mine.append((pos[r], (c.stage_index, _KIND[c.computation_type.name], c.microbatch_index),
                                     list(clock[r])))
                name = a.computation_type.name
                if name in ("SEND_F", "SEND_B"):
                    send_clock[(name, a.stage_index, a.microbatch_index)] = list(clock[r])
                pos[r] += 1
                progressed = True
    if any(pos[r] < len(order[r]) for r in ranks):
        raise ValueError("pipeline action lists do not complete: unmatched send or receive")
    points: dict[tuple[int, str, int], list[tuple[str, int, int]]] = defaultdict(list)
    positions = [position for position, _, _ in mine]
    for i, a in enumerate(order[rank]):
        name = a.computation_type.name
        if name not in ("SEND_F", "SEND_B"):
            continue
        peer_stage = a.stage_index + (1 if name == "SEND_F" else -1)
        recv = ("RECV_F" if name == "SEND_F" else "RECV_B", peer_stage, a.microbatch_index)
        peer, posted = ranks.index(where[recv]), index[where[recv]][recv]
        # Clocks only grow along the rank's computations: the first one that has seen the receive posted.
        first = bisect.bisect_right(positions, i)
        at = first + bisect.bisect_left([seen[peer] for _, _, seen in mine[first:]], posted)
        if at < len(mine):
            points[mine[at][1]].append((name, a.stage_index, a.microbatch_index))
    return dict(points)


class SendWaits:
    """Runs a multi-stage schedule's send actions and waits for each at its wait point (see wait_points)."""

    def __init__(self, schedule, stages: list[LeanStage]) -> None:
        self.schedule = schedule
        self.stages = {s.stage_index: s for s in stages}
        self.rank = stages[0].group_rank
        self.pending: dict[tuple[str, int, int], list] = {}
        self._points: dict[tuple[int, str, int], list[tuple[str, int, int]]] | None = None

    @classmethod
    def install(cls, schedule, stages: list[PipelineStage]) -> SendWaits | None:
        """Take over ``schedule``'s sends when this torch offers what it needs; else None (torch's own way)."""
        handlers = getattr(schedule, "_comp_type_to_function_map", None)
        if (_batch_p2p is None or not isinstance(handlers, dict)
                or not hasattr(schedule, "pipeline_order_with_comms")
                or not all(isinstance(s, LeanStage) for s in stages)):
            return None
        waits = cls(schedule, stages)
        for name in ("SEND_F", "SEND_B"):
            handlers[_ComputationType[name]] = waits._send
        for stage in stages:
            stage.send_waits = waits
        return waits

    def _send(self, action, ctx: Any = None) -> None:
        stage = self.stages[action.stage_index]
        name = action.computation_type.name
        ops = (stage.get_fwd_send_ops if name == "SEND_F" else stage.get_bwd_send_ops)(action.microbatch_index)
        self.pending[(name, action.stage_index, action.microbatch_index)] = _batch_p2p(ops)

    def reached(self, stage: int, kind: str, mb: int) -> None:
        if not self.stages[stage].has_backward:
            return  # forward only (eval): backward's messages, which the wait points count on, never come
        if self._points is None:  # the action lists are final once the schedule runs
            self._points = wait_points(self.schedule.pipeline_order_with_comms, self.rank)
        for key in self._points.get((stage, kind, mb), ()):
            _wait(self.pending.pop(key, []))

    def drain(self, failed: bool = False) -> None:
        """Wait for the step's remaining sends (torch's runtime does this at the end of every step); after a
        failed step forget them (a peer may never receive them)."""
        while self.pending:
            works = self.pending.popitem()[1]
            if not failed:
                _wait(works)
