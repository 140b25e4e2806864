"""--allow-from: the peer addresses that may reach the node (its TCP port, its discovery replies).

Entries are IPv4 or IPv6 addresses or networks (10.0.0.5, 10.0.0.0/24, fd00::/8), comma-separated.
A peer on a dual-stack socket shows as an IPv4-mapped IPv6 address (::ffff:10.0.0.5); it is
judged as the IPv4 address it is. No I/O: the callers hand over the address their socket reports.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from cakemp.errors import ConfigError


@dataclass(frozen=True)
class AllowList:
    """The networks a peer's address must fall in."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    @classmethod
    def parse(cls, text: str, flag: str = "--allow-from") -> AllowList:
        """Comma-separated addresses or CIDRs; a CIDR with host bits set means its network (as
        iptables reads 10.0.0.5/24). ConfigError, naming `flag`, for anything else."""
        networks = []
        for entry in filter(None, (part.strip() for part in text.split(","))):
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ConfigError(f"invalid {flag} entry {entry[:64]!r}: expected an IP address or a CIDR "
                                  "such as 10.0.0.0/24 or fd00::/8") from None
        if not networks:
            raise ConfigError(f"{flag} {text!r} lists no address")
        return cls(tuple(networks))

    def allows(self, host: str) -> bool:
        """Whether the peer address `host` (the first item of a socket's peer name) is in the list;
        anything that is not an IP address is not."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        return any(form in network for network in self.networks for form in (address, mapped) if form is not None)
