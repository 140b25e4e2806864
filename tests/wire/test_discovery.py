"""Cake's discovery datagrams: the cluster hash, the probe and reply bytes, and what decoding refuses."""

from __future__ import annotations

import pytest

from cakemp.errors import ProtocolError
from cakemp.wire.discovery import (
    Announcement,
    GpuInfo,
    cluster_hash,
    decode_announcement,
    decode_probe,
    encode_announcement,
    encode_probe,
)


@pytest.mark.parametrize("key, expected", [("test", "9f86d081"), ("", "e3b0c442"), ("mysecret", "652c7dc6")])
def test_cluster_hash_matches_cakes_test_values(key, expected):
    """The first 4 bytes of SHA-256(key) in lowercase hex (the values of Cake's own unit tests)."""
    assert cluster_hash(key) == expected


def test_probe_is_cake_magic_then_compact_json():
    """serde_json's compact form: no spaces."""
    assert encode_probe("9f86d081") == b'CAKE{"cluster_hash":"9f86d081"}'
    assert decode_probe(b'CAKE{"cluster_hash":"9f86d081"}') == "9f86d081"


def test_reply_has_cakes_fields_in_cakes_order_and_round_trips():
    announcement = Announcement("9f86d081", "w1", 10128, (GpuInfo("NVIDIA H200", 150 << 30, 123.5),),
                                "CUDA", "box", "linux")
    datagram = encode_announcement(announcement)
    assert datagram == (b'CAKE{"cluster_hash":"9f86d081","worker_name":"w1","port":10128,"gpus":[{"name":'
                        b'"NVIDIA H200","vram_bytes":161061273600,"tflops":123.5}],"backend":"CUDA",'
                        b'"hostname":"box","os":"linux"}')
    assert decode_announcement(datagram) == announcement


def test_unknown_keys_are_ignored_and_serde_defaults_apply():
    """As serde reads it: extra keys skipped; backend, hostname, os and tflops optional."""
    reply = decode_announcement(b'CAKE{"cluster_hash":"h","worker_name":"w","port":1,"gpus":'
                                b'[{"name":"g","vram_bytes":2,"extra":1}],"future":[1]}')
    assert reply == Announcement("h", "w", 1, (GpuInfo("g", 2, 0.0),))
    assert decode_probe(b'CAKE[{"cluster_hash":"h","x":null}]') == "h"  # serde also reads a one-element array


@pytest.mark.parametrize("datagram", [
    b"", b"CAKE", b"CAK", b"XXXX{}", b"CAKE{", b"CAKE\xff\xfe", b"CAKE[]", b"CAKE[1,2]", b"CAKE{}",
    b'CAKE{"cluster_hash":1}', b"CAKE" + b"[" * 100000,
])
def test_a_datagram_that_is_not_a_probe_is_a_protocol_error(datagram):
    with pytest.raises(ProtocolError):
        decode_probe(datagram)


@pytest.mark.parametrize("body", [
    b'{"cluster_hash":"h","worker_name":"w","port":0,"gpus":[]}',
    b'{"cluster_hash":"h","worker_name":"w","port":70000,"gpus":[]}',
    b'{"cluster_hash":"h","worker_name":"w","port":true,"gpus":[]}',
    b'{"cluster_hash":"h","worker_name":"w","port":1}',
    b'{"cluster_hash":"h","port":1,"gpus":[]}',
    b'{"cluster_hash":"h","worker_name":"w","port":1,"gpus":[{"name":"g","vram_bytes":-1}]}',
    b'{"cluster_hash":"h","worker_name":"w","port":1,"gpus":[{"name":"g","vram_bytes":1,"tflops":"x"}]}',
    b'{"cluster_hash":"h","worker_name":"w","port":1,"gpus":[7]}',
    b'{"cluster_hash":"h","worker_name":"w","port":1,"gpus":[{"name":"g","vram_bytes":1,"tflops":NaN}]}',
    b'{"cluster_hash":"h","worker_name":"w","port":1,"gpus":[{"name":"g","vram_bytes":1,"tflops":Infinity}]}',
    b'{"cluster_hash":"h","worker_name":"w","port":1,"gpus":[{"name":"g","vram_bytes":1,"tflops":-1.0}]}',
])
def test_a_reply_missing_or_mistyping_a_required_field_is_a_protocol_error(body):
    with pytest.raises(ProtocolError):
        decode_announcement(b"CAKE" + body)
