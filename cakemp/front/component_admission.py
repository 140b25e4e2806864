"""What the front checks of a request to an image component node (pure: no I/O, no torch).

The counterpart of admission.py for `--model-type image-model`. A Cake image master sends each
component call as one SingleOp naming the component (docs/models.md, Image components), so a request is
admitted only if it names one served component and carries that component's input:

* token ids (clip, clip2, flux_text_encoder): U32 [b, L], 1 <= b <= 8, 1 <= L <= 1024, of the
  byte count that shape needs;
* a pack (unet, vae, the FLUX transformers and VAE): F32 [total] whose `pack_tensors` header
  (wire/packing.py) is sound, naming the component's number of tensors with their ranks, each
  dim within its limit (checkpoint/image/archs.py: the batch, a UNet's text length, image and
  latent sides, a FLUX call's tokens).

Whether the sizes fit the component's architecture (channels, text width, vocabulary) the
device checks, against the config it loaded, and whether the call's cost fits its budget. A
Batch is refused (`check_batch`): Cake never sends one to an image component, and a text
master's Batch here is a misconfigured cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cakemp.checkpoint.image.archs import ARCHS, MAX_TOKEN_ROWS, MAX_TOKENS, Packed, Tokens
from cakemp.errors import BadOps, BadTensor, UnknownLayer
from cakemp.front.admission import shown
from cakemp.wire import DType, LayerOps, RawTensor
from cakemp.wire.packing import unpack_layout

# The largest frame an image master sends: FLUX.2's transformer call at 1024² is about 18 MB and
# a VAE encode of a 2048² image 50 MB; this leaves room for 4096² images.
MAX_COMPONENT_PAYLOAD = 256 * 1024 * 1024


@dataclass(frozen=True)
class ComponentAdmission:
    """The Admission (admission.py) of an image model's components: the ones this node serves (by name,
    with their inputs), and the judge of a request to one."""

    components: dict[str, Tokens | Packed]

    @classmethod
    def for_arch(cls, arch: str, names: Sequence[str]) -> ComponentAdmission:
        return cls({name: ARCHS[arch].components[name].input for name in names})

    def decode_limits(self) -> dict[str, int]:
        return {"ops": 1}

    def max_payload(self) -> int:
        return MAX_COMPONENT_PAYLOAD

    def check_batch(self) -> None:
        """Image components are called with SingleOp only."""
        raise BadOps("this node serves image components, which a Cake master calls with SingleOp; a Batch of "
                     "layers is a text model's (check the master's --model-type)")

    def check(self, x: RawTensor, ops: LayerOps) -> None:
        """Raise the BadRequest that refuses running the op over `x`, if any."""
        if len(ops) != 1:
            raise BadOps(f"an image component request names one component, this one names {len(ops)}")
        name = ops.layers[0]
        wanted = self.components.get(name)
        if wanted is None:
            raise UnknownLayer(f"could not find component {shown(name)} (this node serves "
                               f"{', '.join(self.components)})")
        if isinstance(wanted, Tokens):
            _check_tokens(name, x)
        else:
            _check_pack(name, wanted, x)


def _check_tokens(name: str, x: RawTensor) -> None:
    if x.dtype != DType.U32:
        raise BadTensor(f"{name} takes U32 token ids, got {DType.describe(x.dtype)}")
    shape = x.shape
    if len(shape) != 2 or not 1 <= shape[0] <= MAX_TOKEN_ROWS or not 1 <= shape[1] <= MAX_TOKENS:
        raise BadTensor(f"{name} takes token ids [b, L] with 1 <= b <= {MAX_TOKEN_ROWS} and 1 <= L <= {MAX_TOKENS}, "
                        f"got shape {list(shape)[:4]}")
    _check_bytes(name, x, shape[0] * shape[1] * 4)


def _check_pack(name: str, wanted: Packed, x: RawTensor) -> None:
    if x.dtype != DType.F32 or len(x.shape) != 1:
        raise BadTensor(f"{name} takes one packed F32 vector [total] (Cake's pack_tensors of "
                        f"{wanted.describe()}), got {DType.describe(x.dtype)} of {len(x.shape)} dimensions")
    _check_bytes(name, x, x.shape[0] * 4)
    shapes = [tensor.shape for tensor in unpack_layout(x.data, name)]
    ranks = tuple(len(shape) for shape in shapes)
    if ranks not in wanted.ranks:
        raise BadTensor(f"{name} takes {wanted.describe()} of ranks "
                        f"{' or '.join(str(list(r)) for r in wanted.ranks)}, the pack holds tensors of ranks "
                        f"{list(ranks)}")
    form = wanted.forms[wanted.ranks.index(ranks)]
    for tensor, shape, limits in zip(wanted.names, shapes, form):  # names has FLUX.1's optional guidance too
        if any(limit is not None and size > limit for size, limit in zip(shape, limits, strict=True)):
            raise BadTensor(f"{name}: {tensor} has shape {list(shape)}, past its limits "
                            f"{['-' if limit is None else limit for limit in limits]}")


def _check_bytes(name: str, x: RawTensor, expected: int) -> None:
    if memoryview(x.data).nbytes != expected:
        raise BadTensor(f"{name}: tensor data is {memoryview(x.data).nbytes} bytes, its shape needs {expected}")
