"""The front ⇄ device contract at start: what a device process is told (pickled by the front, which never
imports torch), and the batching defaults both sides share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

# Tokens per chunk of a prompt, and prefill tokens per step (--prefill-chunk): docs/benchmarks.md,
# "Route and pipelined prefill", says how it was chosen.
PREFILL_CHUNK = 128
# A device's piece of a prompt alone on it (device/scheduler.py): about this long at the device's
# measured rate, what a session arriving meanwhile may wait; and at most ALONE_CHUNK tokens, a bound
# on the step's transient activations (4096 tokens of Llama-3-8B's widest, bf16, are about 0.4 GiB,
# inside the 2 GiB a GPU device keeps free of KV for activations).
ALONE_STEP_S = 0.25
ALONE_CHUNK = 4096
# Requests a device runs in one step at most (--max-batch): past a few dozen a decode step is
# no longer bound by reading the weights, so a larger batch only makes each step slower.
MAX_BATCH = 32


def chunk_bounds(tokens: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """[start, end) token ranges of at most `chunk` tokens covering `tokens`, as even as they can be.

    A prompt that fits one chunk is not cut; one that does not is cut into the fewest chunks
    of at most `chunk` tokens, of equal size within one token, whatever the route's stages: by
    the front where its route spans devices (the chunks then flow down the route), else by the
    device that computes it, one chunk a step between its decode steps.

    Why, across S devices that each take about as long on a chunk as the others (the layers
    split evenly): chunk i taking t_i on every stage, the last answer comes after
    sum(t_i) + (S - 1) * max(t_i), in whatever order and sizes the chunks come (a proportionate
    flow shop: the stages after the first wait, in all, for the longest chunk once each, wherever
    it lies). So grading the sizes (small first and last chunks, large ones between) does not
    shorten it: only a smaller longest chunk does, and a smaller chunk costs more per token (each
    reads all its layers' weights once); the fewest chunks of at most `chunk` make the least
    sum for that longest chunk. One stage has no pipeline, and the fewest chunks cost the least
    there too. `--prefill-chunk` sets the trade for a machine: docs/benchmarks.md, "Graded
    prefill chunks", has the measurements.
    """
    count = max(1, -(-tokens // chunk))
    base, extra = divmod(tokens, count)
    bounds, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)


@dataclass(frozen=True)
class ComponentFile:
    """Where an image component's weights are, and its config.json (None: its version's standard one)."""

    weights: str
    config: str | None


@dataclass(frozen=True)
class ImageModel:
    """The image model a node serves components of (`--model-type image-model`): the arch and
    version, as Cake's --image-model-arch and --sd-version spell them."""

    arch: str  # sd | flux | flux1
    sd_version: str  # v1-5 | v2-1 | xl | turbo


@dataclass(frozen=True)
class Workload:
    """What a node's requests are, decided once from its flags (front/config.py, `NodeConfig.workload`)
    and carried to each device (`DeviceSpec.workload`); what differs between the two kinds is read here.

    A text model's layers (`image` None): a request is a hidden state [1, T, H] through a run of
    layers, a session's KV state lives on between its requests, a prompt longer than --prefill-chunk
    is cut into chunks, and the reply has the request's dtype and shape.

    An image model's components (`image` set): a request is one component's call (a SingleOp) over
    token ids or a packed vector; nothing is kept between calls, a call is never cut, and the reply
    has the dtype and shape the component answers in.

    An audio model's layers (`AUDIO`, Cake's `--model-type audio-model`: VibeVoice's language
    models) are a text model's in every way but these rows' fields.
    """

    image: ImageModel | None = None
    # The --model-type a node serving a model's layers runs with (the checkpoint's family must be of
    # it: checkpoint/config.py, Family.model_type); "image-model" with `image` set.
    model_type: str = "text-model"
    # A Cake master can set the node up with zero-config. Not an audio model's: Cake's master_setup
    # reads num_hidden_layers at config.json's top level, which VibeVoice keeps in decoder_config.
    zero_config: bool = True
    # The checkpoint's own dtype (ModelConfig.declared_dtype) wins over --dtype, as in Cake's audio worker.
    declared_dtype_wins: bool = False
    # Prefix reuse may be on (--no-prefix-reuse). Not for an audio model: a request at position 0
    # retires its session's every KV slot for reuse (compute/prefix_cache.py), so on one connection
    # one stack's (or one CFG stream's) new prompt would end the other's context; without it, a
    # request at 0 replaces only the slots it names.
    reuses_prefixes: bool = True

    @property
    def stateful(self) -> bool:
        """A session's requests build on its earlier ones (the KV state a failed request may have lost)."""
        return self.image is None

    @property
    def chunked(self) -> bool:
        """A request longer than --prefill-chunk tokens is cut into chunks: by the front where its route
        spans devices (they follow each other down the route), else by its device, one a step."""
        return self.image is None

    @property
    def same_reply_shape(self) -> bool:
        """The reply has the request's dtype and shape (a hidden state in, a hidden state out)."""
        return self.image is None


