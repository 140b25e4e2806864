"""Per-source counting: what one source is, and how Places caps, displaces and refuses."""

from cakemp.sources import Places, source_of


def test_a_source_is_an_ipv4_address_or_an_ipv6_64():
    assert source_of("192.0.2.7") == "192.0.2.7"
    assert source_of("::ffff:192.0.2.7") == "192.0.2.7"
    assert source_of("2001:db8:1:2:aaaa::1") == source_of("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert source_of("2001:db8:1:3::1") != source_of("2001:db8:1:2::1")
    assert source_of("fe80::1%eth0") == "fe80::/64"


def test_a_source_at_its_cap_displaces_its_own_oldest_idle_one_after_the_grace_never_a_progressing_one():
    now = [0.0]
    displaced = []
    places = Places(4, displaced.append, per_source=2, grace_s=1.0, clock=lambda: now[0])
    assert places.enter("a1", "10.0.0.1") and places.enter("a2", "10.0.0.1")
    assert not places.enter("a3", "10.0.0.1")  # both within their grace: the newcomer is refused
    now[0] = 2.0
    places.progressed("a1")
    assert places.enter("a3", "10.0.0.1") and displaced == ["a2"]  # a1 has sent bytes: kept
    places.progressed("a3")
    assert not places.enter("a4", "10.0.0.1")  # nothing of its source may be displaced
    assert places.enter("b1", "10.0.0.2") and len(places) == 3


def test_when_every_place_is_taken_the_busiest_source_gives_one_up():
    now = [0.0]
    displaced = []
    places = Places(3, displaced.append, per_source=2, grace_s=0.0, clock=lambda: now[0])
    for item, host in (("b1", "10.0.0.2"), ("a1", "10.0.0.1"), ("a2", "10.0.0.1")):
        assert places.enter(item, host)
    assert places.enter("c1", "10.0.0.3") and displaced == ["a1"]  # not b1, older but its source's only one
