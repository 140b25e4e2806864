"""The front process: device pool up, then a TCP server with one task per master connection.

Lifecycle (`Front.run`): make the runtime dir, listen for metrics (if asked), start the pool
and wait until every device is ready (reporting progress), accept connections and tell the
service manager READY=1, then serve, restarting devices in place as they fail, until

* SIGTERM, SIGINT or SIGHUP (a closed terminal): stop accepting, let requests in flight finish within --drain-timeout,
  stop the device processes, remove the runtime dir, exit 0 (a second signal exits at once);
* or a device could not be restarted: the same drain, then exit 1 for the manager to act.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import platform
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

import cakemp
from cakemp import heap, log
from cakemp.checkpoint.config import ModelConfig
from cakemp.errors import CakempError, CheckpointError, ConfigError
from cakemp.front.admission import Admission, LayerAdmission
from cakemp.front.buffer_budget import BufferBudget
from cakemp.front.component_admission import ComponentAdmission
from cakemp.front.config import WIRE_DTYPE_NAMES, NodeConfig
from cakemp.front.connection import Connection, ConnectionLimits, keep_alive
from cakemp.front.devices import device_specs, front_cores
from cakemp.front.handshakes import MAX_HANDSHAKES, Handshakes, HelloPlace
from cakemp.front.listener import Listener
from cakemp.front.metrics import Metrics
from cakemp.front.metrics_server import start_metrics_server
from cakemp.front.notify import Notifier
from cakemp.front.pool import LOAD_SILENCE_S, DevicePool
from cakemp.front.stats import log_stats
from cakemp.front.status import NodeStatus
from cakemp.front.tracing import TraceFile
from cakemp.ipc import Ready
from cakemp.ipc.spec import DeviceMain, DeviceSpec
from cakemp.rss import resident_bytes
from cakemp.setup.discovery import DiscoveryResponder, announcement_for
from cakemp.setup.exchange import MAX_SETUP_FRAME, Setup
from cakemp.sources import session_id, source_of
from cakemp.streams import Inbox
from cakemp.topology import collapse_layers, place_layers
from cakemp.units import human_bytes
from cakemp.wire import LayerAssignment, WorkerInfo

EXIT_OK = 0
EXIT_DEVICE_FAILED = 1
EXIT_ABORTED = 1  # a second signal cut the drain short
_CLOSE_GRACE_S = 5.0  # for connections to wind up once the pool has failed what they waited for
# How much longer than the front itself the manager waits for the next load progress: the
# front kills a device silent for LOAD_SILENCE_S, and then needs a moment to exit.
_PROGRESS_SLACK_S = 30.0
# SIGHUP too: a node started from a terminal that closes stops as cleanly as under its manager.
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Serving:
    """What the node serves, built once its layers are known: at start from --topology, or in
    zero-config mode from a setup's assignment (then rebuilt for the next, should they not load)."""

    config: NodeConfig  # the node's configuration, naming the layers served, their checkpoint and devices
    admission: Admission
    limits: ConnectionLimits
    status: NodeStatus
    pool: DevicePool
    served: LayerAssignment | None = None  # zero-config: the setup being served


