"""Acceptance check on a CUDA machine: cakemp's GPU path runs, matches its references, recovers from OOM.

    python -m tools.gpu_check [--out FILE] [--rehearse] [--sections NAME,...]

About six minutes on one GPU (Python 3.12, torch 2.11 or 2.13; sections 7-10 estimated
at ~2.5 minutes together, none of it measured yet). Each section records its
findings, or the error that stopped it, and the next one runs regardless:

1. machine: torch, CUDA and driver versions, the GPU, `nvidia-smi -L`, and
   `grep nvidia /proc/devices` (the device groups the systemd unit's DeviceAllow must name),
   and which of the unit's `DeviceAllow=char-…` groups this driver registers;
2. tests: the gpu-marked tests and the Triton kernels' own (`pytest -m "gpu or kernel" tests/model tests/compute
   tests/device`);
3. attention: every call shape the block makes, at Llama-3-8B's head shape (32 query heads on
   8 kv heads of 128), in f16, bf16 and f32, with SDPA's math kernel disabled, so a shape no
   fused kernel takes raises instead of quietly materialising scores: decode at two
   neighbouring lengths (the first call at a new length against the steady time shows a
   kernel that rebuilds per length; cuDNN attention is measured the same way, for the record),
   full-causal prefill from 0 and after a cached prefix, and sliding-window prefill longer
   than the window (4096, Mistral's). Per shape: the kernel that ran, the error against an f32
   reference, and the peak memory against the f32 [heads, T, S] scores the math kernel holds;
4. fp8: whether cuBLAS's block-scaled FP8 matmul runs here, and which FP8 matmul start-up picks
   (cuBLAS's, the Triton kernel of model/weights/fp8_gemm.py, or none); the Triton kernel against
   the emulation (in units of the bound tests/model/test_fp8_gemm.py holds it to: at most 1 is
   within) at 1, 7 and 512 rows of a 4096x4096 matrix, its f32 distance from the emulation in units
   of the products' summed magnitude (f32 accumulation: a few 2^-24; an FP8 MMA keeping 13 mantissa
   bits, as Hopper's is reported to: up to ~2^-13), and its time against a bf16 F.linear of
   the same shape; an FP8 checkpoint loaded with its matrices kept FP8 (`fp8.kept_as_fp8`), their
   resident bytes against bf16's, each kept matrix's product against the emulation, and the
   layers' outputs against the same layers dequantized in f32. Rehearsal: the kernel through
   Triton's interpreter on the CPU (the loaded layers are dequantized there);
5. decode: per-layer decode time of Llama-3-8B-shaped layers (bf16; FP8 where a matmul is picked)
   against the bandwidth floor, weight bytes / the HBM bandwidth measured by a copy in the same
   run, and FP8's time over bf16's;
6. node: `cakemp run --gpus all` on the demo checkpoint: only its device processes hold a CUDA
   context (the front maps no CUDA library), its output matches the same layers run here; with
   this process holding all but a few MiB of the GPU, new sessions' 2048-token prompts grow the
   device's KV pool until it runs out of memory: that request is answered with WorkerError, the
   first session goes on matching, and the node serves again once the memory is back.
7. int4 (~40 s): one Llama-3-8B-shaped layer as GPTQ (group 128), MLX affine (group 128) and
   GGUF (Q4_0 attention, Q4_K gate/up, Q4_1 down) checkpoints of random 4-bit codes, loaded with the 4-bit
   matrices kept int4 (torch's int4 matmul, model/weights/int4.py) and dequantized to bf16: resident
   weight bytes of each (held, and as the fit check counts them), the int4 layer's output error
   against the dequantized one (prefill of 64, decode), and decode time per layer of each, op by op
   and replayed as a CUDA graph (compute/decode_graph.py);
   whether BlockRunner.load itself keeps them int4 here. Rehearsal: the CPU's int4 kernel;
8. dequantize (~15 s): GPTQ (4-bit, 3-bit act-order, 8-bit), MLX (4-, 3- and 8-bit) and every
   ggml type dequantized on the GPU against the same bytes dequantized on the CPU (the largest
   difference, 0 when bit-equal).
9. image (~40 s): the tiny Stable Diffusion 1.5 components of tests/support/image.py (clip, unet, vae)
   served by `cakemp run --gpus all --model-type image-model --dtype f32`, each component's
   reply against the same modules run in this process on the GPU in f32 (the largest
   difference), and whether the node logged an error.
10. experts (~60 s, estimated): MoE layers with their routed experts offloaded (--expert-offload) on
   the GPU, staged through pinned memory and copied on a side stream (model/weights/expert_transfer.py):
   a plain Qwen3.5-MoE (stacked experts) and a 4-bit GPTQ Qwen3-MoE (per-expert, kept int4 in
   bf16), each against the same layers with every expert resident (bit-equal where both
   dequantize; the largest relative difference where offloaded experts stay int4), with a cache
   of every expert and one smaller than one expert, the cache's hits and misses and what it holds
   its experts as; then 2 Qwen3-MoE layers of 64 experts, top-4, bf16, offloaded into a cache of a
   quarter of them against all resident: outputs (within the bf16 bound), GPU bytes held, decode
   tokens/s on repeating and varied inputs, hit rate, and the same offload with its copies on the
   compute stream instead of the side stream (`side_stream_speedup`: whether they overlapped).

11. node-perf (~90 s, estimated): 4 Llama-3-8B-shaped layers of a random bf16 checkpoint: the
   bandwidth floor of one decode step (weight bytes / a copy measured here), decode steps of 1, 8
   and 32 sessions 512 tokens in, in this process through BlockRunner.run_batch (its decode steps
   CUDA graphs, as the node's; with the CPU time its call takes before the GPU's work is waited for,
   its planning and launches, over the step's wall time) and through transformers' own layers
   batched, and through `cakemp
   run --gpus all --dtype bf16` from 1, 8 and 32 concurrent masters, spread over up to 8 processes
   (bench/masters.py: one process of them would set the rate it measured) (tokens/s, each against
   in-process, and a step's ms beyond the same step in-process, the CPU per token of the front, the
   device and the masters, and how busy each was: which one sets the rate; and the requests its device
   ran a step, below the sessions where they came back too far apart for one); one master again through
   a node whose device polls its sockets 1 ms before it sleeps (`--device-poll-ms 1`: what its wake-up
   costs a lone session, where cores are spare); a 512-token prompt through the node against in-process; and the
   same 32 masters through a front of this design at its least (bench/front_floor.py: TCP, the Cake
   codec and ZeroMQ, to a device that echoes after the in-process step's time): what one front process
   relays on this machine's CPU, whatever the GPU, beside what the node did; and a 512-token prompt's
   round trip through it, what carrying its activation there and back costs here (`prompt_512_transport_ms`,
   beside the node's prompt and in-process). `decode_attention`: the node's log of how its decode rows
   attended (in place, by the paged kernel, once its start-up trial passed; else why not).
12. graphs (~40 s, estimated): the same 4 layers through BlockRunner with its decode steps replayed
   as CUDA graphs (compute/decode_graph.py) beside the paged step op by op, at 1, 8 and 32 sessions
   512 tokens in: each replay against the same fixed-shape step run eagerly over the same buffers
   (bit-equal expected), the graphed outputs against the paged step's (in units of the bf16 bound),
   step times of both against the bandwidth floor, and each capture's time and memory.
13. mixed-attention (~60 s, estimated): one attention layer's step of decode rows and prompt chunks
   (8 decodes + one 128-token chunk, 32 decodes + two; Llama-3-8B's heads, bf16, 512 positions) over a
   paged pool, as cakemp calls it (decodes in one call, each chunk in its own) against one padded SDPA
   call and one FlexAttention call (bench/mixed_attention.py): ms a call of each, the block mask's own
   time and the compile's, each checked against cakemp's way; then decode rows alone (32 at 512 and at
   4,096 positions, one at 8,192), cakemp's way (in place: the paged kernel, model/paged_attention.py)
   against the same over their gathered blocks (`gathered`). Rehearsal: small heads, f32.
Writes every finding as JSON to --out (default: $OUT/gpu_check.json where OUT is set, else
./gpu_check.json), the file rewritten after each one (a run cut off at its time limit leaves what it had
found), and prints one line per finding. `--rehearse` runs the same code on the CPU
at small sizes (no kernel restriction, no OOM; decode graphs captured and replayed with a CUDA graph's
semantics by tests/support/cpu_graphs.py), to catch a broken script before GPU time is spent on
it. Record what it finds in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

if "--rehearse" in sys.argv:
    # The CPU runs the Triton kernel through Triton's interpreter, which is chosen when Triton is
    # imported (torch._dynamo imports it), so before torch.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.blocks import timed  # noqa: E402
from cakemp.compute import tensors  # noqa: E402
from cakemp.model import attention  # noqa: E402
from cakemp.model.weights import fp8  # noqa: E402
from cakemp.wire import DType  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

FINDINGS: dict[str, object] = {}
# --out: rewritten after every finding, so that a run killed at its time limit still leaves what it found (a
# device call's output comes back only as its last 12,000 characters).
OUT_PATH: Path | None = None
ASKED: set[str] | None = None  # --sections: the sections to run (None: all); the machine's always runs
SECTIONS: list[str] = []  # every section's name, in order


def finding(key: str, value: object) -> None:
    FINDINGS[key] = value
    print(f"{key}: {json.dumps(value, default=str)}", flush=True)
    if OUT_PATH is not None:  # whole or not at all: a run killed mid-write leaves the last whole file
        written = OUT_PATH.with_name(OUT_PATH.name + ".part")
        written.write_text(json.dumps(FINDINGS, indent=2, default=str) + "\n")
        os.replace(written, OUT_PATH)


def section(name: str):
    """Run the decorated section now, recording its error (and going on) if it fails."""
    def run(fn):
        SECTIONS.append(name)
        if ASKED is not None and name not in ASKED and name != "machine":
            return fn
        started = time.monotonic()
        try:
            fn()
        except Exception as e:
            finding(f"{name}.error", "".join(traceback.format_exception_only(type(e), e)).strip())
            traceback.print_exc()
        finding(f"{name}.seconds", round(time.monotonic() - started, 1))
        return fn
    return run


def shell(command: str, timeout: float = 30) -> str:
    try:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout)
        return (done.stdout + done.stderr).strip()
    except subprocess.SubprocessError as e:
        return f"failed: {e}"


def unit_device_groups() -> dict[str, bool]:
    """Each `DeviceAllow=char-NAME` of the systemd unit: whether this driver registers a character
    device group NAME (systemd matches it as a glob against /proc/devices, as here)."""
    chars = Path("/proc/devices").read_text().split("Block devices:")[0]
    groups = {line.split()[1] for line in chars.splitlines() if line.strip()[:1].isdigit()}
    unit = (ROOT / "deploy" / "systemd" / "cakemp@.service").read_text()
    names = re.findall(r"^DeviceAllow=char-(\S+)", unit, re.MULTILINE)
    return {name: any(fnmatch.fnmatchcase(group, name) for group in groups) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    out_dir = os.environ.get("OUT")
    parser.add_argument("--out", default=str(Path(out_dir) / "gpu_check.json") if out_dir else "gpu_check.json")
    parser.add_argument("--rehearse", action="store_true", help="run on the CPU at small sizes")
    parser.add_argument("--sections", help="only these sections, comma-separated (a rerun of those that failed)")
    args = parser.parse_args()
    global ASKED, OUT_PATH
    ASKED = None if args.sections is None else set(args.sections.split(","))
    OUT_PATH = Path(args.out)
    # The node and pytest are subprocesses: they find cakemp (and the carried wheels) the same way.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    rehearse = args.rehearse
    device = torch.device("cpu" if rehearse else "cuda", None if rehearse else 0)
    if not rehearse and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here (use --rehearse to try the script on the CPU)")
    started = time.monotonic()

    @section("machine")
    def machine():
        finding("machine.python", sys.version.split()[0])
        finding("machine.torch", torch.__version__)
        finding("machine.cuda", torch.version.cuda)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(0)
            finding("machine.gpu", f"{props.name}, sm{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB")
            finding("machine.cudnn", torch.backends.cudnn.version())
        finding("machine.nvidia_smi", shell("nvidia-smi -L; nvidia-smi --query-gpu=driver_version,pci.bus_id "
                                           "--format=csv,noheader"))
        finding("machine.proc_devices_nvidia", shell("grep nvidia /proc/devices"))
        finding("machine.unit_device_allow", unit_device_groups())

    @section("tests")
    def tests():
        if rehearse:
            finding("tests.skipped", "rehearsal")
            return
        output = shell(f"cd {ROOT} && {sys.executable} -m pytest -q -m 'gpu or kernel' -p no:cacheprovider "
                       "tests/model tests/compute tests/device 2>&1 | tail -25", timeout=240)
        finding("tests.summary", output.splitlines()[-1] if output else "no output")
        failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
        finding("tests.failed", failed)

    @section("attention")
    def attention_shapes():
        check_attention(device, rehearse)

    @section("fp8")
    def fp8_section():
        check_fp8(device, rehearse)

    @section("decode")
    def decode():
        check_decode(device, rehearse)

    @section("node")
    def node():
        asyncio.run(check_node(device, rehearse))

    @section("int4")
    def int4_section():
        check_int4(device, rehearse)

    @section("dequantize")
    def dequantize_section():
        check_dequantize(device, rehearse)

    @section("image")
    def image_section():
        asyncio.run(check_image(device, rehearse))

    @section("experts")
    def experts_section():
        check_experts(device, rehearse)

    @section("node-perf")
    def node_perf_section():
        asyncio.run(check_node_perf(device, rehearse))

    @section("graphs")
    def graphs_section():
        if not rehearse:
            return check_graphs(device, rehearse)
        # The CPU has no CUDA graphs: a rehearsal captures and replays with their semantics instead.
        import pytest

        from tests.support import cpu_graphs
        with pytest.MonkeyPatch.context() as patch:
            cpu_graphs.install(patch)
            check_graphs(device, rehearse)

    @section("mixed-attention")
    def mixed_attention_section():
        check_mixed_attention(device, rehearse)

    if ASKED is not None and ASKED - set(SECTIONS):
        finding("sections.unknown", f"{sorted(ASKED - set(SECTIONS))}: the sections are {', '.join(SECTIONS)}")
    finding("total_seconds", round(time.monotonic() - started, 1))
    print(f"findings written to {args.out}")


# --- 3. attention -------------------------------------------------------------------------

H_Q, H_KV, D = 32, 8, 128


def reference_attention(q, k, v, start, window, scale):
    """f32 masked softmax, in query chunks of 1024 rows so that the reference itself stays small."""
    T = q.shape[2]
    end = start + T
    n_rep = q.shape[1] // k.shape[1]
    keys = k[:, :, :end].float().repeat_interleave(n_rep, dim=1)
    values = v[:, :, :end].float().repeat_interleave(n_rep, dim=1)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for c0 in range(0, T, 1024):
        c1 = min(T, c0 + 1024)
        q_pos = torch.arange(start + c0, start + c1, device=q.device)[:, None]
        k_pos = torch.arange(end, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = (q[:, :, c0:c1].float() @ keys.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        out[:, :, c0:c1] = scores.softmax(dim=-1) @ values
    return out


def check_attention(device: torch.device, rehearse: bool) -> None:
    window = 256 if rehearse else 4096
    long = 2 * window + window // 2  # a partial last chunk
    shapes = {  # name: (start, T, window, context S the cache holds)
        "decode-full@L": (2 * window - 1, 1, None),
        "decode-full@L+1": (2 * window, 1, None),
        "decode-window@L": (2 * window - 1, 1, window),
        "decode-window@L+1": (2 * window, 1, window),
        "prefill-full-from-0": (0, window, None),
        "prefill-full-after-prefix": (window, window // 2, None),
        "prefill-window-from-0": (0, long, window),
        "prefill-window-after-prefix": (window // 2, long - window // 2, window),
    }
    allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if rehearse:
        allowed.append(SDPBackend.MATH)  # the CPU's flash kernel counts as MATH in sdpa_kernel's terms
    attention.use_fused_kernels()
    scale = 1 / math.sqrt(D)
    generator = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        capacity = long + window
        k = torch.randn(1, H_KV, capacity, D, generator=generator, device=device).to(dtype)
        v = torch.randn(1, H_KV, capacity, D, generator=generator, device=device).to(dtype)
        for shape, (start, T, win) in shapes.items():
            key = f"attention.{name}.{shape}"
            q = torch.randn(1, H_Q, T, D, generator=generator, device=device).to(dtype)
            try:
                with sdpa_kernel(allowed):
                    used = attention.backends_used(q, k, v, start, win, scale)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        before = torch.cuda.memory_allocated()
                    first = 1e3 * timed(lambda: attention.attend(q, k, v, start, win, scale), device)
                    steady = 1e3 * timed(lambda: attention.attend(q, k, v, start, win, scale), device, repeats=5)
                    out = attention.attend(q, k, v, start, win, scale)
                peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
                # What the math kernel held before: f32 scores over every key the call reads.
                S = start + T - (0 if win is None else max(0, start - win + 1))
                error = (out.float() - reference_attention(q, k, v, start, win, scale)).abs().max().item()
                finding(key, {
                    "kernels": sorted(set(used)), "calls": len(used), "max_abs_error": error,
                    "peak_mib": None if peak is None else round(peak / 2**20, 1),
                    "math_scores_mib": round(H_Q * T * S * 4 / 2**20, 1),
                    "first_ms": round(first, 3), "steady_ms": round(steady, 3),
                })
            except Exception as e:
                finding(key, {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
    if device.type == "cuda":
        cudnn_decode_recompiles(device, window)


def cudnn_decode_recompiles(device: torch.device, length: int) -> None:
    """For the record (cakemp switches cuDNN attention off): cuDNN's first call at each new
    decode length against its steady time at that length."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        q = torch.randn(1, H_KV, H_Q // H_KV, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, H_KV, length + 8, D, device=device, dtype=torch.bfloat16)
        times = {}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for n in (length, length + 1, length + 2):
                call = lambda: F.scaled_dot_product_attention(q, k[:, :, :n], k[:, :, :n])  # noqa: E731
                times[n] = (round(1e3 * timed(call, device), 3), round(1e3 * timed(call, device, repeats=5), 3))
        finding("attention.cudnn_decode_first_vs_steady_ms", times)
    except Exception as e:
        finding("attention.cudnn_decode_first_vs_steady_ms", f"{type(e).__name__}: {str(e).splitlines()[0]}")
    finally:
        attention.use_fused_kernels()


