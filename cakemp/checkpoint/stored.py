"""What every stored weight form declares, torch-free: the `Parts` of a weight as a checkpoint stores
it, the form's frozen config (a `Quantization`), and its row (`Method`) in checkpoint/quantization.METHODS;
with the shape checks the forms share. Each form is a module (checkpoint/fp8.py, gptq.py, mlx.py)
and its torch side one in model/weights/ that its row names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from cakemp.checkpoint.resident import KeptForm
from cakemp.checkpoint.values import mapping

Shape = tuple[int, ...]


class Parts(Protocol):
    """The stored tensors that make one quantized weight, whatever its format: what the readers
    and the sizing (through the readers: compute/loading.LoadPlan.nbytes) ask of it before any value is read."""

    @property
    def stored(self) -> tuple[str, ...]:
        """The names of the stored tensors that make the weight."""

    def matrix_shape(self, shape: Callable[[str], Shape]) -> Shape:
        """The shape of the matrix the parts dequantize into, from their stored shapes (`shape(part)`);
        ValueError naming the part whose shape does not fit the others'."""

    def kept_form(self, shape: Callable[[str], Shape]) -> KeptForm | str:
        """How one of the kept kernels takes the matrix with its codes unchanged (checkpoint/resident.py),
        or why none does, from the parts' stored shapes alone."""


class Quantization(Protocol):
    """A checkpoint's quantization, as config.json declares it (one frozen config per format)."""

    def parts(self, weight: str, stored: Callable[[str], bool]) -> Parts | None:
        """The stored tensors of `weight` ("P.weight") if it is stored as several parts, else None
        (`stored(name)`: whether the checkpoint holds tensor `name`)."""


class Method(NamedTuple):
    """One stored weight form as config.json declares it, declared once: the settings that name it,
    their parse into its frozen config, and its torch side, named by path so that this table imports
    no torch (model/weights/quantized.py imports it on a device: a QuantizedParts made from the
    config's parts, which dequantizes them or keeps them for a kernel)."""

    name: str
    settings: Callable[[dict[str, Any]], dict[str, Any] | None]  # config.json -> its settings, if it declares this form
    parse: Callable[[dict[str, Any]], Quantization]  # the settings -> the form's frozen config
    config: type  # the class `parse` returns
    weights: str  # "module:Class" of its torch side


def named_by(method: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """The settings of a form named by quantization_config's quant_method."""
    def settings(d: dict[str, Any]) -> dict[str, Any] | None:
        quant = mapping("quantization_config", d.get("quantization_config") or None)
        return quant if quant and quant.get("quant_method") == method else None
    return settings


def ranked(name: str, shape: Shape, rank: int, at_least: bool = False) -> Shape:
    """`shape` if it has `rank` dimensions (or more, `at_least`); else ValueError naming the tensor."""
    if len(shape) < rank or len(shape) > rank and not at_least:
        raise ValueError(f"{name} has shape {tuple(shape)}, expected {rank}{' or more' if at_least else ''} dimensions")
    return tuple(shape)


def expect(name: str, shape: Shape, expected: Shape) -> None:
    if tuple(shape) != expected:
        raise ValueError(f"{name} has shape {tuple(shape)}, expected {expected}")


def module_of(weight: str) -> str | None:
    """"P" of a weight named "P.weight", else None."""
    module, dot, tail = weight.rpartition(".")
    return module if dot and tail == "weight" else None
