"""The compute of a device serving image components instead of layers: no KV cache, no session
state, one call per SingleOp (the components themselves are in cakemp/model/image/).

A plain class implementing the Runner protocol (compute/runner.py), as BlockRunner does:
`run_batch` answers each call (or the exception that failed it alone); the session methods the
protocol asks for have nothing to do. A call's input is the wire tensor as the master sent it: token ids
(U32 [b, L]) or Cake's packed vector (F32 [total], wire/packing.py), turned into tensors here
with every count checked before anything is allocated. Each call's activation memory is
estimated from its shapes (the component's `cost`) and a call past the device's budget (the
front's --kv-budget-mib, or on a GPU what is free after loading less the headroom, as a text
model's KV caches) is refused alone, with CacheBudgetExceeded. Calls of one component whose
inputs have equal shapes (but for the batch) and whose costs are within GROUP_COST_FACTOR of
each other are computed together, within the budget: two masters' UNet steps are one pass over
the UNet, while a bystander's small call never waits inside a much larger one. Each component
replies as Cake's does: SD's in the node's --dtype, FLUX.2's text encoder a packed F32 vector.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence, Set
from typing import NamedTuple

import torch

from cakemp.checkpoint.image.archs import ARCHS
from cakemp.compute import memory
from cakemp.errors import BadTensor, CacheBudgetExceeded, ConfigError
from cakemp.model.image.component import Component, Files
from cakemp.op import Op
from cakemp.units import human_bytes
from cakemp.wire import DType, RawTensor
from cakemp.wire.packing import unpack_layout

EXTRA = "cakemp[image]"
# The most one call of a group may cost over its cheapest: a call batched with others costs them
# the group's time, so a small call is only grouped with calls of about its own size.
GROUP_COST_FACTOR = 2


class Call(NamedTuple):
    """One component call: its session, the master's wire tensor, and which of the runner's components."""

    session: int
    x: RawTensor
    component: int
    # FLUX.2's text encoder: the prompt's real token count, which Cake's master sends as the op's index_pos.
    token_count: int = 0

    @classmethod
    def of(cls, session: int, x: RawTensor, ops: Sequence[Op], data: memoryview | None = None, to_end: int = 0) -> Call:
        """The call a SingleOp asks for: its one op names the component, its index_pos a token count
        (`data`, x's bytes, are x's own: nothing is named by them here; a call is never cut: `to_end` 0)."""
        return cls(session, x, ops[0].layer, ops[0].index_pos)


class ComponentRunner:
    """A device's image components (`layers`: their names, in the order ops index them)."""

    request = Call.of  # the Runner protocol's: the master's wire tensor through one component
    prefixes = None  # the Runner protocol's: no prefix reuse, nothing is kept between calls
    expert_cache = None  # the Runner protocol's: no MoE experts offloaded
    weight_bytes = None  # the Runner protocol's: components' weights are not counted

    def __init__(self, components: Sequence[tuple[str, Component]], device: torch.device, dtype: torch.dtype,
                 budget_bytes: int | None = None):
        self.layers = tuple(name for name, _ in components)
        self.components = tuple(component for _, component in components)
        self.device, self.dtype = device, dtype
        self.budget_bytes = budget_bytes  # the most activation bytes one group may hold (None: no budget)

    @classmethod
    def load(cls, arch: str, version: str, files: Sequence[tuple[str, Files]], device: str | torch.device,
             dtype: torch.dtype, on_layer: Callable[[int], None] | None = None,
             budget_bytes: int | None = None) -> ComponentRunner:
        """Build and load each named component of `arch` from its files (`.weights`, `.config`);
        `on_layer(n)` once n are on the device. Raises ConfigError without the image extra."""
        classes = _classes(arch, [name for name, _ in files])
        device = torch.device(device)
        loaded = []
        for name, component_files in files:
            loaded.append((name, classes[name](name, component_files, version, device, dtype)))
            if on_layer is not None:
                on_layer(len(loaded))
        if device.type == "cuda" and budget_bytes is None:
            budget_bytes = memory.default_kv_budget(*torch.cuda.mem_get_info(device), str(device))
        return cls(loaded, device, dtype, budget_bytes)

    def run_batch(self, calls: Sequence[Call], between_ops: Callable[[], None] | None = None,
                  together: Callable[[Sequence[int]], None] | None = None) -> list[torch.Tensor | Exception]:
        """Each call's reply (in its component's reply dtype), or the exception that failed it; the calls of
        a group (one component, equal shapes, costs within GROUP_COST_FACTOR) fail together if their
        computation does. `together(indices)` is told each group before it computes."""
        results: list[torch.Tensor | Exception | None] = [None] * len(calls)
        groups: list[_Group] = []
        for i, call in enumerate(calls):
            try:
                prepared, cost = self._prepared(call)
            except Exception as e:
                results[i] = e
                continue
            key = (call.component, self.components[call.component].group(prepared))
            group = next((group for group in groups if group.admits(key, cost, self.budget_bytes)), None)
            if group is None:
                groups.append(group := _Group(key, cost))
            group.add(i, prepared, cost)
        # A UNet step or a VAE decode of a large image can take longer on a CPU than the front's
        # watchdog waits: after every module, the device may say it is still busy.
        hook = None if between_ops is None else torch.nn.modules.module.register_module_forward_hook(
            lambda module, inputs, output: between_ops())
        try:
            for group in groups:
                if together is not None:
                    together([i for i, _ in group.members])
                self._run_group(group.key[0], group.members, results)
        finally:
            if hook is not None:
                hook.remove()
        return results

    def _prepared(self, call: Call) -> tuple[tuple[torch.Tensor, ...], int]:
        """The call's tensors checked and on the device, and its cost; CacheBudgetExceeded past the budget
        (before anything of the size the cost counts is allocated)."""
        name, component = self.layers[call.component], self.components[call.component]
        tensors = self._tensors(call.x, name)
        if component.uses_token_count:
            prepared = component.prepare(*tensors, token_count=call.token_count)
        else:
            prepared = component.prepare(*tensors)
        cost = component.cost(prepared)
        if self.budget_bytes is not None and cost > self.budget_bytes:
            raise CacheBudgetExceeded(f"{name}: the call would hold about {human_bytes(cost)} of activations, "
                                      f"past this device's budget of {human_bytes(self.budget_bytes)} "
                                      f"(--kv-budget-mib); ask for fewer or smaller images")
        return prepared, cost

    def _run_group(self, index: int, members: list[tuple[int, tuple[torch.Tensor, ...]]], results: list) -> None:
        """Compute one group's calls together; each member's reply, or the error that failed them all."""
        try:
            with torch.inference_mode():
                outputs = self.components[index].run([prepared for _, prepared in members])
            for (i, _), output in zip(members, outputs, strict=True):
                results[i] = output
        except Exception as e:
            for i, _ in members:
                results[i] = e

    @staticmethod
    def _tensors(x: RawTensor, name: str) -> list[torch.Tensor]:
        """The call's tensors on the CPU: token ids as int64, or each tensor of the pack (views, f32)."""
        count = memoryview(x.data).nbytes // 4
        if x.dtype == DType.U32:
            # Read as int32: an id of 2^31 or more turns negative and is refused as outside the vocabulary.
            ids = torch.frombuffer(x.data, dtype=torch.int32, count=count)
            return [ids.view(tuple(x.shape)).long()]
        if x.dtype != DType.F32:
            raise BadTensor(f"{name} takes U32 token ids or a packed F32 vector")
        layout = unpack_layout(x.data, name)  # every count checked before anything is allocated
        vector = torch.frombuffer(x.data, dtype=torch.float32, count=count)
        return [vector[packed.start:packed.start + packed.count].view(packed.shape) for packed in layout]

    # The Runner protocol's session methods: a component keeps nothing of a session, so the
    # front's Goodbye and closed connections find nothing here to clear, free or count.

    def clear_session(self, session: int) -> None:
        """Goodbye: nothing to clear."""

    def free_session(self, session: int) -> None:
        """A closed connection: nothing to free."""

    def kv_bytes(self) -> int:
        """No session state: 0 bytes."""
        return 0

    def sessions(self) -> Set[int]:
        """No session holds state."""
        return frozenset()


