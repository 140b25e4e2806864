"""Front ⇄ device and device ⇄ device messaging over ZeroMQ: the only package that imports zmq."""

from cakemp.ipc.channel import DeviceChannel, FrontChannel, inbox
from cakemp.ipc.message import (
    Activation, Clear, Done, End, ErrorCode, Failure, Hop, Kind, Loaded, Message, Op, Ping, Pong, Progress,
    Ready, Stage, StartFailure, decode, encode, error_code, error_from,
)

__all__ = [
    "Activation", "Clear", "DeviceChannel", "Done", "End", "ErrorCode", "Failure", "Hop", "FrontChannel", "Kind",
    "Loaded", "Message", "Op", "Ping", "Pong", "Progress", "Ready", "Stage", "StartFailure", "decode", "encode",
    "error_code", "error_from", "inbox",
]
