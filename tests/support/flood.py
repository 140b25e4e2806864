"""A connect flood from one address, as an attacker without a key makes one: several threads
connecting as fast as they can, never sending a byte."""

from __future__ import annotations

import collections
import socket
import threading


class ConnectFlood:
    """`threads` threads connecting to 127.0.0.1:`port` from `source` as fast as they can, each keeping
    its latest 100 connections open."""

    def __init__(self, port: int, source: str, threads: int = 4):
        self._port, self._source = port, source
        self._stop = threading.Event()
        self._counts = [0] * threads
        self._threads = [threading.Thread(target=self._flood, args=(i,), daemon=True) for i in range(threads)]

    @property
    def connects(self) -> int:
        return sum(self._counts)

    def __enter__(self) -> ConnectFlood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _flood(self, index: int) -> None:
        open_ = collections.deque()
        while not self._stop.is_set():
            sock = socket.socket()
            sock.setblocking(False)
            sock.bind((self._source, 0))
            sock.connect_ex(("127.0.0.1", self._port))
            open_.append(sock)
            self._counts[index] += 1
            if len(open_) > 100:
                open_.popleft().close()
        for sock in open_:
            sock.close()
