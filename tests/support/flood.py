"""A connect flood from one address, as an attacker without a key makes one: connects as fast as one
thread can, never sending a byte."""

from __future__ import annotations

import collections
import socket
import threading


class ConnectFlood:
    """A thread connecting to 127.0.0.1:`port` from `source` as fast as it can, keeping the latest 100 open."""

    def __init__(self, port: int, source: str):
        self._port, self._source = port, source
        self._stop = threading.Event()
        self.connects = 0
        self._thread = threading.Thread(target=self._flood, daemon=True)

    def __enter__(self) -> ConnectFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _flood(self) -> None:
        open_ = collections.deque()
        while not self._stop.is_set():
            sock = socket.socket()
            sock.setblocking(False)
            sock.bind((self._source, 0))
            sock.connect_ex(("127.0.0.1", self._port))
            open_.append(sock)
            self.connects += 1
            if len(open_) > 100:
                open_.popleft().close()
        for sock in open_:
            sock.close()