# --- 4. fp8 -------------------------------------------------------------------------------

def check_fp8(device: torch.device, rehearse: bool) -> None:
    from cakemp.compute.runner import BlockRunner
    from tests.support.checkpoints import make_checkpoint  # transformers: only this section needs it

    finding("fp8.scaled_mm_works_bf16", fp8.scaled_mm_works(device, torch.bfloat16))
    finding("fp8.scaled_mm_works_f16", fp8.scaled_mm_works(device, torch.float16))
    finding("fp8.gemm_bf16", fp8.gemm(device, torch.bfloat16))
    finding("fp8.gemm_f16", fp8.gemm(device, torch.float16))
    check_fp8_kernel(device, rehearse)
    layers = ["model.layers.0", "model.layers.1"]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), "llama", fp8_block=(128, 128), hidden_size=1024, intermediate_size=2816,
                               num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2)
        kept = BlockRunner.load(path, layers, device, torch.bfloat16)
        matrices = [{"w_qkv": b.w_qkv, "w_o": b.w_o, "w_gate_up": b.mlp.w_gate_up, "w_down": b.mlp.w_down}
                    for b in kept.blocks]
        finding("fp8.kept_as_fp8", {name: isinstance(w, fp8.Fp8Weight) for name, w in matrices[0].items()})
        kept_bytes = sum(w.nbytes for block in matrices for w in block.values())
        finding("fp8.weight_bytes_kept", kept_bytes)
        finding("fp8.weight_bytes_ratio_to_bf16", round(kept_bytes / sum(
            math.prod(w.shape) * 2 for block in matrices for w in block.values()), 4))
        # Each kept matrix's product against the emulation, in units of the bound the CPU test holds
        # the Triton kernel to (tests/model/test_fp8_gemm.py): at most 1 is within it.
        worst = {}
        for name, w in matrices[0].items():
            if isinstance(w, fp8.Fp8Weight):
                x = torch.randn(7, w.shape[1], generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
                worst[name] = round(fp8_over_bound(w.matmul(x), x, w, torch.bfloat16), 4)
        finding("fp8.matmul_vs_emulation_over_bound", worst)
        exact = BlockRunner.load(path, layers, "cpu", torch.float32)  # dequantized, f32
        generator = torch.Generator().manual_seed(0)
        worst = 0.0
        for position, T in ((0, 64), (64, 1), (65, 1)):
            x = torch.randn(1, T, 1024, generator=generator)
            ops = [(layer, position, i) for i, layer in enumerate(layers)]
            ours = kept.run(1, x.to(device, torch.bfloat16), kept.ops(ops)).float().cpu()
            truth = exact.run(1, x, exact.ops(ops))
            worst = max(worst, ((ours - truth).norm() / truth.norm()).item())
        finding("fp8.relative_error_vs_dequantized_f32", worst)


def fp8_over_bound(got: torch.Tensor, x: torch.Tensor, weight, dtype: torch.dtype) -> float:
    """The largest |got - emulation| over the bound the CPU test holds the kernel to (tests/support/tolerance.py)."""
    from tests.support.tolerance import fp8_matmul_bound

    expected, bound = fp8_matmul_bound(x, weight, dtype)
    return ((got.float() - expected).abs() / bound.clamp(min=1e-30)).max().item()


def check_fp8_kernel(device: torch.device, rehearse: bool) -> None:
    """The Triton kernel alone, whatever `gemm` picked: against the emulation at a decode step, a
    ragged batch and a prefill, and its time against cuBLAS's bf16 matmul of the same shape."""
    from tests.support.tolerance import fp8_magnitude

    try:
        from cakemp.model.weights import fp8_gemm
    except ImportError as e:
        finding("fp8.triton", f"not importable: {e}")
        return
    N, K = (256, 384) if rehearse else (4096, 4096)
    generator = torch.Generator().manual_seed(2)
    stored = (torch.randn(N, K, generator=generator) * 64).to(torch.float8_e4m3fn)
    weight = fp8.Fp8Weight.create(stored.to(device), (torch.rand(N // 128, K // 128, generator=generator) / 64
                                                      + 1e-3).to(device))
    over, speed = {}, {}
    for rows in (1, 7) if rehearse else (1, 7, 512):
        x = torch.randn(rows, K, generator=generator).to(device, torch.bfloat16)
        over[rows] = round(fp8_over_bound(fp8_gemm.matmul(x, weight.weight, weight.scale_inv), x, weight,
                                          torch.bfloat16), 4)
        if device.type == "cuda":
            plain = stored.to(device, torch.bfloat16)
            speed[rows] = round(timed(lambda: F.linear(x, plain), device) /
                                timed(lambda: fp8_gemm.matmul(x, weight.weight, weight.scale_inv), device), 3)
    finding("fp8.triton_vs_emulation_over_bound", over)
    # With f32 activations (no rounding of the output), the kernel's distance from the emulation in units
    # of the products' summed magnitude, at the unit of the accumulator that explains it: an f32 one
    # errs by a few 2^-24 (its bound above allows K of them); an accumulator of 13 mantissa bits, which
    # Hopper's FP8 MMA is reported to keep, by up to ~2^-13 (the kernel promotes to f32 every 128 products).
    x = torch.randn(7, K, generator=generator).to(device)
    distance = (fp8_gemm.matmul(x, weight.weight, weight.scale_inv) - fp8.emulated_matmul(x, weight)).abs()
    relative = (distance / fp8_magnitude(x, weight)).max().item()
    finding("fp8.triton_f32_error_over_magnitude", {"relative": relative, "in_2^-24": round(relative * 2**24, 1),
                                                     "in_2^-13": round(relative * 2**13, 3)})
    finding("fp8.triton_speedup_over_bf16_linear", speed or "rehearsal: not timed")


# --- 5. decode against the bandwidth floor -------------------------------------------------

def llama8b_config(layers: int, rehearse: bool):
    from cakemp.checkpoint.config import ModelConfig

    hidden, inter, heads, kv = (512, 1792, 4, 1) if rehearse else (4096, 14336, 32, 8)
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "max_position_embeddings": 8192, "rope_theta": 500000.0,
    })


