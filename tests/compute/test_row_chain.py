"""RowChain: a chain of digests of a run's input rows."""

import hashlib

import pytest

from cakemp.compute.row_chain import RowChain

ROW = 8  # bytes per row


def rows(count: int, seed: int = 0) -> memoryview:
    """`count` rows of distinct bytes."""
    return memoryview(b"".join(hashlib.sha256(f"{seed}-{i}".encode()).digest()[:ROW] for i in range(count)))


def chain_of(*pieces: memoryview) -> RowChain:
    chain = RowChain(ROW)
    for piece in pieces:
        chain.advance(chain.extension(piece), chain.length + len(piece) // ROW)
    return chain


def test_rows_taken_in_pieces_give_the_chain_taken_at_once():
    """50 rows taken as 7, 1, 20 and 22 rows name every position as 50 rows taken at once do."""
    data = rows(50)
    whole = chain_of(data)
    parts = chain_of(data[:7 * ROW], data[7 * ROW:8 * ROW], data[8 * ROW:28 * ROW], data[28 * ROW:])
    assert parts.length == whole.length == 50
    assert [parts.digest_at(p) for p in range(51)] == [whole.digest_at(p) for p in range(51)]


def test_an_extension_names_its_positions_as_the_chain_holding_them():
    data = rows(30)
    extension = chain_of(data[:5 * ROW]).extension(data[5 * ROW:])
    whole = chain_of(data)
    assert [extension.digest_at(p) for p in range(6, 31)] == [whole.digest_at(p) for p in range(6, 31)]


def test_rows_agree_up_to_the_first_differing_row_and_never_after():
    """Row 20 differs: the chains agree on positions up to 20, on none after (although row 21 on are equal)."""
    data = rows(48)
    changed = bytearray(data)
    changed[20 * ROW] ^= 1
    ours, theirs = RowChain(ROW).extension(data), RowChain(ROW).extension(memoryview(bytes(changed)))
    assert [ours.digest_at(p) == theirs.digest_at(p) for p in range(1, 49)] == [True] * 20 + [False] * 28
    assert ours.agreed(chain_of(memoryview(bytes(changed)))) == 20


def test_agreement_stops_at_the_shorter_of_the_two():
    data = rows(40)
    assert RowChain(ROW).extension(data).agreed(chain_of(data[:25 * ROW])) == 25
    assert chain_of(data[:10 * ROW]).extension(data[10 * ROW:30 * ROW]).agreed(chain_of(data)) == 30
    assert RowChain(ROW).extension(data).agreed(chain_of(rows(40, seed=1))) == 0


def test_advancing_past_the_rows_or_from_elsewhere_is_refused():
    chain = chain_of(rows(10))
    extension = chain.extension(rows(5, seed=1))
    with pytest.raises(ValueError):
        chain.advance(extension, 16)
    with pytest.raises(ValueError):
        RowChain(ROW).advance(extension, 12)


@pytest.mark.parametrize("at", [0, ROW // 2, ROW - 1])
def test_rows_differing_in_any_byte_even_the_last_do_not_agree(at):
    """Row 3 differs in one byte (its last too): its position and every later one are named apart."""
    data = rows(6)
    changed = bytearray(data)
    changed[3 * ROW + at] ^= 0x80
    ours, theirs = RowChain(ROW).extension(data), chain_of(memoryview(bytes(changed)))
    assert [ours.digest_at(p) == theirs.digest_at(p) for p in range(1, 7)] == [True] * 3 + [False] * 3
    assert ours.agreed(theirs) == 3
