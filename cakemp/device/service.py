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
from cakemp.device import fault
from cakemp.device.spec import DeviceSpec
from cakemp.errors import ConfigError, RequestError, UnknownLayer
from cakemp.ipc import Activation, Clear, Done, End, Failure, Forward
from cakemp.rss import resident_bytes


@dataclass
class DeviceService:
    runner: BlockRunner
    layers: tuple[str, ...]  # the front addresses layers by their index in this tuple
    poisoned: str | None = None  # why this process must end after its last answer (a sticky CUDA error)

    @classmethod
    def load(cls, spec: DeviceSpec, on_layer: Callable[[int], None] | None = None) -> DeviceService:
        """Load the spec's layers; `on_layer(n)` once n of them are on the device."""
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        device = "cuda:0" if spec.gpu is not None else "cpu"  # the one GPU this process sees
        if spec.gpu is not None and not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "CUDA finds no such GPU"
            raise ConfigError(f"device {spec.label}: cannot use GPU {spec.gpu}: {build}")
        runner = BlockRunner.load(
            spec.model_dir, spec.layers, device, tensors.compute_dtype(spec.dtype),
            kv_budget_bytes=spec.kv_budget_bytes, max_context=spec.max_context, on_layer=on_layer,
        )
        return cls(runner, spec.layers)

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
        except Exception as e:  # a bug or a device fault: report it, and keep serving if the device still can
            return self._fault(request.request_id, e)

    def _fault(self, request_id: int, error: Exception) -> Failure:
        """The Failure for an error that is no fault of the request. Out of memory fails that
        request alone; an error that poisons the CUDA context sets `poisoned`, for the process to
        end once this answer is sent (cakemp/device/fault.py says why)."""
        summary = ". ".join(str(error).split(". ")[:2]).strip()  # torch's OOM text goes on for lines
        if isinstance(error, torch.OutOfMemoryError):
            torch.cuda.empty_cache()  # hand back what the failed request had cached
            return Failure(request_id, "RequestError", f"out of memory on {self.runner.device}: {summary}")
        if fault.poisons_context(error):
            self.poisoned = f"{type(error).__name__}: {error}"
            return Failure(request_id, "DeviceLost", f"device {self.runner.device} faulted ({summary}); it restarts, "
                                                     "and its sessions lose their KV state")
        return Failure(request_id, type(error).__name__, f"{type(error).__name__}: {error}")

    def _forward(self, request: Forward) -> Activation:
        ops = []
        for op in request.ops:
            if op.layer >= len(self.layers):
                raise UnknownLayer(f"could not find layer #{op.layer} on this device")
            ops.append((self.layers[op.layer], op.index_pos, op.block_idx))
        x = tensors.to_tensor(request.data, request.dtype, request.shape)  # [1, T, H] wire dtype, CPU
        # No inference_mode here: runner.forward enters it, and the casts build no graph (x needs no grad).
        # Cast on the device: torch casts within a host copy on the CPU, single-threaded.
        y = self.runner.forward(request.session, x.to(self.runner.device).to(self.runner.dtype), ops)
        return Activation(request.request_id, request.dtype, request.shape, tensors.to_bytes(y, request.dtype),
                          self.runner.kv_bytes())
