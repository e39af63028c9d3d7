"""What counts as loopback, the same for both processes (issue 28 item 9): an IP literal in 127.0.0.0/8 or `::1`.

A name is never loopback here, `localhost` included: what it resolves to is up to /etc/hosts and the resolver's
order (`::1` first on many hosts, anything at all on a tampered one), so a loopback-only bind or endpoint given as a
name could end up on another address, or fail to meet its peer on the other family. Config checks (the RL Service's
`listen_host`, the gateway's `onlineRL.endpoint`) and request checks (the address a request arrived on or came from)
all use this module.
"""

from __future__ import annotations

import functools
import ipaddress

ALLOWED = "an IP literal of loopback (127.0.0.0/8 or ::1)"  # for messages


@functools.lru_cache(maxsize=256)
def ip_literal(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `text` spells (an IPv4-mapped IPv6 address as its IPv4 address), or None for anything else:
    names, scoped IPv6 addresses (`::1%lo`), bracketed forms. Cached: a server sees few distinct addresses."""
    if "%" in text:
        return None
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback_ip(text: str) -> bool:
    """True only for an IP literal of loopback: 127.0.0.0/8, `::1` (or `::ffff:127.x.y.z`)."""
    address = ip_literal(text)
    return address is not None and address.is_loopback
