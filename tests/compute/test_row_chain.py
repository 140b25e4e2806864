"""RowChain: chained digests of a run's input rows, block by block."""

import hashlib

import pytest

from cakemp.compute.row_chain import BLOCK_ROWS, RowChain

ROW = 8  # bytes per row


def rows(count: int, seed: int = 0) -> memoryview:
    """`count` rows of distinct bytes."""
    data = b"".join(hashlib.sha256(f"{seed}-{i}".encode()).digest()[:ROW] for i in range(count))
    return memoryview(data)


def chain_of(pieces) -> RowChain:
    chain = RowChain(ROW)
    for piece in pieces:
        chain.advance(chain.extension(piece), chain.length + len(piece) // ROW)
    return chain


def test_rows_taken_in_pieces_give_the_chain_taken_at_once():
    """50 rows taken as 7, 1, 20 and 22 rows give the same block digests, tail and digests as at once."""
    data = rows(50)
    whole = chain_of([data])
    parts = chain_of([data[:7 * ROW], data[7 * ROW:8 * ROW], data[8 * ROW:28 * ROW], data[28 * ROW:]])
    assert (parts.blocks, parts.tail, parts.length) == (whole.blocks, whole.tail, 50)
    assert len(whole.blocks) == 50 // BLOCK_ROWS and len(whole.tail) == (50 % BLOCK_ROWS) * ROW
    assert parts.digest_at(50) == whole.digest_at(50)


def test_an_extension_names_every_position_as_its_chain_would():
    """Extension.digest_at(p) is the digest the chain holding rows [0, p) gives, for every p in the extension,
    from a chain that ends inside a block."""
    data = rows(60)
    base = chain_of([data[:5 * ROW]])
    extension = base.extension(data[5 * ROW:])
    for position in range(6, 61):
        assert extension.digest_at(position) == chain_of([data[:position * ROW]]).digest_at(position)


def test_one_differing_row_changes_every_digest_from_its_block_on():
    """Row 20 differs: the digest of block 0 and of positions up to 20 agree, every later one differs."""
    data = rows(48)
    changed = bytearray(data)
    changed[20 * ROW] ^= 1
    ours, theirs = RowChain(ROW).extension(data), RowChain(ROW).extension(memoryview(bytes(changed)))
    assert [ours.digest_at(p) == theirs.digest_at(p) for p in range(1, 49)] == [True] * 20 + [False] * 28


def test_digests_are_known_at_block_boundaries_and_at_the_end():
    chain = chain_of([rows(40)])
    assert chain.digest_at(16) == chain.blocks[0] and chain.digest_at(32) == chain.blocks[1]
    assert chain.digest_at(40) is not None and chain.digest_at(40) != chain.digest_at(32)
    assert chain.digest_at(20) is None


def test_advancing_past_the_rows_or_from_elsewhere_is_refused():
    chain = chain_of([rows(10)])
    extension = chain.extension(rows(5, seed=1))
    with pytest.raises(ValueError):
        chain.advance(extension, 16)
    with pytest.raises(ValueError):
        RowChain(ROW).advance(extension, 12)
