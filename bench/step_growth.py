"""Step growth benchmark: what each extra session adds to one batched decode step, in-process,
cakemp's BlockRunner.run_batch beside transformers' own layers batched, side by side in one run.

    python -m bench.step_growth [--shape tiny|tinyllama] [--counts 1,2,8,32] [--cached 16]
                                [--steps 50] [--rounds 5] [--threads 1] [--layers 2]
                                [--prefix-reuse] [--retired 0] [--unplanned] [--each-planned]

A random Llama checkpoint (tiny: hidden 64, intermediate 192, 4 query heads on 2 kv heads of 16;
tinyllama: TinyLlama-1.1B's layer, hidden 2048, intermediate 5632, 32 query heads on 4 kv heads
of 64; --layers layers, f32) is loaded both ways. For each count of sessions N, each session first runs
a --cached-token prompt, then both compute --steps decode steps of all N sessions at once:

* cakemp: one `run_batch` of N one-token requests per step, the runner loaded as a batching CPU
  device loads it (f32 matrices packed);
* transformers: its LlamaDecoderLayers on x: [N, 1, H] over one DynamicCache of batch N (every
  session at the same length, so no padding: the cheapest batched step transformers has).

With --unplanned, a third side runs beside them: cakemp's with its steps planned (`BlockRunner._plan_step`:
each request checked, its slots reserved) outside the CPU time counted, what a step would cost were its
per-request planning free: an upper bound on what any cheaper planning could save. With
--each-planned, another: cakemp's with every request planned on its own (`BlockRunner._plan`), decodes
too, where a decode whose KV slots hold its row otherwise joins its group with no plan of its own.

With --prefix-reuse, cakemp's runner follows its sessions for prefix reuse under a KV budget, as a
node's device does by default, and --retired sessions have first run a 32-row prompt and said
Goodbye (the retired prefixes a chat server keeps): transformers' side has no such thing, so the
ratio then includes what following the sessions costs. A side without reuse (no-reuse) then runs
beside, and what reuse costs per session and step is printed at each count: the two sides'
difference over the sessions, beside the wall time spent inside prefix reuse's calls (PrefixCache's
begin, finish and finish_rows) per request.

Printed per count: each side's CPU ms per step (process time: steadier than wall on a shared
machine; the median of --rounds windows, the sides taking turns, each first in turn), and the growth per session from
each count to the last in µs, each side's over transformers'. Compute at the tiny
shape is negligible, so its growth is the Python and dispatch cost of a session. From 1 session,
cakemp's growth includes the batched step's fixed cost over one session alone (which reads its
keys as a view of the pool: no table, no gather, no mask); from 2 on, it is a session's own.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers
from transformers import DynamicCache

from bench.pool import REUSE_BUDGET, machine_line
from cakemp.compute.runner import BlockRunner, Request
from tests.support.checkpoints import CACHE_ARGUMENT, make_checkpoint

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4),
}
LAYERS = 2  # the default of --layers
RETIRED_ROWS = 32  # the prompt each --retired session ran


class Cakemp:
    """`sessions` sessions of BlockRunner over the first `layers` layers, each `cached` tokens in; `step`
    decodes one token of each, all in one run_batch."""

    def __init__(self, path, sessions: int, cached: int, layers: int = LAYERS, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, runner: BlockRunner | None = None, prefix_reuse: bool = False,
                 retired: int = 0, unplanned: bool = False, each_planned: bool = False):
        """`unplanned`: each step's requests are planned (checked, their slots reserved) outside the time
        counted, `untimed` counting it apart: what the step costs were planning free. `each_planned`: every
        request is planned on its own, a decode too (as before decodes joined their group without a plan)."""
        self.layers = layers
        self.unplanned, self.untimed = unplanned, 0.0
        self.runner = runner or BlockRunner.load(path, [f"model.layers.{i}" for i in range(layers)], device, dtype,
                                                 prefix_reuse=prefix_reuse,
                                                 kv_budget_bytes=REUSE_BUDGET if prefix_reuse else None)
        self.hidden, self.device, self.dtype = self.runner.config.hidden_size, self.runner.device, self.runner.dtype
        if each_planned:
            self.runner._decode = lambda *request: None
        self.reuse_s, self.requests = 0.0, 0  # time inside prefix reuse's calls; requests stepped
        if prefix_reuse:
            self._time_reuse(self.runner.prefixes)
        self.sessions, self.position = sessions, cached
        for s in range(sessions, sessions + retired):  # a chat's turn each, retired by its Goodbye
            self.runner.run(s, self._x(RETIRED_ROWS), self._ops(0))
            self.runner.clear_session(s)
        for s in range(sessions):
            self.runner.free_session(s)
            self.runner.run(s, self._x(cached), self._ops(0))

    def _time_reuse(self, prefixes) -> None:
        """Count the wall time inside prefix reuse's per-request calls (begin, finish, finish_rows)."""
        for name in ("begin", "finish", "finish_rows"):
            call = getattr(prefixes, name)

            def timed(*args, call=call):
                start = time.perf_counter()
                try:
                    return call(*args)
                finally:
                    self.reuse_s += time.perf_counter() - start

            setattr(prefixes, name, timed)

    def _x(self, T: int) -> torch.Tensor:
        return torch.randn(1, T, self.hidden, device=self.device).to(self.dtype)

    def _ops(self, position: int):
        return self.runner.ops([(f"model.layers.{i}", position, i) for i in range(self.layers)])

    def step(self) -> None:
        ops = self._ops(self.position)
        # Drawn on the host and copied over, as a device receives a step's rows (their bytes stay there).
        host = torch.randn(self.sessions, 1, self.hidden).to(self.dtype)
        x = host.to(self.device)
        # Each session's [1, 1, H] row as the device makes them of a step's message: one unbind; and
        # its bytes, as the device received them.
        rows = x.view(self.sessions, 1, 1, self.hidden).unbind(0)
        data = memoryview(host.view(torch.uint8).numpy()).cast("B")
        row = len(data) // self.sessions
        requests = [Request(s, x_s, ops, data[s * row:(s + 1) * row]) for s, x_s in enumerate(rows)]
        self.requests += len(requests)
        if self.unplanned:
            start = time.process_time()
            groups = self.runner._plan_step(requests, [None] * len(requests))
            self.untimed += time.process_time() - start
            for group in groups.values():
                self.runner._run_group(group, None)
        else:
            self.runner.run_batch(requests)
        self.position += 1


