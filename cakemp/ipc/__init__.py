"""Front ⇄ device process messaging over ZeroMQ: the only package that imports zmq."""

from cakemp.ipc.channel import DeviceChannel, FrontChannel
from cakemp.ipc.message import (
    Activation, Clear, Done, End, Failure, Forward, Kind, Loaded, Message, Op, Ready, decode, encode,
)

__all__ = [
    "Activation", "Clear", "DeviceChannel", "Done", "End", "Failure", "Forward", "FrontChannel", "Kind",
    "Loaded", "Message", "Op", "Ready", "decode", "encode",
]
