"""Where the run's TCP stores listen: on the address they are given, not on every interface.

torch's `TCPStore(host, port, is_master=True)` ignores `host` when it listens: it binds `*:port`
(IPv4 and IPv6), so the store (which has no authentication, and through which ranks exchange
pickled objects) answers anyone on the network. `store_server(host, port, ...)` binds a socket
to `host`'s address first and hands it to the store (`master_listen_fd`), so the store listens
there only: 127.0.0.1 for a run on one machine, the address the launcher names on several.

`loopback_rendezvous()` applies this to the stores of torchrun's c10d rendezvous (the
rendezvous store and the store the ranks share) while megappo's own launcher runs torchrun in
this process on one machine; `loopback_interface()` names the interface gloo must use
(GLOO_SOCKET_IFNAME) so that its own sockets listen on loopback too (docs/launchers.md).

This module does not know about models, configs or what is stored.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`'s address (its first IPv4 address, else IPv6) and `port` (0: any free one)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(socket.SOMAXCONN)
    return sock


def store_server(host: str, port: int, world_size: int | None = None, *,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300), multi_tenant: bool = False,
                 wait_for_workers: bool = True) -> "torch.distributed.TCPStore":
    """A TCPStore server that listens on `host`'s address only (see the module docstring)."""
    import torch.distributed as dist

    sock = bind_listener(host, port)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, multi_tenant=multi_tenant,
                         wait_for_workers=wait_for_workers, master_listen_fd=sock.detach())


def loopback_interface() -> str:
    """The name of the network interface that holds 127.0.0.1 ('lo' on Linux)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    return "lo"


@contextlib.contextmanager
def loopback_rendezvous():
    """While entered, the stores torchrun's c10d rendezvous hosts in this process (the rendezvous
    store at --rdzv-endpoint and the store shared with the ranks at --local-addr) listen on that
    address only, when it is a loopback address; other addresses are left as torch binds them."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    tcp_store, create_server = backend.TCPStore, DynamicRendezvousHandler._create_tcp_store_server

    def rendezvous_store(host, port, *args, is_master=False, multi_tenant=False, timeout=None, **kw):
        if is_master and is_loopback(host) and not args and not kw:
            return store_server(host, port, timeout=timeout, multi_tenant=multi_tenant, wait_for_workers=False)
        return tcp_store(host, port, *args, is_master=is_master, multi_tenant=multi_tenant, timeout=timeout, **kw)

    def shared_store(self, master_addr, master_port):
        if is_loopback(master_addr):
            return store_server(master_addr, master_port, multi_tenant=True, wait_for_workers=False)
        return create_server(self, master_addr, master_port)

    backend.TCPStore, DynamicRendezvousHandler._create_tcp_store_server = rendezvous_store, shared_store
    try:
        yield
    finally:
        backend.TCPStore, DynamicRendezvousHandler._create_tcp_store_server = tcp_store, create_server