class Front:
    def __init__(self, config: NodeConfig, device_main: DeviceMain, notifier: Notifier | None = None):
        """`device_main`: what each device process runs (cakemp.device.process.main), named by the caller."""
        self.config = config  # as given: in zero-config mode without layers, which a setup assigns
        self._device_main = device_main
        # A place in the reserve of small frames for every source that can hold a connection reading frames.
        self._budget = BufferBudget(config.max_buffered_bytes, config.max_connections + MAX_HANDSHAKES)
        self.metrics = Metrics(buffered_bytes=lambda: self._budget.held)
        self._notifier = notifier or Notifier(None)
        # A connection proves the cluster key (if the node has one), or else sends Hello, before it counts
        # as a master's: until then it holds a handshake place.
        self._handshakes = Handshakes(self.metrics)
        self._masters: set[asyncio.StreamWriter] = set()  # the connections counted toward --max-connections
        self._setup = (Setup(config.setup, config.revision, self._budget, config.frame_timeout)
                       if config.setup is not None else None)
        self._discovery: asyncio.DatagramTransport | None = None
        self._serving: Serving | None = None  # once the layers are known (zero-config: after a setup)
        self._runtime_dir: str | None = None
        self._stopping = asyncio.Event()
        self._connections: dict[Connection, asyncio.Task] = {}
        self._session_ids = itertools.count(1)  # each connection's, as the devices know it
        self._trace_file = TraceFile.from_environment()  # None unless CAKEMP_TRACE names a file (bench/route.py)
        self._log = log.get_logger()

    def stop(self) -> None:
        """Ask `run` to drain and return EXIT_OK; asked a second time, exit at once (signal handlers call this)."""
        if self._stopping.is_set():
            self._abort()
        self._stopping.set()

    async def run(self) -> int:
        """Serve until stopped or a device cannot be restarted; returns the exit status. Raises ConfigError at start."""
        self._runtime_dir = tempfile.mkdtemp(prefix="cakemp-", dir=os.environ.get("RUNTIME_DIRECTORY") or None)
        heap.keep_freed_memory()  # frames' buffers reused, not mapped afresh each request (heap.py)
        loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            loop.add_signal_handler(sig, self.stop)
        # From the start: the manager may hold the node to its watchdog while it loads.
        keep_alive = asyncio.create_task(self._notifier.keep_alive())
        metrics_server = None
        try:
            listener = self._bind()
            try:
                metrics_server = await self._serve_metrics()
                started = await (self._set_up(listener) if self._setup is not None else self._start(self.config))
                if started is None:
                    return EXIT_OK
                serving, readies = started
                frozen = heap.freeze_loaded()  # what the front loaded: out of every garbage collection from here on
                listener.start()
                host, port = listener.address  # the real port when --address asked for 0
                self._log.info(
                    "listening", host=host, port=port, memory_bytes=resident_bytes(), frozen_objects=frozen,
                    layers=len(serving.config.parts),
                    device_memory_bytes={serving.pool.label(i): r.memory_bytes for i, r in enumerate(readies)},
                )
                serving.status.serving(f"{host}:{port}")
                stats = asyncio.create_task(log_stats(self.metrics, self.config.stats_interval))
                try:
                    exit_status = await self._serve_until_done(serving.pool)
                finally:
                    stats.cancel()
                listener.close()
                await self._drain(serving)
                return exit_status
            finally:
                listener.close()
        finally:
            if self._serving is not None:
                await self._serving.pool.stop()
            keep_alive.cancel()
            self._notifier.close()
            if metrics_server is not None:
                metrics_server.close()
            if self._discovery is not None:
                self._discovery.close()
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
            if self._trace_file is not None:
                self._trace_file.close()
            for sig in _SIGNALS:
                loop.remove_signal_handler(sig)

    def _abort(self) -> None:
        # The operator will not wait for the drain: exit now. Device processes die with the
        # front (they are SIGKILLed on its death); only the runtime dir needs removing.
        self._log.warning("second signal: exiting without waiting for requests in flight")
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
        sys.stdout.flush()
        os._exit(EXIT_ABORTED)

    def _build(self, config: NodeConfig, served: LayerAssignment | None) -> Serving:
        """What serves `config`'s layers: what the front admits, from the model's config.json (read
        here, no torch), the connections' limits, the status, and the pool, not started yet."""
        admission = _judge(config)
        max_payload = admission.max_payload()
        if max_payload > config.max_buffered_bytes:
            raise ConfigError(f"--max-buffered-mib {config.max_buffered_bytes / 2**20:g} is less than one "
                              f"frame of this model can need ({human_bytes(max_payload)})")
        limits = ConnectionLimits(max_payload, config.frame_timeout, config.session_idle_timeout)
        specs = self._device_specs(config)
        for spec in specs:
            self._log.info("device layers", device=spec.index, device_label=spec.label,
                           layers=list(collapse_layers(spec.parts)), count=len(spec.parts))
        status = NodeStatus(
            self._notifier, self.metrics, [spec.label for spec in specs], [len(spec.parts) for spec in specs],
            progress_window=LOAD_SILENCE_S + _PROGRESS_SLACK_S,
        )
        pool = DevicePool(specs, self._device_main, status=status, metrics=self.metrics,
                          request_timeout=config.request_timeout, restart_attempts=config.restart_attempts,
                          workload=config.workload, prefill_chunk=config.prefill_chunk)
        return Serving(config, admission, limits, status, pool, served)

    def _bind(self) -> Listener:
        # Bound before loading, so that a taken port fails before minutes of loading; it
        # accepts connections (listen) only once every device is ready.
        try:
            return Listener(self.config.host, self.config.port, self._accept, self.metrics)
        except OSError as e:
            raise ConfigError(f"cannot listen on {self.config.host}:{self.config.port}: {e.strerror}") from None

    async def _serve_metrics(self) -> asyncio.Server | None:
        """The /metrics, /healthz, /readyz endpoint when --metrics-address is given (up while loading, /readyz 503)."""
        if self.config.metrics_address is None:
            return None
        host, port = self.config.metrics_address
        try:
            return await start_metrics_server(self.metrics, host, port, self._placement_document)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {e.strerror}") from None

    async def _start(self, config: NodeConfig,
                     served: LayerAssignment | None = None) -> tuple[Serving, tuple[Ready, ...]] | None:
        """Build what serves `config` and wait until every device is ready; None when asked to stop while they load."""
        serving = self._serving = self._build(config, served)
        serving.status.starting()
        starting = asyncio.create_task(serving.pool.start())
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if starting.done():
            readies = starting.result()
            if (cores := front_cores(config)) is not None:
                _pin(cores)  # now: the devices were spawned with every core, each then pinned itself
            return serving, readies
        starting.cancel()  # pool.start stops the processes it spawned
        await asyncio.gather(starting, return_exceptions=True)
        serving.status.stopping(0)
        self._log.info("stopped while loading")
        return None

    async def _set_up(self, listener: Listener) -> tuple[Serving, tuple[Ready, ...]] | None:
        """Zero-config: answer discovery and setups until one's layers have loaded (then the
        node serves them); None when asked to stop first. A setup whose model cannot load is
        refused and the node waits for the next."""
        if self._budget.capacity < MAX_SETUP_FRAME:
            raise ConfigError(f"--max-buffered-mib {self._budget.capacity / 2**20:g} is less than one frame of a "
                              f"model push can need ({human_bytes(MAX_SETUP_FRAME)})")
        listener.start()  # setup connections only, until the setup serves
        port = listener.address[1]
        setup = self.config.setup
        # nvidia-smi may take a second or two: off the loop, which keeps the watchdog fed.
        announcement = await asyncio.to_thread(
            announcement_for, self._setup.cluster_hash, self.config.name, port, self.config.devices)
        self._discovery, discovery_port = await DiscoveryResponder.start(
            announcement, setup.discovery_host, setup.discovery_port, self.config.allow_from)
        self._log.info("waiting for setup", port=port, discovery_port=discovery_port, cluster_hash=self._setup.cluster_hash,
                       worker_name=self.config.name, gpus=[gpu.name for gpu in announcement.gpus])
        self._notifier.ready(f"waiting for a Cake master's setup on port {port}")
        while True:
            assignment = await self._unless_stopped(self._setup.next())
            if assignment is None:
                return None
            try:
                started = await self._start(self._assigned(assignment.layers, str(assignment.model_dir)),
                                            assignment.message)
            except Exception as e:  # pushed files must never end the front: any failure refuses the setup
                self._log.error("the assigned layers cannot be loaded; waiting for the next setup",
                                error=str(e) if isinstance(e, CakempError) else f"{type(e).__name__}: {e}")
                # The master learns why, not where this node keeps its cache.
                reason = str(e).replace(str(assignment.model_dir), "<cache>")
                # A checkpoint's fault (or an unforeseen one) discards the cache; a resource's keeps it.
                at_fault = isinstance(e, CheckpointError) or not isinstance(e, CakempError)
                await assignment.refuse(f"cannot load the assigned layers: {reason}", files_at_fault=at_fault)
                self._serving = None
                continue
            if started is None:
                await assignment.refuse("the node is stopping", files_at_fault=False)
                return None
            self._setup.serving()
            await assignment.ready()
            return started

    def _assigned(self, layers: tuple[str, ...], model_dir: str) -> NodeConfig:
        """The node's configuration to serve `layers` of the checkpoint in `model_dir` (zero-config: known only after setup)."""
        return dataclasses.replace(self.config, parts=layers, checkpoint_path=model_dir,
                                   devices=self.config.devices[: len(layers)])

    async def _unless_stopped(self, awaitable):
        """The result of `awaitable`, or None if the node is asked to stop first."""
        waiting = asyncio.ensure_future(awaitable)
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait((waiting, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if waiting.done():
            return waiting.result()
        waiting.cancel()
        return None

    async def _serve_until_done(self, pool: DevicePool) -> int:
        stopping = asyncio.create_task(self._stopping.wait())
        failed = asyncio.create_task(pool.failed.wait())
        await asyncio.wait((stopping, failed), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failed.cancel()
        if pool.failed.is_set():
            self._log.error("giving up on a device; exiting so that the node is restarted", error=pool.failure)
            return EXIT_DEVICE_FAILED
        return EXIT_OK

    async def _drain(self, serving: Serving) -> None:
        """Let requests in flight finish (for up to --drain-timeout), closing each connection once
        it is idle; then fail whatever is left and close the rest."""
        busy = sum(1 for connection in self._connections if connection.busy)
        self._log.info("draining", in_flight=busy, connections=len(self._connections),
                       timeout=self.config.drain_timeout)
        serving.status.stopping(busy)
        for connection in self._connections:
            connection.finish()
        tasks = list(self._connections.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.config.drain_timeout)
        if not pending:
            return
        self._log.warning("drain timeout: failing the requests still in flight", in_flight=len(pending))
        # Stopping the pool answers every request still waiting on a device with DeviceLost;
        # the connections then send their WorkerError and close. A task is cancelled only if
        # that does not finish (Python 3.11's streams log a cancelled connection task as an error).
        await serving.pool.stop()
        _, pending = await asyncio.wait(pending, timeout=_CLOSE_GRACE_S)
        for task in pending:
            task.cancel()

    async def _accept(self, reader: Inbox, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = (peer or ("?",))[0]
        logger = self._log.bind(session=f"{host}:{peer[1]}" if peer else "?")
        if self.config.allow_from is not None and not self.config.allow_from.allows(host):
            logger.warning("refusing a connection: not in --allow-from", peer=host)
            self.metrics.refused_connections.inc(reason="allow-from")
            writer.close()  # before the handshake: nothing read, nothing written
            return
        key = self.config.cluster_key
        if key is not None and not await self._handshakes.authenticate(reader, writer, key, logger):
            writer.close()  # why was logged
            return
        if self._setup is not None and not self._setup.serves:
            await self._setup.handle(reader, writer)
            return
        arrival = None
        if key is not None:  # proved the key: a master's from now on
            if not self._admit_master(writer, logger):
                writer.close()
                return
        elif self._handshakes.enter(writer, logger):  # keyless: a master's once its Hello comes
            arrival = HelloPlace(self._handshakes, writer, lambda: self._admit_master(writer, logger))
        else:
            writer.close()
            return
        try:
            await self._serve_connection(reader, writer, arrival)
        finally:
            if arrival is not None:
                arrival.closed()
            if writer in self._masters:
                self._masters.discard(writer)
                self.metrics.connections.set(len(self._masters))

    def _admit_master(self, writer: asyncio.StreamWriter, logger) -> bool:
        """Count `writer` as a master's connection, unless --max-connections are (logged, counted)."""
        if len(self._masters) >= self.config.max_connections:
            peer = writer.get_extra_info("peername")
            logger.warning("refusing a connection: --max-connections reached",
                           peer=f"{peer[0]}:{peer[1]}" if peer else "?", max_connections=self.config.max_connections)
            self.metrics.refused_connections.inc(reason="max-connections")
            return False
        self._masters.add(writer)
        self.metrics.connections.set(len(self._masters))
        return True

    async def _serve_connection(self, reader: Inbox, writer: asyncio.StreamWriter,
                                arrival: HelloPlace | None) -> None:
        keep_alive(writer.get_extra_info("socket"))
        serving = self._serving
        peer = writer.get_extra_info("peername")
        connection = Connection(
            session_id(source_of(peer[0] if peer else "?"), next(self._session_ids)), reader, writer,
            pool=serving.pool, admission=serving.admission,
            limits=serving.limits, budget=self._budget, metrics=self.metrics, revision=self.config.revision,
            worker_info=self._worker_info, served=serving.served, trace_file=self._trace_file, arrival=arrival,
        )
        self._connections[connection] = asyncio.current_task()
        try:
            await connection.serve()
        finally:
            del self._connections[connection]

    def _worker_info(self, latency_ms: int) -> WorkerInfo:
        first_gpu = next((gpu for gpu in self._serving.config.devices if gpu is not None), None)
        return WorkerInfo(
            version=cakemp.__version__,
            dtype=WIRE_DTYPE_NAMES[self.config.dtype],
            os=platform.system().lower(),
            arch=platform.machine(),
            device="cpu" if first_gpu is None else "cuda",
            device_idx=int(first_gpu) if first_gpu is not None and first_gpu.isdigit() else 0,
            latency=latency_ms,
        )

    def _placement_document(self) -> dict:
        """What /layers shows: this worker's name and, per device, the layers it serves (none in
        zero-config mode until a setup has assigned them)."""
        config = self.config if self._serving is None else self._serving.config
        return {
            "name": self.config.name,
            "devices": [{"device": spec.label, "layers": list(collapse_layers(spec.parts)), "count": len(spec.parts)}
                        for spec in self._device_specs(config)],
        }

    def _device_specs(self, config: NodeConfig) -> list[DeviceSpec]:
        """What each device process serving `config`'s layers is told."""
        return device_specs(config, place_layers(config.parts, len(config.devices)), self._runtime_dir)


def _judge(config: NodeConfig) -> Admission:
    """What admits a request to `config`'s layers (from the model's config.json, read here without
    torch) or image components."""
    image = config.workload.image
    if image is not None:
        return ComponentAdmission.for_arch(image.arch, config.parts)
    model = ModelConfig.from_dir(config.checkpoint_path)
    if model.model_type != config.workload.model_type:
        raise CheckpointError(f"{config.checkpoint_path}: {model.architecture} layers are served with --model-type "
                              f"{model.model_type}, not {config.workload.model_type}")
    # Here, before any device process starts, rather than in each device's load.
    missing = [layer for layer in config.parts if model.layer_index(layer) is None]
    if missing:
        raise ConfigError(f"topology entry '{config.name}' names {', '.join(collapse_layers(missing))}, which "
                          f"{config.checkpoint_path} does not have (its layers: {model.layer_name(0)}.."
                          f"{model.layer_name(model.num_hidden_layers - 1)})")
    return LayerAdmission.for_model(model, config.parts, config.max_context)


def _pin(cores: tuple[int, ...]) -> None:
    """Pin every thread of this process (the event loop's, ZeroMQ's I/O thread) to `cores`."""
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), cores)
