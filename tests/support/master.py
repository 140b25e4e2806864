"""A Cake-style master for tests and benchmarks, built on WorkerClient.

As Cake's text model does: one connection per remote layer, each Hello'd; the whole run of
this worker's layers is sent as one Batch on the run's first connection; Goodbye on all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from cakemp.compute import tensors
from cakemp.master.client import WorkerClient
from cakemp.wire import RawTensor, Revision


def to_raw(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> RawTensor:
    """x [1, T, H] as a wire tensor of `dtype`."""
    return tensors.to_raw(x, tensors.wire_dtype(dtype))


def from_raw(raw: RawTensor) -> torch.Tensor:
    """A received wire tensor in float32, for comparisons."""
    return tensors.from_raw(raw).float()


class CakeMaster:
    def __init__(self, clients: list[WorkerClient], layers: Sequence[int], prefix: str = "model.layers"):
        self.clients = clients
        self.layers = list(layers)
        self.prefix = prefix  # the family's layer prefix, as Cake's master names layers

    @classmethod
    async def connect(cls, port: int, layers: Sequence[int], *, cluster_key: str | None = None,
                      revision: Revision = Revision.V2, prefix: str = "model.layers",
                      source: str | None = None, timeout: float = 10.0) -> CakeMaster:
        """A master of `layers` on the node at 127.0.0.1:`port`, connecting from `source` (another
        loopback address: 127.0.0.2, ...) if given; `timeout` bounds each connect and key handshake."""
        clients = []
        try:
            for _ in layers:  # sequentially, one per remote layer, as Cake does
                client = await WorkerClient.connect("127.0.0.1", port, cluster_key=cluster_key, revision=revision,
                                                    timeout=timeout, source=source)
                clients.append(client)
                await client.hello()
        except BaseException:  # the node refused one: the connections it already took are closed, not left open
            await asyncio.gather(*(client.close() for client in clients))
            raise
        return cls(clients, layers, prefix)

    async def forward(self, x: torch.Tensor, index_pos: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [1, T, H] through every layer, at positions index_pos.. -> [1, T, H] float32."""
        ops = [(f"{self.prefix}.{i}", index_pos, i) for i in self.layers]
        return from_raw(await self.clients[0].batch(to_raw(x, dtype), ops))

    async def goodbye(self) -> None:
        for client in self.clients:
            await client.goodbye()

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients))