TEXT = Workload()
AUDIO = Workload(model_type="audio-model", zero_config=False, declared_dtype_wins=True, reuses_prefixes=False)
# A model's layers by --model-type (an image model's Workload carries its ImageModel).
LAYER_WORKLOADS = {workload.model_type: workload for workload in (TEXT, AUDIO)}


@dataclass(frozen=True)
class DeviceSpec:
    """One device process: which parts of the model it loads (a text model's layers, an image model's
    components: `NodeConfig.parts`), how, and where it listens for the front.

    `gpu` is the CUDA_VISIBLE_DEVICES value the parent sets before start (None: a CPU process,
    which is then started with no GPU visible); inside the process that GPU is always cuda:0.
    """

    index: int
    gpu: str | None
    parts: tuple[str, ...]
    checkpoint_path: str  # a text model's (a directory or a .gguf file); "" for an image model's components
    dtype: str  # f16 | bf16 | f32
    endpoint: str
    kv_budget_bytes: int | None = None
    max_context: int | None = None
    max_batch: int = MAX_BATCH  # requests run together in one step at most
    cuda_graphs: bool = True  # a GPU's decode steps replayed as CUDA graphs (compute/decode_graph.py)
    prefill_chunk: int = PREFILL_CHUNK  # prefill tokens per step (beyond the first chunk); the chunk size
    threads: int | None = None  # torch intra-op threads (None: torch's default, one per core)
    cpus: tuple[int, ...] | None = None  # the cores the process is pinned to (--pin-cpus; None: not pinned)
    poll_s: float = 0.0  # owed a request, look at the socket this long before sleeping (--device-poll-ms)
    prefix_reuse: bool = True  # keep sessions' rows for requests that send them again (compute/prefix_cache.py)
    share_prefixes: bool = False  # ... reused by any session, not only the one they came from
    keep_int4: bool = True  # 4-bit (and 8-bit) matrices kept where torch's kernels take them (loading.kept_kernels)
    expert_cache_bytes: int | None = None  # --expert-offload: MoE experts read on demand into a cache this big
    quantize: str | None = None  # --quantize: plain matrices rounded at load into kept "int8" or "int4" (model/weights/rtn.py)
    quantize_group: int = 128  # --quantize-group: inputs per int4 scale and zero
    progress_s: float = 15.0  # a device busy this long on one step says so (Progress), so the front can tell busy from hung
    log_format: str = "auto"
    log_level: str = "info"
    workload: Workload = TEXT  # an image model's: `parts` names its components, `component_files` has their files
    component_files: tuple[tuple[str, ComponentFile], ...] = ()  # (component name, its files), in `parts`' order

    @property
    def label(self) -> str:
        """How logs and errors name this device: "cuda:2" (the physical GPU) or "cpu:1"."""
        return f"cuda:{self.gpu}" if self.gpu is not None else f"cpu:{self.index}"


# A device process's entry point, which the composition root (cli.py) hands the front:
# (spec, the read end of the parent's death pipe, the parent's pid, generation, every device's endpoint).
DeviceMain = Callable[[DeviceSpec, Connection, int, int, Sequence[str]], None]
