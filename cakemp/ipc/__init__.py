"""Front ⇄ device and device ⇄ device messaging over ZeroMQ: the only package that imports zmq.

Every message declared in `message` is exported here by name.
"""

from cakemp.errors import ErrorCode, error_code, error_from
from cakemp.ipc import message
from cakemp.ipc.channel import DeviceChannel, FrontChannel, inbox
from cakemp.ipc.codec import decode, encode
from cakemp.ipc.message import *  # noqa: F403 (Kind, Op, Stage, Message, every message)

__all__ = [
    *message.__all__, "DeviceChannel", "FrontChannel", "inbox", "decode", "encode", "ErrorCode", "error_code",
    "error_from",
]  # fmt: skip
