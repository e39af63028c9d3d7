"""Which addresses a registration may name (issue 28, item 1; docs/security.md).

A holder of the instance key could otherwise register the gateway's own host: a loopback port (the RL Service
child's unauthenticated `/health` answers 200), a link-local metadata service, the gateway's own port, Redis. Such an
"instance" was admitted, failed every activation and took a share of the agents' traffic; and the `serving` answer
told the caller whether something internal answers `/health`.

So a registered address must not be loopback, link-local, unspecified, multicast or broadcast (an IPv4-mapped IPv6
address counts as its IPv4 address), unless it lies in one of `registration.allowedNetworks` (single-host setups,
tests); and never the port of the gateway or of its RL Service child on an address of this host, whatever the list
says. A DNS name is resolved once, here: every address it resolves to must pass, and the instance is kept, probed
and routed to by the address checked, so a later DNS answer cannot move it. Static instances (the config file) are
the operator's and never pass through here.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable

from .instances import InstanceRefused

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[str]]]

_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
REFUSED = "instance_address_refused"


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses the OS resolver gives for `host` (getaddrinfo, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_local_address(address: IPAddress) -> bool:
    """Whether `address` may belong to this host: only a local address can be bound (no I/O, nothing listens).
    When the OS cannot tell (any error but "not available"), it may: the caller refuses then."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True


class AddressPolicy:
    def __init__(self, *, allowed_networks: Iterable[IPNetwork] = (), own_ports: Iterable[int] = (),
                 resolve_timeout_s: float = 5.0, resolver: Resolver = system_resolver) -> None:
        """`own_ports`: the gateway's listen port and its RL Service child's port, never registrable on this host.
        `resolver`: DNS lookup (tests inject one; the default asks the OS)."""
        if not resolve_timeout_s > 0:
            raise ValueError("resolve_timeout_s must be positive")
        self._allowed = tuple(allowed_networks)
        self._own_ports = frozenset(p for p in own_ports if p > 0)  # port 0: bound at run time, unknown here
        self._timeout_s = resolve_timeout_s
        self._resolve = resolver

    async def check(self, host: str, port: int) -> str:
        """The address to keep for a registration of `host`:`port`, an IP literal; InstanceRefused 400
        `instance_address_refused` otherwise. The message never says whether anything answers there."""
        literal = _literal(host)
        if literal is not None:
            self._require_allowed(literal, port, host)
            return str(literal)
        try:
            async with asyncio.timeout(self._timeout_s):
                resolved = await self._resolve(host, port)
        except (OSError, TimeoutError, UnicodeError) as exc:
            raise InstanceRefused(REFUSED, f"instanceIp {host!r} does not resolve ({type(exc).__name__})") from exc
        addresses = [a for a in map(_literal, resolved) if a is not None]
        if not addresses:
            raise InstanceRefused(REFUSED, f"instanceIp {host!r} resolves to no IP address")
        for address in addresses:  # a name with one internal address among public ones is refused too
            self._require_allowed(address, port, host)
        return str(addresses[0])

    def _require_allowed(self, address: IPAddress, port: int, host: str) -> None:
        if port in self._own_ports and is_local_address(address):
            raise InstanceRefused(REFUSED, f"{host}:{port} is the gateway's own or its RL Service's port")
        kind = _internal_kind(address)
        if kind is not None and not any(address in network for network in self._allowed
                                        if network.version == address.version):
            raise InstanceRefused(
                REFUSED, f"instanceIp {host!r} is a {kind} address; an operator may allow its network in "
                         "registration.allowedNetworks")


def _literal(host: str) -> IPAddress | None:
    """The IP address `host` spells (brackets allowed; IPv4-mapped IPv6 as its IPv4 address), or None for a name."""
    try:
        address = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _internal_kind(address: IPAddress) -> str | None:
    """Which refused class `address` is in, or None."""
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address == _BROADCAST:
        return "broadcast"
    return None
