"""The rendezvous of a local launch (`meshfit train --nproc N`), listening on the loopback interface only.

torch's elastic agent hosts two TCP stores in the launcher: the c10d rendezvous store, and the store it
shares with the ranks for their process group. TCPStore binds its server to every interface, so both
would be reachable from the network for as long as the run lasts, although every rank of a local launch
connects through 127.0.0.1. This backend hands both servers a socket already bound to 127.0.0.1
(TCPStore's `master_listen_fd`) and names 127.0.0.1 as the ranks' master address. Multi-node runs go
through torchrun's own `c10d` backend, as documented, and are not affected.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from meshfit.util.ranks import LOOPBACK, loopback_store

BACKEND = "meshfit-loopback"


class _LoopbackRendezvous(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, whose store for the ranks listens on the loopback interface."""

    def get_backend(self) -> str:
        # The launcher checks that the handler it got is the backend it asked for.
        return BACKEND

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        return loopback_store(master_port)


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    _, _, port = params.endpoint.rpartition(":")
    store = loopback_store(int(port or 0))
    backend = C10dRendezvousBackend(store, params.run_id)
    return _LoopbackRendezvous.from_backend(params.run_id, store, backend, params.min_nodes, params.max_nodes,
                                            local_addr=LOOPBACK)


def register() -> str:
    """Make the backend known to torch's launcher (idempotent); returns its name for LaunchConfig."""
    registry.register(BACKEND, _create_handler)
    return BACKEND
