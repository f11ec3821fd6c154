"""ZeroMQ sockets and addresses of the parameter server (pyzmq).

A server binds one ROUTER socket; each worker connects a DEALER to every
server (and one for heartbeats), authenticated (:mod:`gradcomp.ps.auth`). ZeroMQ frames every message
(a receiver never sizes a buffer from a peer's header), keeps a queue per
peer connection bounded by a high-water mark (``SNDHWM`` / ``RCVHWM``, in
messages), drops a connection whose peer sends a frame over ``MAXMSGSIZE``,
and reconnects a DEALER by itself. The server sends without blocking with
``ROUTER_MANDATORY``: a peer whose queue is full (it does not read) makes
the send fail at once instead of stalling the server (Hintjens, "ZeroMQ",
O'Reilly 2013, ch. 3; the design of ps-lite and BytePS).

Addresses: a server binds ``tcp://HOST:PORT``. HOST, unless given, is
``$GRADCOMP_PS_HOST``, else the local address of the interface that routes
to ``$MASTER_ADDR`` (set by torchrun: the right interface on a multi-host
job, loopback on one host), else ``127.0.0.1``; PORT 0 lets the OS pick a
free port. The servers' addresses reach the workers by one
``all_gather_object`` over the process group when the roles are built, or
are given to a worker explicitly (``server_addresses``), e.g. to a
restarted worker process outside the group.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import torch.distributed as dist

__all__ = ["default_host", "normalize_address", "bind_router", "connect_dealer", "exchange_addresses"]

#: environment variable naming the host (interface address) servers bind to
HOST_ENV = "GRADCOMP_PS_HOST"


def default_host() -> str:
    """The host a server binds to when none is given (see the module docstring)."""
    host = os.environ.get(HOST_ENV)
    if host:
        return host
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            return _local_address_towards(master, int(os.environ.get("MASTER_PORT", "29500") or 29500))
        except (OSError, ValueError):
            pass
    return "127.0.0.1"


def _local_address_towards(host: str, port: int) -> str:
    """The local IP address the kernel would use to reach ``host`` (a UDP
    ``connect`` sends nothing; it only picks the route)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def normalize_address(address: str | None, argname: str = "address") -> str:
    """``"host"``, ``"host:port"`` or ``"tcp://host:port"`` (None: the
    :func:`default_host`, port 0) -> ``"tcp://host:port"`` (IPv6 hosts in brackets).

    Raises:
        TypeError / ValueError: not a string, or not of one of these forms.
    """
    if address is None:
        address = default_host()
    if not isinstance(address, str):
        raise TypeError(f"{argname} must be a string like 'tcp://10.0.0.1:5555' or None, "
                        f"got {type(address).__name__}")
    rest = address[len("tcp://"):] if address.startswith("tcp://") else address
    if "://" in rest or not rest:
        raise ValueError(f"{argname} must be 'host', 'host:port' or 'tcp://host:port', got {address!r}")
    if rest.startswith("["):  # [v6]:port
        host, _, port = rest[1:].partition("]")
        port = port[1:] if port.startswith(":") else (port or "0")
    elif rest.count(":") > 1:  # bare IPv6
        host, port = rest, "0"
    else:
        host, _, port = rest.partition(":")
        port = port or "0"
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{argname} must be 'host', 'host:port' or 'tcp://host:port' with a port "
                         f"in [0, 65535] (0: any free port), got {address!r}")
    return f"tcp://{_bracket(host)}:{int(port)}"


def _bracket(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def _is_v6(address: str) -> bool:
    return address.startswith("tcp://[")


def bind_router(ctx: "zmq.Context", address: str, *, security: dict, max_message: int, send_hwm: int,
                recv_hwm: int) -> tuple["zmq.Socket", str]:
    """A ROUTER socket bound to ``address`` (normalized; port 0: any free port),
    with the ``security`` options (:meth:`gradcomp.ps.auth.Credential.server_options`)
    set before it binds. Each connection gets a routing id of its own: the
    socket never hands a routing id over to a newer connection.

    Returns:
        ``(socket, endpoint)``, the endpoint a worker connects to (a wildcard
        host is replaced by :func:`default_host`).

    Raises:
        ValueError: the address cannot be bound (names it and the reason).
    """
    import zmq

    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or unknown peer fails the send, never blocks
    # a peer-chosen routing id already in use never detaches the connection holding it
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    for option, value in security.items():
        sock.setsockopt(option, value)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.RCVHWM, recv_hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message)
    sock.setsockopt(zmq.LINGER, 2000)
    if _is_v6(address):
        sock.setsockopt(zmq.IPV6, 1)
    host_port = address[len("tcp://"):]
    host, _, port = host_port.rpartition(":")
    try:
        if port == "0":
            sock.bind(f"tcp://{host}:*")
        else:
            sock.bind(address)
    except zmq.ZMQError as e:
        sock.close(0)
        raise ValueError(f"address {address!r}: cannot bind the parameter server there ({e})") from None
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    for wildcard in ("0.0.0.0", "[::]", "*"):
        if f"//{wildcard}:" in endpoint:
            endpoint = endpoint.replace(f"//{wildcard}:", f"//{_bracket(default_host())}:")
    return sock, endpoint


def connect_dealer(ctx: "zmq.Context", address: str, *, security: dict, max_message: int,
                   hwm: int) -> "zmq.Socket":
    """A DEALER connecting to ``address`` with the ``security`` options
    (:meth:`gradcomp.ps.auth.Credential.client_options`); ZeroMQ retries the
    connection until the server is up. It sets no routing id: the server
    names each connection itself and knows the worker by its authenticated user."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    for option, value in security.items():
        sock.setsockopt(option, value)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message)
    sock.setsockopt(zmq.LINGER, 2000)
    if _is_v6(address):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(address)
    return sock


def exchange_addresses(group, own: str | None, num_servers: int) -> list[str]:
    """Every rank of ``group`` calls this once (a collective): servers with
    their endpoint, workers with None. Returns the servers' endpoints in server order."""
    world = dist.get_world_size(group)
    out: list = [None] * world
    dist.all_gather_object(out, own, group=group)
    addresses = out[:num_servers]
    if any(not isinstance(a, str) for a in addresses) or any(a is not None for a in out[num_servers:]):
        raise RuntimeError("parameter-server address exchange: every server rank must build a "
                           "ParameterServer and every other rank a Worker (without server_addresses)")
    return addresses
