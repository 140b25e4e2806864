"""One parser for the `host:port` addresses of the command line and of Cake topologies (no I/O)."""

from __future__ import annotations

import ipaddress

from cakemp.errors import ConfigError


def parse_address(text: str, flag: str = "--address", default_host: str | None = "0.0.0.0") -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port); `flag` names the option in the error.

    An empty host (":10128") means `default_host` where one is given (a bind address), else it
    is an error (an address to dial).
    """
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") or default_host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"invalid {flag} {text!r}: expected host:port")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether a bind address `host` is reachable from this machine only (127.0.0.0/8, ::1,
    localhost). Any other name counts as reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