def random_blocks(config, device, dtype, as_fp8: bool):
    from cakemp.model.block import DecoderBlock

    generator = torch.Generator(device=device).manual_seed(0)
    blocks = {}
    for i in range(config.num_hidden_layers):
        weights = {}
        for name, shape in DecoderBlock.weight_shapes(config, i, lambda name: True).items():
            if name in ("b_qkv", "b_o", "q_norm", "k_norm"):
                continue
            w = torch.randn(shape, generator=generator, device=device) / math.sqrt(shape[-1])
            if as_fp8 and len(shape) == 2:
                scale = w.view(shape[0] // 128, 128, shape[1] // 128, 128).abs().amax(dim=(1, 3)) / fp8.FP8_MAX
                stored = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
                weights[name] = fp8.Fp8Weight.create(stored, scale)
            else:
                weights[name] = w.to(dtype) if len(shape) == 2 else (1 + w / 10).to(dtype)
        blocks[config.layer_name(i)] = DecoderBlock(config, i, weights)
    return blocks


def bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy of 2 GiB, counting bytes read and written (best of 5)."""
    x = torch.empty(2**31 // 4 if device.type == "cuda" else 2**27 // 4, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / timed(lambda: y.copy_(x), device, repeats=5)


def check_decode(device: torch.device, rehearse: bool) -> None:
    from cakemp.compute.runner import BlockRunner

    layers, context = 8, 1024
    config = llama8b_config(layers, rehearse)
    rate = bandwidth(device)
    finding("decode.copy_bandwidth_gb_s", round(rate / 1e9, 1))
    variants = [("bf16", False)] + ([("fp8", True)] if fp8.gemm(device, torch.bfloat16) else [])
    per_layer_ms = {}
    for name, as_fp8 in variants:
        blocks = random_blocks(config, device, torch.bfloat16, as_fp8)
        runner = BlockRunner(config, blocks, device, torch.bfloat16, kv_budget_bytes=None, max_context=8192)
        ops = lambda position: [(layer, position, i) for i, layer in enumerate(blocks)]  # noqa: E731
        runner.run(1, torch.randn(1, context, config.hidden_size, device=device, dtype=torch.bfloat16), runner.ops(ops(0)))
        x = torch.randn(1, 1, config.hidden_size, device=device, dtype=torch.bfloat16)
        times = []
        for step in range(30):
            times.append(1e3 * timed(lambda: runner.run(1, x, runner.ops(ops(context + step))), device))
        per_layer = sorted(times)[len(times) // 2] / layers
        block = next(iter(blocks.values()))
        weight_bytes = sum(w.nbytes for w in (block.w_qkv, block.w_o, block.mlp.w_gate_up, block.mlp.w_down))
        per_layer_ms[name] = per_layer
        floor_ms = weight_bytes / rate * 1e3
        finding(f"decode.{name}", {
            "per_layer_ms_median": round(per_layer, 4), "weight_mib": round(weight_bytes / 2**20, 1),
            "floor_ms": round(floor_ms, 4), "ratio_to_floor": round(per_layer / floor_ms, 2),
        })
        runner = blocks = None  # freed before empty_cache (not `del`: the lambdas above close over them)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "fp8" in per_layer_ms:
        finding("decode.fp8_over_bf16_per_layer", round(per_layer_ms["fp8"] / per_layer_ms["bf16"], 3))


# --- 6. a node with --gpus all ------------------------------------------------------------

def maps_cuda(pid: int) -> bool:
    """Whether process `pid` has the CUDA driver library mapped (what creating a context does)."""
    try:
        return "libcuda.so" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


async def check_node(device: torch.device, rehearse: bool) -> None:
    from cakemp.compute.runner import BlockRunner
    from cakemp.demo.local_node import LocalNode, free_port
    from cakemp.demo.synthetic import demo_checkpoint
    from cakemp.errors import RemoteWorkerError
    from cakemp.master.client import WorkerClient

    model = demo_checkpoint()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what earlier sections cached here is the node's to budget
    layers = [f"model.layers.{i}" for i in range(6)]
    with tempfile.TemporaryDirectory() as tmp:
        topology = Path(tmp) / "topology.yml"
        topology.write_text("gpu-check:\n  host: 127.0.0.1:10128\n  layers:\n    - model.layers.0-5\n")
        node = LocalNode(name="gpu-check", model_dir=model, topology=topology, port=free_port(),
                         gpus="cpu" if rehearse else "all", dtype="bf16", log_path=Path(tmp) / "node.log")
        node.start()
        try:
            info = await node.wait_ready(timeout=120)
            finding("node.worker_info", f"device {info.device} {info.device_idx}, dtype {info.dtype}")
            front = node._process.pid
            children = [int(p) for p in Path(f"/proc/{front}/task/{front}/children").read_text().split()]
            # The device processes, and multiprocessing's resource tracker, which must hold no context either.
            finding("node.cuda_context", {"front": maps_cuda(front), "children": {
                Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[-60:]: maps_cuda(p) for p in children}})
            finding("node.nvidia_smi_compute_apps", shell("nvidia-smi --query-compute-apps=pid,used_memory "
                                                          "--format=csv,noheader"))
            runner = BlockRunner.load(model, layers, device, torch.bfloat16)
            hidden = runner.config.hidden_size
            generator = torch.Generator().manual_seed(0)

            async def matches(client, session: int, position: int, T: int) -> float:
                x = torch.randn(1, T, hidden, generator=generator).to(torch.bfloat16)
                ops = [(layer, position, i) for i, layer in enumerate(layers)]
                remote = tensors.from_raw(await client.batch(tensors.to_raw(x, DType.BF16), ops)).float()
                local = runner.run(session, x.to(device), runner.ops(ops)).float().cpu()
                return (remote - local).abs().max().item()

            port = int(node.address.rsplit(":", 1)[1])
            async with await WorkerClient.connect("127.0.0.1", port) as client:
                await client.hello()
                finding("node.max_abs_diff_vs_in_process", max([await matches(client, 1, 0, 64),
                                                                await matches(client, 1, 64, 1)]))
                if rehearse:
                    finding("node.oom", "skipped (rehearsal)")
                    return
                hog = take_gpu_memory()
                # The device process holds its KV pools from its start (its decode graphs read them), and
                # some memory cached: new sessions' long prompts need activations past what it has cached.
                long = torch.randn(1, 2048, hidden, generator=generator).to(torch.bfloat16)
                others, outcome = [], "every session answered: the requests found memory (not an OOM test)"
                try:
                    for session in range(128):
                        other = await WorkerClient.connect("127.0.0.1", port)
                        others.append(other)
                        await other.hello()
                        try:
                            await other.batch(tensors.to_raw(long, DType.BF16), [(layer, 0, i) for i, layer in enumerate(layers)])
                        except RemoteWorkerError as e:
                            outcome = f"session {session}: WorkerError: {e}"
                            break
                    finding("node.oom_request", outcome)
                    finding("node.oom_first_session_still_matches", await matches(client, 1, 65, 1))
                finally:
                    for other in others:
                        await other.close()
                    del hog
                    torch.cuda.empty_cache()
            async with await WorkerClient.connect("127.0.0.1", port) as client:
                await client.hello()
                finding("node.after_oom_max_abs_diff", max([await matches(client, 2, 0, 64),
                                                            await matches(client, 2, 64, 1)]))
        finally:
            finding("node.exit_status", node.stop())
            log = (Path(tmp) / "node.log").read_text(errors="replace")
            errors = [line[:300] for line in log.splitlines() if re.search(r"error|Traceback", line)]
            finding("node.log_errors", errors[:10])


def take_gpu_memory() -> list[torch.Tensor]:
    """All of the GPU's free memory but a few MiB, in blocks (released when the list is dropped)."""
    hog = []
    for size in (1 << 30, 64 << 20, 4 << 20):
        while True:
            try:
                hog.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    finding("node.free_mib_left_for_oom", round(torch.cuda.mem_get_info()[0] / 2**20, 1))
    return hog


# --- 7. 4-bit weights kept int4 ----------------------------------------------------------

def int4_checkpoints(tmp: Path, rehearse: bool) -> dict[str, Path]:
    """One Llama-3-8B-shaped layer (rehearsal: a small one) as GPTQ, MLX and GGUF checkpoints of random 4-bit codes."""
    from tests.support.checkpoints import make_checkpoint  # transformers: only these sections need it
    from tests.support.gguf_files import GgufSpec, write_gguf
    from tests.support.int4_checkpoints import random_gptq, random_mlx

    hidden, inter, heads, kv = (512, 1792, 4, 1) if rehearse else (4096, 14336, 32, 8)
    plain = make_checkpoint(tmp / "plain", "llama", dtype=torch.bfloat16, hidden_size=hidden, intermediate_size=inter,
                            num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=1, head_dim=128)
    spec = GgufSpec("llama", hidden=hidden, ffn=inter, layers=1, heads=heads, kv_heads=kv,
                    types={"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_0",
                           "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_1"})
    paths = {"gptq": random_gptq(tmp / "gptq", plain, 128), "mlx": random_mlx(tmp / "mlx", plain, 128)}
    try:
        paths["gguf"] = write_gguf(tmp / "llama.gguf", spec)
    except ImportError as e:  # gguf-py writes the file: a machine without it checks the other two
        finding("int4.gguf", f"skipped: {e}")
    return paths


def load_layer(path: Path, device: torch.device, keep_int4: bool):
    """(a BlockRunner of the checkpoint's one layer, its weights kept int4 or dequantized to bf16 as
    `keep_int4` says, on any device (the CPU's int4 kernel in a rehearsal); the same layer's runner
    whose decode steps are graphs (compute/decode_graph.py); the bytes the fit check counts)."""
    from cakemp.checkpoint.config import ModelConfig
    from cakemp.compute.loading import LoadPlan
    from cakemp.compute.runner import BlockRunner
    from cakemp.model.weights.readers import open_checkpoint

    config = ModelConfig.from_dir(path)
    checkpoint = open_checkpoint(path, config)
    plan = LoadPlan.of(config, checkpoint, ["model.layers.0"])
    kernels = frozenset({"int4"}) if keep_int4 else frozenset()
    weights = plan.read(checkpoint, device, torch.bfloat16, None, kernels)
    blocks = {layer: plan.kinds[layer](config, 0, {key: weights[layer, key] for key in plan.groups[layer]})
              for layer in plan.layers}
    counted = plan.nbytes(checkpoint, torch.bfloat16, kernels=kernels)
    return (BlockRunner(config, blocks, device, torch.bfloat16, kv_budget_bytes=None, max_context=4096),
            BlockRunner(config, blocks, device, torch.bfloat16, kv_budget_bytes=None, max_context=4096, graph_batch=1),
            counted)


def held_bytes(runner) -> int:
    block = runner.blocks[0]
    return sum(w.nbytes for w in (block.w_qkv, block.w_o, block.mlp.w_gate_up, block.mlp.w_down))


def decode_ms(runner, device: torch.device, steps: int) -> float:
    """Median time of one decode step of the layer after a 64-token prefill."""
    hidden = runner.config.hidden_size
    runner.run(7, torch.randn(1, 64, hidden, device=device, dtype=torch.bfloat16), runner.ops([("model.layers.0", 0, 0)]))
    x = torch.randn(1, 1, hidden, device=device, dtype=torch.bfloat16)
    times = [1e3 * timed(lambda step=step: runner.run(7, x, runner.ops([("model.layers.0", 64 + step, 0)])), device)
             for step in range(steps)]
    return sorted(times)[len(times) // 2]


def check_int4(device: torch.device, rehearse: bool) -> None:
    from cakemp.compute.runner import BlockRunner
    from cakemp.model.weights import int4

    finding("int4.kernel_works", int4.kernel_works(device))
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in int4_checkpoints(Path(tmp), rehearse).items():
            if device.type == "cuda":
                loaded = BlockRunner.load(path, ["model.layers.0"], device, torch.bfloat16)
                finding(f"int4.{name}.runner_load_keeps_int4", isinstance(loaded.blocks[0].w_qkv, int4.Int4Weight))
                loaded = None
            kept, kept_graphed, kept_counted = load_layer(path, device, keep_int4=True)
            plain, plain_graphed, plain_counted = load_layer(path, device, keep_int4=False)
            generator = torch.Generator().manual_seed(0)
            worst = 0.0
            for position, T in ((0, 64), (64, 1)):
                x = torch.randn(1, T, kept.config.hidden_size, generator=generator).to(device, torch.bfloat16)
                ops = [("model.layers.0", position, 0)]
                ours, theirs = (r.run(1, x, r.ops(ops)).float() for r in (kept, plain))
                worst = max(worst, ((ours - theirs).norm() / theirs.norm()).item())
            steps = 5 if rehearse else 30
            kept_ms, plain_ms = decode_ms(kept, device, steps), decode_ms(plain, device, steps)
            kept_graph_ms, plain_graph_ms = decode_ms(kept_graphed, device, steps), decode_ms(plain_graphed, device, steps)
            finding(f"int4.{name}", {
                "kept_int4": {key: isinstance(w, int4.Int4Weight) for key, w in
                              (("w_qkv", kept.blocks[0].w_qkv), ("w_down", kept.blocks[0].mlp.w_down))},
                "int4_mib_held": round(held_bytes(kept) / 2**20, 1), "int4_mib_counted": round(kept_counted / 2**20, 1),
                "bf16_mib_held": round(held_bytes(plain) / 2**20, 1), "bf16_mib_counted": round(plain_counted / 2**20, 1),
                "relative_error_vs_dequantized_bf16": worst,
                "decode_ms_int4": round(kept_ms, 4), "decode_ms_bf16": round(plain_ms, 4),
                "int4_time_ratio_to_bf16": round(kept_ms / plain_ms, 2),
                "graphed_decode_ms_int4": round(kept_graph_ms, 4), "graphed_decode_ms_bf16": round(plain_graph_ms, 4),
                "graphed_int4_time_ratio_to_bf16": round(kept_graph_ms / plain_graph_ms, 2),
            })
            kept = plain = kept_graphed = plain_graphed = None
            if device.type == "cuda":
                torch.cuda.empty_cache()


# --- 10. offloaded MoE experts -------------------------------------------------------------

def check_experts(device: torch.device, rehearse: bool) -> None:
    check_expert_formats(device)
    check_expert_offload(device, rehearse)



def check_expert_formats(device: torch.device) -> None:
    from cakemp.compute.runner import BlockRunner
    from tests.support.checkpoints import make_checkpoint
    from tests.support.int4_checkpoints import random_gptq

    layers = ["model.layers.1", "model.layers.2"]
    with tempfile.TemporaryDirectory() as tmp:
        cases = {"qwen3_5_moe_plain": make_checkpoint(Path(tmp) / "plain", "qwen3_5_moe"),
                 "qwen3_moe_gptq4": random_gptq(Path(tmp) / "gptq", make_checkpoint(Path(tmp) / "q", "qwen3_moe"), 32)}
        for name, path in cases.items():
            prefix = "model.language_model.layers" if "qwen3_5" in name else "model.layers"
            named = [layer.replace("model.layers", prefix) for layer in layers]
            for keep in (False, True):
                runners = {cache: BlockRunner.load(path, named, device, torch.bfloat16, keep_int4=keep,
                                                   expert_cache_bytes=cache) for cache in (None, 1 << 30, 1024)}
                generator = torch.Generator().manual_seed(0)
                outputs = {cache: [] for cache in runners}
                for position, T in ((0, 7), (7, 1), (8, 1)):
                    x = torch.randn(1, T, runners[None].config.hidden_size, generator=generator).to(device, torch.bfloat16)
                    for cache, runner in runners.items():
                        ops = runner.ops([(layer, position, i) for i, layer in enumerate(named)])
                        outputs[cache].append(runner.run(0, x, ops).float())
                worst = {cache: max(((a - b).norm() / b.norm()).item() for a, b in zip(got, outputs[None]))
                         for cache, got in outputs.items() if cache is not None}
                stats = runners[1 << 30].expert_cache
                held = [weight for pair, _ in stats._held.values() for weight in pair]
                finding(f"experts.{name}.{'int4' if keep else 'dequantized'}", {
                    "relative_difference_to_resident": worst, "hits": stats.hits, "misses": stats.misses,
                    "held_mib": round(stats.resident_bytes / 2**20, 2),
                    "held_as": sorted({type(weight).__name__ for weight in held}),
                    "transfer": type(runners[1 << 30].block(named[0]).mlp.experts.transfer).__name__})
                runners = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()


OFFLOAD_PROMPT = 32


def check_expert_offload(device: torch.device, rehearse: bool) -> None:
    """A Qwen3-MoE of 64 experts, top-4, bf16, its experts offloaded into a cache of a quarter of them
    against all resident: outputs, GPU bytes held, decode speed, and (on a GPU) the same offload with
    the copies on the compute stream instead of the side stream, to tell whether they overlapped."""
    from bench.expert_offload import SHAPE
    from tests.support.checkpoints import make_checkpoint
    from tests.support.tolerance import half_bound, rel_error

    shape = SHAPE if rehearse else SHAPE | dict(hidden_size=1024, num_attention_heads=16, moe_intermediate_size=512)
    layers = [f"model.layers.{i}" for i in range(shape["num_hidden_layers"])]
    expert = 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * 2  # bf16 bytes
    quarter = len(layers) * shape["num_experts"] // 4 * expert
    runs = {"resident": (None, True), "offload_quarter": (quarter, True)}
    if device.type == "cuda":
        runs["offload_quarter_compute_stream"] = (quarter, False)
    finding("experts.offload64.shape", f"{len(layers)} Qwen3-MoE layers, hidden {shape['hidden_size']}, 64 experts "
            f"of {shape['moe_intermediate_size']}, top-4, bf16 ({expert / 2**20:.1f} MiB an expert); cache "
            f"{quarter / 2**20:.0f} MiB, a quarter of the experts")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), "qwen3_moe", dtype=torch.bfloat16, **shape)
        results = {name: offload_run(path, layers, device, cache, side, 8 if rehearse else 32)
                   for name, (cache, side) in runs.items()}
    outputs = {name: result.pop("outputs") for name, result in results.items()}
    base = results["resident"]
    for name, result in results.items():
        difference = max(rel_error(a, b) for a, b in zip(outputs[name], outputs["resident"], strict=True))
        result["max_relative_difference"] = difference
        result["within_bound"] = difference <= half_bound(torch.bfloat16)
        result["held_ratio"] = round(result["held_mib"] / base["held_mib"], 3)
        result["speed_ratio"] = {inputs: round(base["step_ms"][inputs] / ms, 3) for inputs, ms in result["step_ms"].items()}
        finding(f"experts.offload64.{name}", result)
    if "offload_quarter_compute_stream" in results:
        one, side = results["offload_quarter_compute_stream"]["step_ms"], results["offload_quarter"]["step_ms"]
        finding("experts.offload64.side_stream_speedup", {inputs: round(one[inputs] / side[inputs], 3) for inputs in side})


