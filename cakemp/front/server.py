"""The front process: device pool up, then a TCP server with one task per master connection.

Lifecycle (`Front.run`): make the runtime dir, start the pool and wait until every device is
ready, listen, serve until asked to stop (SIGINT/SIGTERM -> exit 0) or until a device process
dies (its in-flight requests are answered WorkerError first -> exit 1, so that the supervisor
restarts the node), then close connections, stop the pool and remove the runtime dir.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import platform
import shutil
import signal
import tempfile

import cakemp
from cakemp import log
from cakemp.device.spec import DeviceSpec
from cakemp.errors import ConfigError
from cakemp.front.config import WIRE_DTYPE_NAMES, NodeConfig
from cakemp.front.connection import Connection
from cakemp.front.pool import DevicePool
from cakemp.front.router import Router
from cakemp.front.stats import human_bytes
from cakemp.ipc import Ready
from cakemp.rss import resident_bytes
from cakemp.topology import place_layers
from cakemp.wire import WorkerInfo

EXIT_OK = 0
EXIT_DEVICE_LOST = 1
_ANSWER_GRACE_S = 5.0  # how long in-flight requests get to be answered when shutting down


class Front:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.placement = place_layers(config.layers, len(config.devices))
        self._router = Router(self.placement)
        self.pool: DevicePool | None = None
        self._stopping = asyncio.Event()
        self._connections: dict[Connection, asyncio.Task] = {}
        self._sessions = itertools.count(1)
        self._log = log.get_logger()

    def stop(self) -> None:
        """Ask `run` to stop serving and return EXIT_OK (signal handlers call this)."""
        self._stopping.set()

    async def run(self) -> int:
        """Serve until stopped or a device dies; returns the process exit status. Raises ConfigError at start."""
        runtime_dir = tempfile.mkdtemp(prefix="cakemp-", dir=os.environ.get("RUNTIME_DIRECTORY") or None)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        try:
            server = await self._bind()
            try:
                readies = await self._start_pool(runtime_dir)
                if readies is None:
                    return EXIT_OK
                await server.start_serving()
                host, port = server.sockets[0].getsockname()[:2]  # the real port when --address asked for 0
                self._log.info(
                    f"listening on {host}:{port} (mem:{human_bytes(resident_bytes())}) ...",
                    port=port,
                    devices=[f"{self.pool.label(i)}={human_bytes(r.memory_bytes)}" for i, r in enumerate(readies)],
                    layers=len(self.config.layers),
                )
                status = await self._serve_until_done()
                server.close()
                await self._close_connections()
                return status
            finally:
                server.close()
                await server.wait_closed()
        finally:
            if self.pool is not None:
                await self.pool.stop()
            shutil.rmtree(runtime_dir, ignore_errors=True)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def _bind(self) -> asyncio.Server:
        # Bound before loading, so that a taken port fails before minutes of loading; it
        # accepts connections (listen) only once every device is ready.
        try:
            return await asyncio.start_server(self._accept, self.config.host, self.config.port, start_serving=False)
        except OSError as e:
            raise ConfigError(f"cannot listen on {self.config.host}:{self.config.port}: {e.strerror}") from None

    async def _start_pool(self, runtime_dir: str) -> tuple[Ready, ...] | None:
        """Every device's Ready, or None when asked to stop while they load."""
        self.pool = DevicePool(self._device_specs(runtime_dir))
        starting = asyncio.create_task(self.pool.start())
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if starting.done():
            return starting.result()
        starting.cancel()  # pool.start stops the processes it spawned
        await asyncio.gather(starting, return_exceptions=True)
        self._log.info("stopped while loading")
        return None

    async def _serve_until_done(self) -> int:
        stopping = asyncio.create_task(self._stopping.wait())
        lost = asyncio.create_task(self.pool.lost.wait())
        await asyncio.wait((stopping, lost), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        lost.cancel()
        if self.pool.lost.is_set():
            self._log.error("a device process died; exiting so that the node is restarted",
                            error=str(self.pool.lost_error))
            return EXIT_DEVICE_LOST
        self._log.info("stopping")
        return EXIT_OK

    async def _close_connections(self) -> None:
        # In-flight requests are answered first (WorkerError when their device died).
        deadline = asyncio.get_running_loop().time() + _ANSWER_GRACE_S
        while any(c.busy for c in self._connections) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        # Closing a transport ends its connection's read loop, which then frees the session; a
        # task is cancelled only if that does not finish (Python 3.11's streams log a cancelled
        # connection task as an error).
        for connection in self._connections:
            connection.close()
        tasks = list(self._connections.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=_ANSWER_GRACE_S)
            for task in pending:
                task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = Connection(
            next(self._sessions), reader, writer, pool=self.pool, router=self._router,
            revision=self.config.revision, cluster_key=self.config.cluster_key, worker_info=self._worker_info,
        )
        self._connections[connection] = asyncio.current_task()
        try:
            await connection.serve()
        finally:
            del self._connections[connection]

    def _worker_info(self, latency_ms: int) -> WorkerInfo:
        first_gpu = next((gpu for gpu in self.config.devices if gpu is not None), None)
        return WorkerInfo(
            version=cakemp.__version__,
            dtype=WIRE_DTYPE_NAMES[self.config.dtype],
            os=platform.system().lower(),
            arch=platform.machine(),
            device="cpu" if first_gpu is None else "cuda",
            device_idx=int(first_gpu) if first_gpu is not None and first_gpu.isdigit() else 0,
            latency=latency_ms,
        )

    def _device_specs(self, runtime_dir: str) -> list[DeviceSpec]:
        cpu_processes = sum(1 for gpu in self.config.devices if gpu is None)
        # CPU processes share the cores rather than oversubscribe them.
        cpu_threads = self.config.cpu_threads or max(1, len(os.sched_getaffinity(0)) // max(1, cpu_processes))
        return [
            DeviceSpec(
                index=i,
                gpu=gpu,
                layers=layers,
                model_dir=self.config.model_dir,
                dtype=self.config.dtype,
                endpoint=f"ipc://{runtime_dir}/device-{i}",
                kv_budget_bytes=self.config.kv_budget_bytes,
                max_context=self.config.max_context,
                threads=cpu_threads if gpu is None else None,
                log_format=self.config.log_format,
                log_level=self.config.log_level,
            )
            for i, (gpu, layers) in enumerate(zip(self.config.devices, self.placement))
        ]
