"""The front process: master connections, sessions, routing, and the device pool (never imports torch)."""

from cakemp.front.config import NodeConfig
from cakemp.front.server import Front

__all__ = ["Front", "NodeConfig"]
