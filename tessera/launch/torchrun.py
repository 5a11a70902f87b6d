"""torchrun itself, with one change: the c10d rendezvous store listens only on the endpoint's address.

torch's c10d rendezvous backend (``--rdzv-backend=c10d``) starts its TCPStore server on every
interface of the ``--rdzv-endpoint`` machine, and that store is unauthenticated. torchrun loads
rendezvous handlers by name, so ``tessera train`` runs this module instead of
``torch.distributed.run``: it registers ``tessera-c10d``, the stock c10d handler whose server
socket is bound to the endpoint's address, and then hands over to torchrun's own ``main``.
Everything else (agents, restarts, the rendezvous protocol) is torchrun's.

    python -m tessera.launch.torchrun --nnodes=2 --rdzv-backend=tessera-c10d \\
        --rdzv-endpoint=10.0.0.1:29400 --nproc-per-node=4 -m tessera.train.run config.yaml
"""

from __future__ import annotations

import datetime
import errno

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

from tessera.distributed import serve_store_on

BACKEND = "tessera-c10d"
DEFAULT_PORT = 29400  # torchrun's


def _rendezvous_store(params: RendezvousParameters) -> Store:
    """The rendezvous store: served here, bound to the endpoint address, when this machine is the
    endpoint (as torch decides it: ``is_host`` in --rdzv-conf, else the address is this machine's);
    a client otherwise, or when another agent on this machine already serves it."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        is_host = _matches_machine_hostname(host)
    if is_host:
        try:
            return serve_store_on(host, port, timeout, multi_tenant=True)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or params.get_as_bool("is_host"):
                raise
            # like torch: a second agent on the endpoint machine joins the one that serves it
    return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)


class _BoundC10dBackend(C10dRendezvousBackend):
    """torch's c10d backend under its registered name (torchrun checks that the two agree)."""

    @property
    def name(self) -> str:
        return BACKEND


def bound_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous handler over a store that listens on the endpoint address only."""
    if params.get("store_type", "tcp").strip().lower() != "tcp":  # a file store has no socket: torch's own
        _, store = create_backend(params)
    else:
        store = _rendezvous_store(params)
    return create_handler(store, _BoundC10dBackend(store, params.run_id), params)


def main() -> None:
    from torch.distributed.run import main as torchrun_main

    registry.register(BACKEND, bound_c10d_handler)
    torchrun_main()


if __name__ == "__main__":
    main()