def offload_run(path: Path, layers: list[str], device: torch.device, cache: int | None, side_stream: bool,
                steps: int) -> dict:
    """One runner's outputs (a prompt, then `steps` decode steps of repeating inputs, session 0, and of
    varied ones, session 1), its median decode step per kind, the GPU bytes it holds and its cache's counts."""
    from cakemp.compute.runner import BlockRunner

    if device.type == "cuda":
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    runner = BlockRunner.load(path, layers, device, torch.bfloat16, expert_cache_bytes=cache)
    transfer = runner.block(layers[0]).mlp.experts.transfer if cache is not None else None
    if not side_stream:
        transfer.stream = None  # one StagedCopies serves every layer of the device
    generator = torch.Generator().manual_seed(0)
    hidden = runner.config.hidden_size
    outputs, step_ms = [], {}

    def run(session: int, position: int, x: torch.Tensor) -> None:
        ops = runner.ops([(layer, position, i) for i, layer in enumerate(layers)])
        outputs.append(runner.run(session, x.to(device, torch.bfloat16), ops).float().cpu())

    cycle = [torch.randn(1, 1, hidden, generator=generator) for _ in range(4)]
    for session, inputs in enumerate(("repeating", "varied")):
        run(session, 0, torch.randn(1, OFFLOAD_PROMPT, hidden, generator=generator))
        times = []
        for step in range(steps):
            x = cycle[step % 4] if inputs == "repeating" else torch.randn(1, 1, hidden, generator=generator)
            times.append(1e3 * timed(lambda x=x, step=step: run(session, OFFLOAD_PROMPT + step, x), device))
        step_ms[inputs] = round(sorted(times)[len(times) // 2], 3)
    stats = runner.expert_cache
    held = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else \
        runner.weight_bytes + (stats.resident_bytes if stats else 0)
    result = {"outputs": outputs, "held_mib": round(held / 2**20, 1), "step_ms": step_ms,
              "tokens_per_second": {inputs: round(1e3 / ms, 1) for inputs, ms in step_ms.items()}}
    if stats is not None:
        result |= {"hit_rate": round(stats.hits / (stats.hits + stats.misses), 3),
                   "cache_mib": round(stats.resident_bytes / 2**20, 1), "transfer": type(transfer).__name__}
    if hasattr(transfer, "pool"):
        result |= {"pinned_pool_waits": transfer.pool.waits, "pinned_pool_allocations": transfer.pool.allocations}
    return result


# --- 8. dequantization on the GPU against the CPU -----------------------------------------

def dequantize_cases(rehearse: bool):
    """(name, a function of the device giving the f32 dequantized weight), for GPTQ, MLX and every ggml type."""
    import numpy as np

    from cakemp.checkpoint.quantization import Gptq
    from cakemp.model.weights import ggml, gptq, mlx
    from tests.support.gguf_files import RANDOM_BLOCKS, random_blocks

    rows, cols = (64, 512) if rehearse else (4096, 4096)
    generator = torch.Generator().manual_seed(0)

    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int64).to(torch.int32)

    for bits, act in ((4, False), (3, True), (8, False)):
        spec = Gptq(bits, 128, act, False, True)
        stored = (words(-(-cols * bits // 32), rows), words(cols // 128, -(-rows * bits // 32)),
                  (torch.rand(cols // 128, rows, generator=generator) / 64).half(),
                  (torch.randperm(cols, generator=generator) // 128 if act else torch.arange(cols) // 128).to(torch.int32))
        yield f"gptq_{bits}bit{'_act_order' if act else ''}", \
            lambda device, stored=stored, spec=spec: gptq.dequantize(*(t.to(device) for t in stored), spec)
    for bits in (4, 3, 8):
        stored = (words(rows, cols * bits // 32).view(torch.uint32),
                  (torch.rand(rows, cols // 64, generator=generator) / 64).bfloat16(),
                  torch.randn(rows, cols // 64, generator=generator).bfloat16())
        yield f"mlx_{bits}bit", lambda device, stored=stored, bits=bits: mlx.dequantize(
            *(t.to(device) for t in stored), bits, 64)
    rng = np.random.default_rng(0)

    def stored_bytes(kind: str) -> torch.Tensor:
        if kind in RANDOM_BLOCKS:
            raw = random_blocks(rng, kind, (rows, cols))
        else:
            import gguf  # gguf-py quantizes these (a machine without it records the ImportError per type)

            values = (0.05 * rng.standard_normal((rows, cols))).astype(np.float32)
            raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
        return torch.from_numpy(raw.view(np.uint8).reshape(-1).copy())

    for kind in ggml.DEQUANTIZERS:
        raw = functools.cache(functools.partial(stored_bytes, kind))  # drawn once, for both devices
        yield f"ggml_{kind}", lambda device, raw=raw, kind=kind: ggml.dequantize(raw().to(device), kind, (rows, cols))


def check_dequantize(device: torch.device, rehearse: bool) -> None:
    differences = {}
    for name, dequantize in dequantize_cases(rehearse):
        try:
            here, cpu = dequantize(device).cpu(), dequantize(torch.device("cpu"))
            differences[name] = "bit-equal" if torch.equal(here, cpu) else (here - cpu).abs().max().item()
        except Exception as e:  # one case's failure is its finding; the others still run
            differences[name] = f"error: {type(e).__name__}: {e}"[:200]
    finding("dequantize.max_abs_difference_vs_cpu", differences)


# --- 9. image components through a node ---------------------------------------------------

async def check_image(device: torch.device, rehearse: bool) -> None:
    from cakemp.master.client import WorkerClient
    from tests.support.image import LATENT, f32, oracle, pack, token_ids, write_cache
    from tests.support.node import RunningNode, write_topology

    def from_raw(raw) -> torch.Tensor:
        assert raw.dtype == DType.F32, raw.dtype
        return torch.frombuffer(bytearray(raw.data), dtype=torch.float32).view(raw.shape)

    generator = torch.Generator().manual_seed(0)
    ids = [0, 17, 256, 999, 2]
    latents, text = torch.randn(2, *LATENT, generator=generator), torch.randn(2, 77, 32, generator=generator)
    image_latents = latents[:1]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "hf"
        snapshot = write_cache(root)
        topology = write_topology(Path(tmp) / "topology.yml", ["clip", "vae", "unet"])
        node = RunningNode(root, topology, "--gpus", "cpu" if rehearse else "all", "--dtype", "f32",
                           "--model-type", "image-model", "--sd-version", "v1-5", timeout=180)
        try:
            async with await WorkerClient.connect("127.0.0.1", node.port) as client:
                info = await client.hello()
                finding("image.worker_info", f"device {info.device} {info.device_idx}, dtype {info.dtype}")
                served = {
                    "clip": from_raw(await client.single_op("clip", token_ids(ids), 0, 0)),
                    "unet": from_raw(await client.single_op("unet", f32(pack(latents, text, torch.tensor([101.0]))), 0, 0)),
                    "vae": from_raw(await client.single_op("vae", f32(pack(torch.tensor([0.0]), image_latents)), 0, 0)),
                }
        finally:
            node.kill()
            errors = [e for e in node.events() if e.get("level") == "error"]
            finding("image.node_errors", [str(e)[:300] for e in errors[:5]])
        modules = {name: module.to(device) for name, module in oracle(snapshot).items()}
    with torch.no_grad():
        padded = torch.tensor([ids + [ids[-1]] * (77 - len(ids))], device=device)
        here = {"clip": modules["clip"](input_ids=padded).last_hidden_state,
                "unet": modules["unet"](latents.to(device), torch.tensor(101.0, device=device),
                                        encoder_hidden_states=text.to(device)).sample,
                "vae": modules["vae"].decode(image_latents.to(device)).sample}
    finding("image.max_abs_diff_node_vs_in_process", {
        name: (served[name] - here[name].float().cpu()).abs().max().item() if served[name].shape == here[name].shape
        else f"shape {tuple(served[name].shape)} vs {tuple(here[name].shape)}" for name in here})



# --- 11. the node's speed against its layers in-process -------------------------------------

def launch_cpu(fn, device: torch.device) -> float:
    """The CPU seconds this thread spends in fn() before it returns, the GPU's work not waited for (its
    planning and kernel launches, or a replay's): near the step's wall time, a step bound by its Python."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.thread_time()
    fn()
    spent = time.thread_time() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return spent


PROMPT_WARM, PROMPT_TIMED = 2, 5  # node-perf's 512-token prompts: untimed first, then timed (the median)
# node-perf's masters are spread over up to this many processes (bench/masters.py): one process of them
# would set the rate at a GPU node's, and on the GPU's machine cores are left beside the front and device.
MASTER_PROCESSES = max(2, min(8, (os.cpu_count() or 2) // 2))


async def check_node_perf(device: torch.device, rehearse: bool) -> None:
    import transformers

    from bench.step_growth import Cakemp, Transformers
    from cakemp import heap
    from cakemp.compute.runner import BlockRunner

    layers, cached, counts = 4, (64 if rehearse else 512), (1, 8, 32)
    steps, seconds = (5, 2.0) if rehearse else (30, 5.0)
    heap.keep_freed_memory()  # as the node's device does: the in-process side reuses freed memory too
    names = [f"model.layers.{i}" for i in range(layers)]
    with tempfile.TemporaryDirectory() as tmp:
        path, hidden = perf_checkpoint(tmp, layers, rehearse)
        # As the node's device computes them: decode steps replayed as CUDA graphs on a GPU.
        runner = BlockRunner.load(path, names, device, torch.bfloat16, graph_batch=32 if device.type == "cuda" else None,
                                  kv_budget_bytes=in_process_kv_budget(rehearse))
        floor_ms = runner.weight_bytes / bandwidth(device) * 1e3
        finding("node_perf.floor_ms", round(floor_ms, 4))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                                  attn_implementation="sdpa").to(device)
        in_process = {}  # per count: tokens/s in-process
        for n in counts:
            with torch.inference_mode():
                ours = Cakemp(path, n, cached, layers, runner=runner)
                theirs = Transformers(path, n, cached, layers, device, torch.bfloat16, model=model)
                ms = {name: 1e3 * statistics.median(timed(side.step, device) for _ in range(steps))
                      for name, side in (("cakemp", ours), ("transformers", theirs))}
                launch_ms = 1e3 * statistics.median(launch_cpu(ours.step, device) for _ in range(steps))
            in_process[n] = n / ms["cakemp"] * 1e3
            finding(f"node_perf.in_process_{n}", {
                "cakemp_ms": round(ms["cakemp"], 3), "transformers_ms": round(ms["transformers"], 3),
                "cakemp_launch_cpu_ms": round(launch_ms, 3), "launch_over_step": round(launch_ms / ms["cakemp"], 2),
                "cakemp_tok_s": round(in_process[n]), "to_floor": round(ms["cakemp"] / floor_ms, 2),
                "cakemp_over_transformers_tok_s": round(ms["transformers"] / ms["cakemp"], 2)})
        for s in range(max(counts)):
            runner.free_session(s)
        prompt = torch.randn(1, 512, hidden).to(torch.bfloat16)
        ops = runner.ops([(name, 0, i) for i, name in enumerate(names)])
        with torch.inference_mode():
            # Medians of 5 after 2 untimed on each side: a fresh node's first prompts take up to 2x
            # (allocations and pages met for the first time), which the warm in-process runner is past.
            prompt_ms = 1e3 * statistics.median([timed(lambda: runner.run(0, prompt.to(device), ops), device)
                                                 for _ in range(PROMPT_WARM + PROMPT_TIMED)][PROMPT_WARM:])
        model = runner = ours = theirs = None  # their memory is the node's to budget
        if device.type == "cuda":
            torch.cuda.empty_cache()

        node, metrics = perf_node(Path(tmp), path, len(names), rehearse, "node.log")
        node.start()
        try:
            port, pids = await ready(node)
            times = await prompt_times(port, hidden, names)
            node_ms = 1e3 * statistics.median(times[PROMPT_WARM:])
            finding("node_perf.prompt_512", {"node_ms": round(node_ms, 2), "in_process_ms": round(prompt_ms, 2),
                                              "ratio": round(node_ms / prompt_ms, 2),
                                              "node_first_ms": [round(1e3 * t, 2) for t in times[:PROMPT_WARM]]})
            node_rate = node_rates(port, pids, metrics, counts, hidden, cached, names, seconds, in_process, "node_perf.node")
        finally:
            finding("node_perf.exit_status", node.stop())
            # How its decode rows attended: in place (the paged kernel's start-up trial passed) or gathered, and why.
            log = (Path(tmp) / "node.log").read_text(errors="replace")
            finding("node_perf.decode_attention", [line[:300] for line in log.splitlines() if "decode attention" in line])
        polled = await polling_node(Path(tmp), path, hidden, cached, names, seconds, in_process, rehearse)
        finding("node_perf.polling_over_node_1", round(polled / node_rate[1], 2))
        n = max(counts)
        floor = await front_floor(Path(tmp), n, hidden, cached, names, n / in_process[n], seconds)  # its step's seconds
        finding(f"node_perf.front_floor_{n}", floor | {"over_in_process": round(floor["tok_s"] / in_process[n], 2),
                                                       "node_over_floor": round(node_rate[n] / floor["tok_s"], 2)})


def node_rates(port: int, pids: dict[str, int], metrics: int, counts: Sequence[int], hidden: int, cached: int,
               names: list[str], seconds: float, in_process: dict[int, float], key: str) -> dict[int, float]:
    """Each count of masters decoding through the node at `port` (its processes `pids`, its /metrics at `metrics`)
    for `seconds`, after an untimed second: a finding `{key}_{n}` of each (below), and the tokens/s of each."""
    from bench.batching import batch_size_totals
    from bench.masters import Masters
    from bench.request_cost import thread_seconds

    rates = {}
    for n in counts:
        masters = Masters(port, n, hidden, cached, names, MASTER_PROCESSES)
        try:
            masters.window(1.0)  # untimed: the device captures the graphs of this batch's shapes meanwhile
            ran_before, stepped_before = thread_seconds(pids), batch_size_totals(metrics)
            window = masters.window(seconds)
            ran, stepped = thread_seconds(pids), batch_size_totals(metrics)
        finally:
            masters.close()
        ran.subtract(ran_before)
        requests, steps = (after - before for after, before in zip(stepped, stepped_before, strict=True))
        ran["masters (process)"] = window.cpu_s
        rate = rates[n] = window.done / window.wall_s
        # Which process sets the rate: each one's CPU per token, and its share of the wall time
        # (near 1.0, that process is saturated; the masters' spread over MASTER_PROCESSES).
        finding(f"{key}_{n}", {
            "tok_s": round(rate), "over_in_process": round(rate / in_process[n], 2),
            # A step of the n sessions through the node, less the same step in-process.
            "step_ms_over_in_process": round(1e3 * n * (1 / rate - 1 / in_process[n]), 3),
            "cpu_us_per_token": {name: round(ran[f"{name} (process)"] / window.done * 1e6) for name in [*pids, "masters"]},
            "busy": {name: round(ran[f"{name} (process)"] / window.wall_s, 2) for name in [*pids, "masters"]},
            "master_processes": masters.processes,
            # Below n: the sessions came back too far apart for one step, which split them (device/scheduler.py).
            "requests_per_step": round(requests / steps, 1) if steps else None})
    return rates


async def polling_node(workdir: Path, path: Path, hidden: int, cached: int, names: list[str], seconds: float,
                 in_process: dict[int, float], rehearse: bool) -> float:
    """One session through a node whose device, owed its next request, looks at its sockets for 1 ms before it
    sleeps (`--device-poll-ms 1`, for machines with cores to spare): its tokens/s (finding
    `node_perf.node_polling_1`), what a device's wake-up costs a lone session's decode beside the node above."""
    node, metrics = perf_node(workdir, path, len(names), rehearse, "polling.log", "--device-poll-ms", "1")
    node.start()
    try:
        port, pids = await ready(node)
        return node_rates(port, pids, metrics, (1,), hidden, cached, names, seconds, in_process, "node_perf.node_polling")[1]
    finally:
        node.stop()


def perf_node(workdir: Path, path: Path, layers: int, rehearse: bool, log: str, *extra: str):
    """(a `cakemp run --gpus all --dtype bf16` of the perf checkpoint's `layers` layers, not started yet, logging
    to `workdir`/`log`, with `extra` options; the port of its /metrics, where the requests its device ran a step are)."""
    from cakemp.demo.local_node import LocalNode, free_port

    topology = workdir / "topology.yml"
    topology.write_text(f"perf:\n  host: 127.0.0.1:10128\n  layers:\n    - model.layers.0-{layers - 1}\n")
    metrics = free_port()
    return LocalNode(name="perf", model_dir=path, topology=topology, port=free_port(), gpus="cpu" if rehearse else "all",
                     dtype="bf16", log_path=workdir / log, metrics_port=metrics, extra=extra), metrics


async def ready(node) -> tuple[int, dict[str, int]]:
    """Once the started `node` answers: its port, and the pids of its front and its device."""
    from bench.request_cost import device_pid

    await node.wait_ready(timeout=300)
    return int(node.address.rsplit(":", 1)[1]), {"front": node._process.pid, "device": device_pid(node._process.pid)}


async def prompt_times(port: int, hidden: int, names: list[str]) -> list[float]:
    """The seconds each of PROMPT_WARM + PROMPT_TIMED 512-token bf16 prompts through `names` took from the master
    at `port` to its answer (a new prompt each time, after a Goodbye: the same one again would be prefix reuse's)."""
    from cakemp.master.client import WorkerClient

    times = []
    async with await WorkerClient.connect("127.0.0.1", port) as client:
        await client.hello()
        for _ in range(PROMPT_WARM + PROMPT_TIMED):
            await client.goodbye()
            x = tensors.to_raw(torch.randn(1, 512, hidden), DType.BF16)
            start = time.perf_counter()
            await client.batch(x, [(name, 0, i) for i, name in enumerate(names)])
            times.append(time.perf_counter() - start)
    return times


async def front_floor(workdir: Path, count: int, hidden: int, cached: int, names: list[str], step_s: float,
                      seconds: float) -> dict[str, object]:
    """bench/front_floor.py's floor front (TCP, the Cake codec and ZeroMQ, nothing else of a front), its device
    echoing each step after `step_s` of busy work: `count` masters through it (the tokens/s, and the floor front's
    CPU per token and busy share: near 1.0, one front process of this design relays no more on this CPU), then a
    512-token prompt's round trip less the echo's step, what carrying its activation there and back costs."""
    from bench.front_floor import Floor
    from bench.masters import Masters
    from bench.request_cost import thread_seconds

    floor = Floor(workdir, step_s)
    try:
        masters = Masters(floor.port, count, hidden, cached, names, MASTER_PROCESSES)
        try:
            masters.window(1.0)  # untimed
            before = thread_seconds(floor.pids)
            window = masters.window(seconds)
            ran = thread_seconds(floor.pids)
        finally:
            masters.close()
        times = await prompt_times(floor.port, hidden, names)
    finally:
        floor.stop()
    ran.subtract(before)
    front = ran["front (process)"]
    return {"tok_s": round(window.done / window.wall_s), "echo_step_ms": round(step_s * 1e3, 3),
            "front_cpu_us_per_token": round(front / window.done * 1e6), "front_busy": round(front / window.wall_s, 2),
            "prompt_512_transport_ms": round(1e3 * (statistics.median(times[PROMPT_WARM:]) - step_s), 2)}


# --- 12. the decode step replayed as CUDA graphs ---------------------------------------------

def perf_checkpoint(tmp: str, layers: int, rehearse: bool) -> tuple[Path, int]:
    """A random bf16 Llama of `layers` Llama-3-8B-shaped layers (rehearsal: small ones), and its hidden size."""
    from tests.support.checkpoints import make_checkpoint

    hidden, inter, heads, kv = (512, 1792, 4, 1) if rehearse else (4096, 14336, 32, 8)
    path = make_checkpoint(tmp, "llama", dtype=torch.bfloat16, num_hidden_layers=layers, vocab_size=128,
                           hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                           num_key_value_heads=kv, max_position_embeddings=4096)
    return path, hidden


def in_process_kv_budget(rehearse: bool) -> int:
    """The KV budget of a runner of sections 11 and 12 (32 sessions of ~550 positions over 4 layers take
    ~0.3 GiB): given, since a GPU's graphed runner holds the whole default budget (what was free) from its
    load, where the node started after it would find no room."""
    return (256 << 20) if rehearse else (4 << 30)


def check_graphs(device: torch.device, rehearse: bool) -> None:
    from bench.blocks import timed
    from cakemp.compute.runner import BlockRunner, Request
    from tests.support.tolerance import half_bound, rel_error

    layers, cached, steps = 4, (64 if rehearse else 512), (5 if rehearse else 30)
    names = [f"model.layers.{i}" for i in range(layers)]
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        path, hidden = perf_checkpoint(tmp, layers, rehearse)
        paged = BlockRunner.load(path, names, device, torch.bfloat16)
        loading = time.perf_counter()
        # A budget of its own: a graphed runner makes its pools at their shares as it loads.
        graphed = BlockRunner.load(path, names, device, torch.bfloat16, graph_batch=32,
                                   kv_budget_bytes=in_process_kv_budget(rehearse))
        finding("graphs.made_at_load", {"load_s": round(time.perf_counter() - loading, 3),
                                        "kv_pool_bytes": graphed.cache.pool_bytes(),
                                        "graphs": sorted((key[1], key[2]) for key in graphed.graphs.made)})
        floor_ms = paged.weight_bytes / bandwidth(device) * 1e3
        ops = lambda position: paged.ops([(name, position, i) for i, name in enumerate(names)])  # noqa: E731
        generator = torch.Generator().manual_seed(0)
        draw = lambda T: torch.randn(1, T, hidden, generator=generator).to(torch.bfloat16).to(device)  # noqa: E731
        for n in (1, 8, 32):
            for runner in (paged, graphed):
                for s in range(32):
                    runner.free_session(s)
            for s in range(n):
                x = draw(cached)
                paged.run(s, x, ops(0))
                graphed.run(s, x, ops(0))
            position, worst, replay_diff = cached, 0.0, 0.0
            made_before = set(graphed.graphs.made)
            captured_s = time.perf_counter()
            for step in range(steps):
                requests = [Request(s, draw(1), ops(position)) for s in range(n)]
                mine, theirs = graphed.run_batch(requests), paged.run_batch(requests)
                if step == 0:
                    captured_s = time.perf_counter() - captured_s
                    (graph,) = [graphed.graphs.made[key] for key in set(graphed.graphs.made) - made_before] or \
                        [g for g in graphed.graphs.made.values() if g.bucket >= n][:1]
                    eager = graph._compute()[:, :n]  # the same buffers, op by op: the replay must equal it
                    replay_diff = (torch.cat(mine, dim=1) - eager).abs().max().item()
                for a, b in zip(mine, theirs, strict=True):
                    worst = max(worst, rel_error(a, b) / half_bound(torch.bfloat16))
                position += 1
            # Timed at one position: each step rewrites the same row (the context stays `position`).
            requests = [Request(s, draw(1), ops(position)) for s in range(n)]
            times = {name: 1e3 * statistics.median(timed(lambda r=runner: r.run_batch(requests), device)
                                                   for _ in range(steps))
                     for name, runner in (("graphed", graphed), ("paged", paged))}
            launched = {name: host_ops(lambda r=runner: r.run_batch(requests)) for name, runner in
                        (("graphed", graphed), ("paged", paged))}
            finding(f"graphs.sessions_{n}", {
                "replay_vs_eager_max_abs": replay_diff, "replay_bit_equal": replay_diff == 0.0,
                "graphed_vs_paged_over_bf16_bound": round(worst, 3),
                "graphed_ms": round(times["graphed"], 3), "paged_ms": round(times["paged"], 3),
                "graphed_over_paged": round(times["graphed"] / times["paged"], 2),
                "graphed_to_floor": round(times["graphed"] / floor_ms, 2),
                "first_step_with_capture_s": round(captured_s, 3),
                "graphs_made": sorted((key[1], key[2]) for key in graphed.graphs.made),
                "host_ops_per_step": launched})


def host_ops(step) -> int:
    """The torch ops `step()` dispatches on the host (on a GPU, outside a graph's replay: each copy and
    kernel among them a launch ahead of it; a rehearsal's replay, its ops re-run on the CPU, counts them too)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.ops


# --- 13. mixed-attention ---------------------------------------------------------------------

def check_mixed_attention(device: torch.device, rehearse: bool) -> None:
    """bench/mixed_attention.py's ways of one attention layer's mixed step, timed here."""
    from bench.mixed_attention import measure

    heads, dtype = ((8, 2, 64), torch.float32) if rehearse else ((H_Q, H_KV, D), torch.bfloat16)
    for spec in ("8+1x32",) if rehearse else ("8+1x128", "32+2x128"):
        figures = measure(spec, 128 if rehearse else 512, heads, device, dtype, reps=3 if rehearse else 20)
        finding(f"mixed-attention.{spec}", {name: round(value, 3) for name, value in figures.items()})
    # Decode rows alone, in place (model/paged_attention.py: split, on a GPU) against over their gathered blocks.
    for spec, context in ((("8", 300),) if rehearse else (("32", 512), ("32", 4096), ("1", 8192))):
        figures = measure(spec, context, heads, device, dtype, reps=3 if rehearse else 20, flex=False)
        finding(f"mixed-attention.decodes.{spec}x{context}", {name: round(value, 3) for name, value in figures.items()})


if __name__ == "__main__":
    main()

