"""What a device process does with each request: a plain class, runnable without a process.

`DeviceService.handle` turns one ipc request into one reply and never raises: a RequestError
becomes a Failure carrying its message, any other exception a Failure naming its type, so that
nothing a master sends can crash the process or touch another session's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cakemp.compute import tensors
from cakemp.compute.runner import BlockRunner
from cakemp.device.spec import DeviceSpec
from cakemp.errors import RequestError, UnknownLayer
from cakemp.ipc import Activation, Clear, Done, End, Failure, Forward
from cakemp.rss import resident_bytes


@dataclass
class DeviceService:
    runner: BlockRunner
    layers: tuple[str, ...]  # the front addresses layers by their index in this tuple

    @classmethod
    def load(cls, spec: DeviceSpec, on_layer: Callable[[int], None] | None = None) -> "DeviceService":
        """Load the spec's layers; `on_layer(n)` once n of them are on the device."""
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        device = "cuda:0" if spec.gpu is not None else "cpu"  # the one GPU this process sees
        runner = BlockRunner.load(
            spec.model_dir, spec.layers, device, tensors.compute_dtype(spec.dtype),
            kv_budget_bytes=spec.kv_budget_bytes, max_context=spec.max_context, on_layer=on_layer,
        )
        return cls(runner, spec.layers)

    def threads(self) -> int:
        """torch's intra-op threads in this process (--cpu-threads, or the CPU devices' share of the cores)."""
        return torch.get_num_threads()

    def memory_bytes(self) -> int:
        """Bytes this device holds: GPU memory allocated, or the process's RSS on a CPU."""
        if torch.device(self.runner.device).type == "cuda":
            return torch.cuda.memory_allocated()
        return resident_bytes()

    def handle(self, request: Forward | Clear | End) -> Activation | Done | Failure:
        try:
            if isinstance(request, Forward):
                return self._forward(request)
            if isinstance(request, Clear):
                self.runner.clear_session(request.session)
            else:
                self.runner.end_session(request.session)
            return Done(request.request_id, self.runner.session_count(), self.runner.kv_bytes())
        except RequestError as e:
            return Failure(request.request_id, type(e).__name__, str(e))
        except Exception as e:  # a bug or a device fault: report it, keep serving
            return Failure(request.request_id, type(e).__name__, f"{type(e).__name__}: {e}")

    def _forward(self, request: Forward) -> Activation:
        ops = []
        for op in request.ops:
            if op.layer >= len(self.layers):
                raise UnknownLayer(f"could not find layer #{op.layer} on this device")
            ops.append((self.layers[op.layer], op.index_pos, op.block_idx))
        x = tensors.to_tensor(request.data, request.dtype, request.shape)  # [1, T, H] wire dtype, CPU
        # No inference_mode here: runner.forward enters it, and the cast builds no graph (x needs no grad).
        y = self.runner.forward(request.session, x.to(self.runner.device, self.runner.dtype), ops)
        return Activation(request.request_id, request.dtype, request.shape, tensors.to_bytes(y, request.dtype),
                          self.runner.kv_bytes())