class _Group:
    """Calls computed together: one component's, of equal shapes but the batch (`key`), whose costs are
    within GROUP_COST_FACTOR of each other and sum to within the budget."""

    def __init__(self, key: tuple, cost: int):
        self.key = key
        self.members: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        self.least = self.most = cost
        self.total = 0

    def admits(self, key: tuple, cost: int, budget: int | None) -> bool:
        return (key == self.key and max(self.most, cost) <= GROUP_COST_FACTOR * min(self.least, cost)
                and (budget is None or self.total + cost <= budget))

    def add(self, index: int, prepared: tuple[torch.Tensor, ...], cost: int) -> None:
        self.members.append((index, prepared))
        self.least, self.most, self.total = min(self.least, cost), max(self.most, cost), self.total + cost


def _classes(arch: str, names: Sequence[str]) -> dict[str, type[Component]]:
    """The class computing each of `names`, from `arch`'s row (its model module imported here, with
    torch's image libraries). Raises ConfigError for a name it has not, or without the image extra."""
    row = ARCHS.get(arch)
    for name in names:
        if row is None or name not in row.components:
            raise ConfigError(f"{name} (--image-model-arch {arch}) is not served by this version of cakemp")
    try:
        module = importlib.import_module(row.module)
    except ImportError as e:
        raise ConfigError(f"image components need the optional extra {EXTRA} (pip install '{EXTRA}'): "
                          f"{e}") from None
    return {name: getattr(module, row.components[name].cls) for name in names}
