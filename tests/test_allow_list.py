"""--allow-from's list: what it parses, and which peer addresses it lets in (no I/O)."""

from __future__ import annotations

import ipaddress
import re

import pytest

from cakemp.allow_list import AllowList
from cakemp.errors import ConfigError


def test_addresses_and_cidrs_of_both_families_are_parsed():
    """Spaces and empty entries are skipped; a single address is a /32 or /128; host bits set mean the network."""
    allowed = AllowList.parse(" 10.0.0.5, 192.168.1.77/24,, fd00::/8 ,::1")
    assert allowed.networks == tuple(ipaddress.ip_network(text) for text in (
        "10.0.0.5/32", "192.168.1.0/24", "fd00::/8", "::1/128"))


@pytest.mark.parametrize("text, words", [
    ("10.0.0.300", "invalid --allow-from entry '10.0.0.300'"),
    ("10.0.0.0/33", "invalid --allow-from entry '10.0.0.0/33'"),
    ("master.lan", "invalid --allow-from entry 'master.lan'"),
    ("10.0.0.1;10.0.0.2", "invalid --allow-from entry '10.0.0.1;10.0.0.2'"),
    (" , ", "lists no address"),
])
def test_anything_but_addresses_is_a_config_error_naming_the_flag(text, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        AllowList.parse(text)


@pytest.mark.parametrize("peer, allowed", [
    ("10.0.0.5", True),
    ("10.0.0.6", False),
    ("192.168.1.200", True),
    ("192.168.2.1", False),
    ("fd12:3456::1", True),
    ("fe80::1", False),
    ("::1", True),
    ("::ffff:10.0.0.5", True),  # a dual-stack socket's view of the IPv4 peer 10.0.0.5
    ("::ffff:10.0.0.6", False),
    ("fe80::1%eth0", False),  # a scoped address is judged by its address
    ("?", False),  # no peer name: nothing to judge, so not allowed
    ("", False),
])
def test_a_peer_is_allowed_when_its_address_falls_in_an_entry(peer, allowed):
    assert AllowList.parse("10.0.0.5,192.168.1.0/24,fd00::/8,::1").allows(peer) is allowed


def test_an_ipv4_mapped_entry_and_a_scoped_peer_match_as_their_addresses():
    assert AllowList.parse("::ffff:10.0.0.0/104").allows("::ffff:10.0.0.9")
    assert AllowList.parse("fe80::/10").allows("fe80::1%eth0")