class Transformers:
    """transformers' own decoder layers over the same checkpoint, `sessions` as one batch of a DynamicCache."""

    def __init__(self, path, sessions: int, cached: int, layers: int = LAYERS, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, model=None):
        model = model or transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                                           attn_implementation="sdpa").to(device)
        self.model, self.layers, self.device, self.dtype = model.model, layers, torch.device(device), dtype
        self.hidden = model.config.hidden_size
        self.sessions, self.position = sessions, cached
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            self._forward(self._x(sessions, cached), 0)

    def _x(self, B: int, T: int) -> torch.Tensor:
        return torch.randn(B, T, self.hidden, device=self.device).to(self.dtype)

    def _forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + x.shape[1], device=x.device)[None, :].expand(x.shape[0], -1)
        cos_sin = self.model.rotary_emb(x, position_ids=positions)
        mask = None if x.shape[1] == 1 else transformers.masking_utils.create_causal_mask(
            config=self.model.config, inputs_embeds=x, attention_mask=None, position_ids=positions, layer_idx=0,
            **{CACHE_ARGUMENT: self.cache})
        for layer in self.model.layers[: self.layers]:
            x = layer(x, attention_mask=mask, position_embeddings=cos_sin, position_ids=positions,
                      **{CACHE_ARGUMENT: self.cache})
        return x

    def step(self) -> None:
        self._forward(self._x(self.sessions, 1), self.position)
        self.position += 1


def per_step_ms(side, steps: int) -> float:
    """CPU ms per step of `side` (less what it counted as untimed)."""
    untimed = getattr(side, "untimed", 0.0)
    with torch.inference_mode():
        start = time.process_time()
        for _ in range(steps):
            side.step()
        spent = time.process_time() - start - (getattr(side, "untimed", 0.0) - untimed)
        return spent / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--counts", default="1,2,8,32")
    parser.add_argument("--cached", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--prefix-reuse", action="store_true")
    parser.add_argument("--retired", type=int, default=0)
    parser.add_argument("--unplanned", action="store_true")
    parser.add_argument("--each-planned", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(c) for c in args.counts.split(",")]
    print(machine_line())
    print(f"{args.shape} layers x{args.layers}, f32, {args.cached} cached tokens, {args.threads} thread(s), "
          f"{args.steps} steps a window, median of {args.rounds}" +
          (f"; cakemp with prefix reuse, {args.retired} retired prefixes" if args.prefix_reuse else ""))
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(tmp, "llama", num_hidden_layers=args.layers, vocab_size=64,
                               max_position_embeddings=max(args.cached + args.steps * (args.rounds + 1) + 8, RETIRED_ROWS),
                               **SHAPES[args.shape])
        figures = {}
        for n in counts:
            sides = {"cakemp": Cakemp(path, n, args.cached, args.layers, prefix_reuse=args.prefix_reuse,
                                      retired=args.retired)}
            if args.each_planned:
                sides["each-planned"] = Cakemp(path, n, args.cached, args.layers, prefix_reuse=args.prefix_reuse,
                                               retired=args.retired, each_planned=True)
            if args.unplanned:
                sides["unplanned"] = Cakemp(path, n, args.cached, args.layers, prefix_reuse=args.prefix_reuse,
                                            retired=args.retired, unplanned=True)
            if args.prefix_reuse:
                sides["no-reuse"] = Cakemp(path, n, args.cached, args.layers)
            sides["transformers"] = Transformers(path, n, args.cached, args.layers)
            for side in sides.values():
                per_step_ms(side, 2)  # warm-up
            reuse = sides["cakemp"]
            reuse.reuse_s, reuse.requests = 0.0, 0
            times = {name: [] for name in sides}
            names = list(sides)
            for r in range(args.rounds):  # each side first in turn: none always follows the same other
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(per_step_ms(sides[name], args.steps))
            figures[n] = {name: statistics.median(t) for name, t in times.items()}
            print(f"{n:3d} sessions: " + "   ".join(f"{name} {ms:8.3f} ms/step" for name, ms in figures[n].items()) +
                  (f"   (inside prefix reuse's calls: {reuse.reuse_s / reuse.requests * 1e6:.1f} µs a request)"
                   if args.prefix_reuse else ""))
    last = counts[-1]
    for first in counts[:-1]:
        growth = {name: (figures[last][name] - figures[first][name]) / (last - first) * 1e3 for name in figures[first]}
        print(f"growth per session {first}->{last}: " +
              ", ".join(f"{name} {g:.1f} µs ({g / growth['transformers']:.2f}x)" for name, g in growth.items()))
    if "no-reuse" in figures[last]:
        per_session = {n: (figures[n]["cakemp"] - figures[n]["no-reuse"]) / n * 1e3 for n in counts}
        print("prefix reuse's cost per session and step: " + ", ".join(f"{per_session[n]:.1f} µs at {n}" for n in counts))

if __name__ == "__main__":
    main()
