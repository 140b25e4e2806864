"""A mutation check of the test suite: plausible one-line bugs, each planted in a copy of the tree.

    python tools/mutation.py                      # every mutant against this working tree
    python tools/mutation.py --rev bbf3f9a        # ... against a commit's tree (code and tests)
    python tools/mutation.py --only goodbye-keeps-kv,rms-eps-10x

Each mutant replaces one exact snippet of one file (the snippet must occur exactly once) in a
fresh temporary copy of the tree, then runs only the tests that exercise that code; the mutant
is killed when they fail. The working tree itself is never written. docs/mutation.md records
the score and what each survivor means.

Why hand-written mutants rather than mutmut or cosmic-ray: those generate thousands of
operator swaps and run the suite (or its coverage-selected part) per mutant; with live nodes
at ~5 s each on a 2-core machine, that is hours. A short list of the bugs
a reviewer would worry about (a freed cache that is not freed, a tolerance that hides a wrong
epsilon, a rotary offset dropped, a proof not checked), each with its own small test subset,
runs in ~20 minutes and says exactly what each survivor is.

This lives in tools/, not bench/ (it measures the tests, not the code's speed) and not in
tests/ (it runs pytest itself, many times; it is not part of CI's run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANT_TIMEOUT_S = 600  # a mutant that hangs its tests past this counts as killed (by timeout)


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the tree's root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: test files, node ids, -k expressions


# Test subsets, smallest that exercise each area. Paths missing from a tree (an older commit)
# are dropped; a subset left with no test leaves the mutant alive. A -k applies to every path
# of its subset, so subsets with one are not added to others.
WIRE = ("tests/wire",)
IPC = ("tests/ipc",)
AUTH = ("tests/test_auth.py", "tests/node/test_node.py", "-k", "key or proof or auth")
ROUTER = ("tests/node/test_node.py",)
POOL = ("tests/node/test_node.py", "tests/node/test_node_flags.py")
RUNNER = ("tests/compute", "tests/device/test_service.py")
KV = ("tests/compute/test_kv_cache.py", "tests/compute/test_runner.py", "tests/device/test_service.py",
      "tests/node/test_node_flags.py")
BLOCK = ("tests/model/test_block.py", "tests/compute/test_runner_parity.py", "-k", "f32 or block")
GENERATION = ("tests/master/test_generator.py", "-k", "greedy")
PREFIX = ("tests/compute/test_prefix_cache.py",)
SCHEDULER = ("tests/device/test_scheduler.py", "tests/node/test_batching.py")
PAGED_ATTENTION = ("tests/model/test_paged_attention.py",)
IN_PLACE = ("tests/compute/test_decode_graph.py", "-k", "in_place")
FAIR_SHARE = ("tests/compute/test_fair_share.py",)
SPANS = ("tests/compute/test_batch.py", "tests/compute/test_paged_step.py", "-k",
         "far_apart or grouped or tables_last_block or windows_first_block")
# llama.cpp's own tokenizer is the oracle (skipped without llama-cpp-python: a mutant then survives).
GGUF_TOKENIZER = ("tests/master/test_gguf_tokenizer_llama_cpp.py", "tests/master/test_gguf_tokenizer.py",
                  "tests/master/test_gguf_generator.py")

MUTANTS = (
    # --- ipc codec: a step's items laid out field by field
    Mutant("ipc-items-given-their-neighbours-elements", "cakemp/ipc/codec.py",
           "columns.append([tuple(itertools.islice(elements, count)) for count in counts])",
           "columns.append([tuple(itertools.islice(elements, counts[0])) for count in counts])", IPC),
    Mutant("ipc-items-unchecked-against-the-bytes-left", "cakemp/ipc/codec.py",
           "            if total * item.min_size > header.size - header.at:\n",
           "            if False:\n", IPC),
    # --- wire codec
    Mutant("frame-max-payload-off-by-one", "cakemp/wire/frames.py",
           "if size > max_payload:", "if size >= max_payload:", WIRE),
    Mutant("frame-magic-unchecked", "cakemp/wire/frames.py",
           "if magic != MAGIC:", "if False:", WIRE),
    Mutant("decoder-keeps-consumed-payload", "cakemp/wire/frames.py",
           "            del self._buf[:size]\n", "", WIRE),
    Mutant("u64-little-endian", "cakemp/wire/codec.py",
           '_BIG_ENDIAN = ">"', '_BIG_ENDIAN = "<"', WIRE),
    Mutant("count-bound-unchecked", "cakemp/wire/codec.py",
           'code.line(f"if {n} * {size} > end - pos: "', 'code.line("if False: "', WIRE),
    Mutant("int-run-unchecked", "cakemp/wire/codec.py",
           'code.line(f"if pos + {layout.size} > end: ', 'code.line(f"if False: ', WIRE),
    Mutant("bulk-length-unchecked", "cakemp/wire/codec.py",
           "code.need(size, self.path)", "pass", WIRE),
    Mutant("tensor-byte-count-unchecked", "cakemp/wire/codec.py",
           "if t.data.nbytes != expected:", "if False:", WIRE),
    Mutant("v2-tag-table-is-v1", "cakemp/wire/messages.py",
           "@message(since=Revision.V2)", "@message", WIRE),
    # A layer run read through a layout learnt from another run of as many ops.
    Mutant("learnt-run-names-unchecked", "cakemp/wire/codec.py",
           "if values[0::width] == lengths and values[1::width] == raw:", "if values[0::width] == lengths:", WIRE),
    Mutant("learnt-run-lengths-unchecked", "cakemp/wire/codec.py",
           "if values[0::width] == lengths and values[1::width] == raw:", "if values[1::width] == raw:", WIRE),
    # A request's ops as columns: a decode's one position, and a stage's columns of one length.
    Mutant("ops-position-unchecked", "cakemp/op.py",
           "positions.count(positions[0]) == len(positions)", "True", RUNNER),
    Mutant("stage-columns-length-unchecked", "cakemp/ipc/message.py",
           "if not len(self.layers) == len(self.positions) == len(self.blocks):", "if False:", IPC),
    Mutant("ipc-equal-items-cut-one-short", "cakemp/ipc/codec.py",
           "list(zip(*[elements] * count))", "list(zip(*[elements] * max(count - 1, 1)))", IPC),
    Mutant("ipc-tuple-items-given-their-neighbours-integers", "cakemp/ipc/codec.py",
           "zip(*[values] * self.width)", "zip(*[values] * (self.width - 1))", IPC),
    Mutant("ipc-bytes-past-the-fields-read-as-nothing", "cakemp/ipc/codec.py",
           "if header.at != header.size or len(frames) != 1 + len(layout.frames):", "if False:", IPC),
    Mutant("ipc-step-items-built-in-the-order-their-values-are-read", "cakemp/ipc/codec.py",
           "zip(*(columns if self.declared is None else self.declared(columns)))", "zip(*columns)", IPC),
    # --- auth
    Mutant("worker-accepts-any-master-proof", "cakemp/auth.py",
           "if not hmac.compare_digest(proof, _mac(key, nonce_w)):", "if False:", AUTH),
    # The same bug as above, against the node-level tests alone (the issue: one unit test only).
    Mutant("worker-accepts-any-master-proof/node", "cakemp/auth.py",
           "if not hmac.compare_digest(proof, _mac(key, nonce_w)):", "if False:",
           ("tests/node/test_node.py", "-k", "key or proof")),
    Mutant("master-accepts-any-worker-proof", "cakemp/auth.py",
           "if not hmac.compare_digest(reply[:HMAC_SIZE], _mac(key, nonce_m)):", "if False:", AUTH),
    Mutant("worker-signs-its-own-nonce", "cakemp/auth.py",
           "writer.write(_mac(key, nonce_m) + nonce_w)", "writer.write(_mac(key, nonce_w) + nonce_w)", AUTH),
    # --- router
    Mutant("router-one-leg-per-op", "cakemp/front/router.py",
           "if not stages or stages[-1][0] != device:", "if True:", ROUTER),
    Mutant("router-index-off-by-one", "cakemp/front/router.py",
           "stages[-1][2].append(index)", "stages[-1][2].append(min(index + 1, 1))", ROUTER),
    # --- admission's kept layer runs
    Mutant("admission-kept-run-skips-context", "cakemp/front/admission.py",
           "max(ops.positions) + tokens <= self.max_context", "True", ("tests/front/test_admission.py",)),
    Mutant("admission-runs-unbounded", "cakemp/front/admission.py",
           "if len(self._runs) < _RUNS_KEPT:", "if True:", ("tests/front/test_admission.py",)),
    # --- pool and connection (the session's lifetime on the devices)
    Mutant("goodbye-keeps-kv", "cakemp/front/connection.py",
           "self._wait_for(asyncio.gather(*(self._pool.clear(d, self.session_id) for d in devices),",
           "self._wait_for(asyncio.gather(*(self._pool.clear(d, -1) for d in devices),", POOL),
    # --- the front's connection, driven by callbacks
    Mutant("answered-frame-keeps-its-budget", "cakemp/front/connection.py",
           "        self._answering = False\n        self._give_back()\n",
           "        self._answering = False\n        self._held = None\n", ("tests/node/test_slow_peers.py", "-k", "hold_none")),
    Mutant("later-frames-skip-the-budget", "cakemp/front/connection.py",
           "        self._answering = False\n        self._give_back()\n",
           "        self._answering = False\n", ("tests/node/test_stalled_sources.py",)),
    Mutant("reading-ahead-never-resumed", "cakemp/front/connection.py",
           "            self._paused = False\n            self._transport.resume_reading()",
           "            self._paused = False", ("tests/node/test_hostile.py", "-k", "ahead")),
    Mutant("master-closing-between-frames-left-open", "cakemp/front/connection.py",
           'self._close("debug", "connection closed by the master")', "pass", ("tests/node/test_slow_peers.py",)),
    Mutant("close-keeps-kv", "cakemp/front/pool.py",
           "return await self._control(device, session, End(session, next(self._request_ids)))",
           "return await self._control(device, session, End(-session, next(self._request_ids)))", POOL),
    Mutant("kv-gauge-not-recorded", "cakemp/front/pool.py",
           "self._series[device].kv_bytes.set(msg.kv_bytes)", "pass", POOL),
    Mutant("lost-session-not-told", "cakemp/front/pool.py",
           "[stateful and any(stage.positions)", "[stateful and False",
           ("tests/node/test_device_loss.py",)),
    # The owed requests kept in the order of their deadlines: the first's is the next.
    Mutant("request-deadline-renewed-in-place", "cakemp/front/pool_state.py",
           "        del self._requests[request_id]\n        self._requests[request_id] = request\n", "",
           ("tests/front/test_pool_state.py",)),
    Mutant("owed-count-kept-after-answer", "cakemp/front/pool_state.py",
           "            self._owed_by[device] -= 1\n", "            pass\n",
           ("tests/front/test_pool_state.py", "tests/node/test_batching.py")),
    Mutant("drain-never-times-out", "cakemp/front/server.py",
           "_, pending = await asyncio.wait(tasks, timeout=self.config.drain_timeout)",
           "_, pending = await asyncio.wait(tasks)", ("tests/node/test_node_flags.py", "-k", "drain")),
    Mutant("cpu-threads-ignored", "cakemp/front/devices.py",
           "cpu_threads = config.cpu_threads or", "cpu_threads = None or", ("tests/node/test_node_flags.py",)),
    Mutant("kv-budget-not-passed", "cakemp/front/devices.py",
           "cpu_kv_budget = config.kv_budget_bytes or", "cpu_kv_budget = None or", ("tests/node/test_node_flags.py",)),
    Mutant("default-dtype-f32", "cakemp/front/config.py",
           'dtype: str = knob("--dtype", "f16",', 'dtype: str = knob("--dtype", "f32",',
           ("tests/node/test_node_flags.py", "tests/test_cli.py")),
    # --- runner
    Mutant("rotary-offset-dropped", "cakemp/compute/runner.py",
           "return rotary.cos_sin(step.positions[index], self.dtype, long)",
           "return rotary.cos_sin(step.positions[index] - step.positions[index, 0], self.dtype, long)", RUNNER),
    # The same bug against the end-to-end generation oracle alone (the issue: it saw nothing).
    Mutant("rotary-offset-dropped/generation", "cakemp/compute/runner.py",
           "return rotary.cos_sin(step.positions[index], self.dtype, long)",
           "return rotary.cos_sin(step.positions[index] - step.positions[index, 0], self.dtype, long)", GENERATION),
    # --- the paged KV cache and the batched step
    Mutant("shared-block-written-in-place", "cakemp/compute/kv_cache.py",
           "if pool.owners[table[i]] > 1:", "if False:", RUNNER),
    Mutant("freed-blocks-not-zeroed", "cakemp/compute/kv_cache.py",
           "            pool.k.index_fill_(0, ids, 0)\n            pool.v.index_fill_(0, ids, 0)\n", "", RUNNER),
    Mutant("decode-window-ignored", "cakemp/model/attention.py",
           "    if window is not None:\n        seen &=", "    if False:\n        seen &=", RUNNER),
    Mutant("decode-sees-padding", "cakemp/model/attention.py",
           "seen = keys <= position", "seen = keys >= 0", RUNNER),
    # The same bug against the f32 parity tests alone (the issue: 4 of 5 families let it through).
    Mutant("rms-eps-10x/parity", "cakemp/model/block.py",
           "self.eps = config.rms_norm_eps", "self.eps = config.rms_norm_eps * 10",
           ("tests/compute/test_runner_parity.py", "-k", "f32")),
    Mutant("position-gap-unchecked", "cakemp/compute/runner.py",
           "if index_pos < 0 or index_pos > cached:", "if index_pos < 0:", RUNNER),
    Mutant("failed-request-keeps-length", "cakemp/compute/runner.py",
           "            self.slots[block_idx].length = start\n", "            pass\n", RUNNER),
    # A decode whose slots hold its row joins its group without a plan of its own (KVCache.continuing).
    Mutant("decode-gap-continued", "cakemp/compute/kv_cache.py",
           "            if slot is None or position > slot.length:\n", "            if slot is None:\n", RUNNER),
    Mutant("decode-past-context-limit", "cakemp/compute/kv_cache.py",
           "if slots is None or position >= self.max_context:", "if slots is None:", KV),
    Mutant("decode-ops-at-several-positions", "cakemp/op.py",
           "positions.count(positions[0]) == len(positions)", "max(positions) == positions[0]", RUNNER),
    Mutant("failed-decode-keeps-length", "cakemp/compute/runner.py",
           "                slot.length = starts\n", "                pass\n", RUNNER),
    # Every layer of a batched step reads the block tables of the first KV slot.
    Mutant("step-tables-of-one-slot", "cakemp/compute/paged_step.py",
           "[row + pool for pool in pool_ids for row in scaled]", "[row for _ in pool_ids for row in scaled]", RUNNER),
    # A step of decodes read from the tables as arrays: each row at the start of its block.
    Mutant("step-decode-rows-offset-dropped", "cakemp/compute/kv_cache.py",
           "return blocks * BLOCK + positions % BLOCK, tables", "return blocks * BLOCK, tables", RUNNER),
    # A decode's check remembered for its next rows in the block (KVCache.continuing) outlives what changes them.
    Mutant("decode-check-kept-past-a-share", "cakemp/compute/kv_cache.py",
           "        self._continued.clear()", "        pass", KV),
    Mutant("decode-check-kept-past-a-rewind", "cakemp/compute/kv_cache.py",
           "        self._continued.pop(session, None)  # its tables change\n", "", KV),
    Mutant("decode-check-kept-past-detach", "cakemp/compute/kv_cache.py",
           "        self._continued.pop(session, None)\n", "", KV + PREFIX),
    Mutant("decode-check-kept-lengths-unread", "cakemp/compute/kv_cache.py",
           "return held if min(map(_LENGTH, held)) >= position else None", "return held", KV),
    # Layers whose requests are at other positions share the first layer's rotation and masks.
    Mutant("layers-at-other-positions-alike", "cakemp/compute/paged_step.py",
           "self._alike = [alike.setdefault(row, index) for index, row in enumerate(self.starts)]",
           "self._alike = [0] * len(self.starts)", RUNNER),
    Mutant("joined-decode-not-kept-for-reuse", "cakemp/compute/runner.py",
           "            if begun is not None:\n                one_row.append((begun, output))\n", "", RUNNER + PREFIX),
    Mutant("kv-last-block-taken-as-own", "cakemp/compute/kv_cache.py",
           "and owners[table[-1]] == 1", "", RUNNER + PREFIX),
    Mutant("runner-free-keeps-kv", "cakemp/compute/runner.py",
           "            self.prefixes.end(session)\n        self.cache.clear(session)",
           "            self.prefixes.end(session)", RUNNER + POOL),
    # --- KV cache
    Mutant("kv-rewind-keeps-blocks", "cakemp/compute/kv_cache.py",
           "        if len(table) > blocks:\n            self._release(pool, table[blocks:], live=True)\n"
           "            del table[blocks:]\n", "", KV),
    Mutant("kv-clear-keeps-bytes", "cakemp/compute/kv_cache.py",
           "                self._live_used -= pool.live[b] == 0\n", "", KV),
    Mutant("kv-budget-ignored", "cakemp/compute/kv_cache.py",
           "if nbytes > left:", "if False:", KV),
    Mutant("kv-context-limit-off-by-one", "cakemp/compute/kv_cache.py",
           "            if end > max_context:\n                self._refuse_context(block_idx, end)\n            blocks",
           "            if end > max_context + 1:\n                self._refuse_context(block_idx, end)\n            blocks", KV),
    Mutant("kv-table-not-published", "cakemp/compute/kv_cache.py",
           "            self._write_blocks(slot, start, end)\n            self._publish(session, slot, first)\n",
           "            self._write_blocks(slot, start, end)\n", KV),
    Mutant("kv-table-rewritten-entries-not-published", "cakemp/compute/kv_cache.py",
           "first = min(start // BLOCK, len(slot.table))", "first = len(slot.table)", KV + PREFIX),
    Mutant("kv-table-entries-past-its-end-kept", "cakemp/compute/kv_cache.py",
           "        entries[len(table):held] = NULL_BLOCK  # past `held` they are null already\n", "", KV),
    Mutant("kv-table-row-not-copied-to-the-device", "cakemp/compute/kv_cache.py",
           "            self._starts.append(base + start)\n            self._ends.append(base + end)\n",
           "            pass\n", KV),
    Mutant("kv-table-shortened-entries-not-copied-to-the-device", "cakemp/compute/kv_cache.py",
           "self._written(row, slot, first, max(len(table), held))", "self._written(row, slot, first, len(table))", KV),
    Mutant("kv-table-length-not-kept", "cakemp/compute/kv_cache.py",
           "        self._lengths[row, slot] = len(table)\n", "", KV),
    Mutant("kv-freed-blocks-taken-last-first", "cakemp/compute/kv_cache.py",
           "block = heapq.heappop(pool.free)", "block = pool.free.pop()", KV),
    Mutant("kv-opened-whatever-the-table-holds", "cakemp/compute/kv_cache.py",
           "                if len(table) != index:\n                    return None\n", "", KV),
    Mutant("kv-opened-blocks-past-the-budget", "cakemp/compute/kv_cache.py",
           "        self._fit(session, len(slots) * self.bytes_per_block)\n", "", KV),
    Mutant("kv-opened-blocks-not-published", "cakemp/compute/kv_cache.py",
           "        self._tables.append(self._rows[session], [slot.pool for slot in slots], index, taken)\n", "", KV),
    Mutant("kv-opened-entries-not-copied-to-the-device", "cakemp/compute/kv_cache.py",
           "        for slot in slots:\n            self._written(row, slot, index, index + 1)\n", "", KV),
    Mutant("kv-opened-table-length-not-kept", "cakemp/compute/kv_cache.py",
           "        self._lengths[row, slots] = index + 1\n", "", KV),
    Mutant("kv-gathered-values-over-the-keys", "cakemp/compute/kv_cache.py",
           "        return k[:blocks], v[:blocks]\n", "        return k[:blocks], k[:blocks]\n",
           ("tests/compute/test_batch.py",)),
    Mutant("kv-pool-doubles-past-its-share", "cakemp/compute/kv_cache.py",
           "return min(self.max_blocks // len(self.pools), mine + self.max_blocks - allocated)",
           "return mine + self.max_blocks - allocated", KV),
    # --- what prefix reuse holds, as the budget counts it
    Mutant("prefix-retired-bytes-kept-after-taken-out", "cakemp/compute/prefix_cache.py",
           "        self._retired_held -= prefix.held\n", "", PREFIX),
    Mutant("prefix-live-bytes-not-counted-after-a-request", "cakemp/compute/prefix_cache.py",
           "        if changes:\n            self._count(prefix)\n", "", PREFIX),
    Mutant("discarded-prefix-keeps-output-blocks", "cakemp/compute/prefix_cache.py",
           "        self._cache.drop(prefix.slots.values())\n        prefix.outputs.free()\n",
           "        self._cache.drop(prefix.slots.values())\n", PREFIX),
    Mutant("dropped-session-keeps-output-blocks", "cakemp/compute/prefix_cache.py",
           "            prefix.outputs.free()\n            self.evictions += evicted\n",
           "            self.evictions += evicted\n", PREFIX),
    Mutant("unkept-retired-run-keeps-output-blocks", "cakemp/compute/prefix_cache.py",
           "            self._cache.drop(kept.values())\n            prefix.outputs.free()\n",
           "            self._cache.drop(kept.values())\n", PREFIX),
    Mutant("kept-rows-out-of-memory-fails-the-step", "cakemp/compute/runner.py",
           "            except torch.OutOfMemoryError:  # a GPU without the memory",
           "            except ZeroDivisionError:  # a GPU without the memory", PREFIX),
    Mutant("output-pool-growth-drops-rows", "cakemp/compute/output_rows.py",
           "        grown[: old * BLOCK] = self.rows\n", "", ("tests/compute/test_output_rows.py",) + PREFIX),
    Mutant("output-row-offset-dropped", "cakemp/compute/output_rows.py",
           "return self.table[position // BLOCK] * BLOCK + position % BLOCK",
           "return self.table[position // BLOCK] * BLOCK", PREFIX),
    Mutant("received-bytes-not-naming-rows", "cakemp/compute/runner.py",
           "[request.data for request in requests]", "[None for request in requests]", PREFIX),
    Mutant("cut-piece-named-by-the-first-rows", "cakemp/device/service.py",
           "data[piece.start * row:piece.end * row]", "data[:(piece.end - piece.start) * row]",
           ("tests/device/test_service.py",)),
    Mutant("device-rows-kept-in-their-wire-dtype", "cakemp/device/service.py",
           "if x.dtype != self.runner.dtype:", "if False:", ("tests/device/test_service.py",)),
    Mutant("device-one-hop-given-the-first-row-only", "cakemp/device/service.py",
           "return [x.view(1, lengths[0], hidden)]", "return [x[:1].view(1, 1, hidden)]",
           ("tests/device/test_service.py",)),
    # --- block math
    Mutant("rms-eps-10x", "cakemp/model/block.py",
           "self.eps = config.rms_norm_eps", "self.eps = config.rms_norm_eps * 10", BLOCK),
    Mutant("rotate-half-sign", "cakemp/model/rotary.py",
           "rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
           "rotated_half = torch.cat((x[..., half:], -x[..., :half]), dim=-1)", BLOCK),
    Mutant("window-off-by-one", "cakemp/model/attention.py",
           "first = 0 if window is None else max(0, end - window)",
           "first = 0 if window is None else max(0, end - window - 1)", BLOCK),
    Mutant("chunk-after-a-prefix-causal-from-its-first-key", "cakemp/model/attention.py",
           "tril(S - T)", "tril(0)", BLOCK),
    Mutant("softmax-scale-10-percent-off", "cakemp/model/block.py",
           "self.scale = config.attention_scale", "self.scale = config.attention_scale * 1.1", BLOCK),
    Mutant("qk-norm-skipped-on-k", "cakemp/model/block.py",
           "if self.qk_norm == \"head\":\n            q = rms_norm(q, self.q_norm, self.eps)\n"
           "            k = rms_norm(k, self.k_norm, self.eps)\n",
           "if self.qk_norm == \"head\":\n            q = rms_norm(q, self.q_norm, self.eps)\n", BLOCK),
    Mutant("mlp-gate-up-swapped", "cakemp/model/mlp.py",
           "return linear(self.activation(gate) * up, self.w_down)",
           "return linear(self.activation(up) * gate, self.w_down)", BLOCK),
    Mutant("llama3-ramp-reversed", "cakemp/model/rotary.py",
           "ramp = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq",
           "ramp = smooth * inv_freq / scaling.factor + (1 - smooth) * inv_freq", BLOCK),
    # --- the master's GGUF tokenizers
    Mutant("gguf-merge-names-unknown-token", "cakemp/master/gguf_tokenizer/bpe.py",
           "for t in (*pair, pair[0] + pair[1]) if t not in ids), None)", "for t in () if t not in ids), None)",
           GGUF_TOKENIZER),
    Mutant("bpe-last-split-regex-only", "cakemp/master/gguf_tokenizer/bpe.py",
           "for regex in FAMILIES[split.family]]", "for regex in FAMILIES[split.family][-1:]]", GGUF_TOKENIZER),
    Mutant("bpe-merges-never-ignored", "cakemp/master/gguf_tokenizer/bpe.py",
           "ignore_merges=split.ignore_merges)", "ignore_merges=False)", GGUF_TOKENIZER),
    Mutant("bpe-no-default-bos", "cakemp/master/gguf_tokenizer/bpe.py",
           "vocab.wrap(tokenizer, split.add_bos, bos_default=None)", "vocab.wrap(tokenizer, False, bos_default=None)",
           GGUF_TOKENIZER),
    Mutant("control-tokens-not-matched-whole", "cakemp/master/gguf_tokenizer/vocab.py",
           "if kind in (CONTROL, UNKNOWN)]", "if kind in (UNKNOWN,)]", GGUF_TOKENIZER),
    Mutant("spm-lowest-score-merged-first", "cakemp/master/gguf_tokenizer/spm.py",
           "ranked = [(-scores[i], i,", "ranked = [(scores[i], i,", GGUF_TOKENIZER),
    Mutant("spm-no-space-prefix", "cakemp/master/gguf_tokenizer/spm.py",
           'vocab.flag("add_space_prefix", True)', 'vocab.flag("add_space_prefix", False)', GGUF_TOKENIZER),
    Mutant("spm-no-byte-fallback", "cakemp/master/gguf_tokenizer/spm.py",
           "byte_fallback=True", "byte_fallback=False", GGUF_TOKENIZER),
    # --- behaviours pinned in the same round
    Mutant("row-digest-drops-last-byte", "cakemp/compute/row_chain.py",
           "h.update(rows[start : start + row_bytes])", "h.update(rows[start : start + row_bytes - 1])",
           ("tests/compute/test_row_chain.py", "tests/compute/test_prefix_cache.py")),
    Mutant("temperature-capped-at-1", "cakemp/master/openai_request.py",
           '_number(body, "temperature", 1.0, 0.0, 2.0)', '_number(body, "temperature", 1.0, 0.0, 1.0)',
           ("tests/master/test_openai_request.py",)),
    Mutant("component-token-length-unbounded", "cakemp/front/component_admission.py",
           "or not 1 <= shape[1] <= MAX_TOKENS:", "or not 1 <= shape[1]:",
           ("tests/node/test_image_node.py", "-k", "malformed")),
    Mutant("component-token-rows-unbounded", "cakemp/front/component_admission.py",
           "not 1 <= shape[0] <= MAX_TOKEN_ROWS", "not 1 <= shape[0]", ("tests/node/test_image_node.py", "-k", "malformed")),
    Mutant("hub-ref-trusted", "cakemp/checkpoint/locate.py",
           "return commit if _COMMIT.fullmatch(commit) else None", "return commit", ("tests/checkpoint/test_locate.py",)),
    # --- a prompt's pieces, the buffer budget's fast path, the front's heap
    Mutant("lone-prompt-cut-to-the-budget", "cakemp/device/scheduler.py",
           "chunk = self.prefill_chunk if sharing - {session} else self._alone_chunk()", "chunk = self.prefill_chunk",
           SCHEDULER),
    Mutant("shared-prompt-not-cut", "cakemp/device/scheduler.py",
           "chunk = self.prefill_chunk if sharing - {session} else self._alone_chunk()",
           "chunk = self._alone_chunk()", SCHEDULER),
    # --- the gather window: a step's fixed cost
    Mutant("gather-window-ignores-the-fixed-cost", "cakemp/device/scheduler.py",
           "window = max(GATHER_FRACTION * step_s, GATHER_MIN_S) if fixed is None else fixed",
           "window = max(GATHER_FRACTION * step_s, GATHER_MIN_S)", SCHEDULER),
    Mutant("gather-window-uncapped", "cakemp/device/scheduler.py",
           "self.window_s = min(window, GATHER_MAX_S)", "self.window_s = window", SCHEDULER),
    Mutant("gather-never-probes", "cakemp/device/scheduler.py",
           "if fixed is None and decodes is not None and self.cost.steps % GATHER_PROBE == 0:",
           "if False:", SCHEDULER),
    Mutant("step-cost-from-sizes-too-close", "cakemp/device/scheduler.py",
           "if len(recent) < 2 or max(recent) < 2 * min(recent):", "if len(recent) < 2:", SCHEDULER),
    Mutant("step-cost-keeps-stale-sizes", "cakemp/device/scheduler.py",
           "if self.steps - last < GATHER_STALE}", "}", SCHEDULER),
    Mutant("step-cost-unclamped", "cakemp/device/scheduler.py",
           "return min(max(recent[small] - per_request * small, 0.0), recent[small])",
           "return recent[small] - per_request * small", SCHEDULER),
    Mutant("step-cost-reads-prompt-steps", "cakemp/device/scheduler.py",
           "return len(self.pieces) if self.tokens == len(self.pieces) else None", "return len(self.pieces)", SCHEDULER),
    Mutant("lone-prompt-rate-never-set", "cakemp/device/process.py",
           "            scheduler.ran(step, (ran - started) / 1e9)\n", "", ("tests/node/test_batching.py",)),
    Mutant("budget-granted-past-share", "cakemp/front/buffer_budget.py",
           "return not held or held + size <= self.capacity // sources",
           "return not held or held + size <= self.capacity // sources + 1",
           ("tests/front/test_buffer_budget.py",)),
    Mutant("front-heap-not-kept", "cakemp/heap.py",
           "return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and", "return True or", ("tests/test_heap.py",)),
    Mutant("loaded-objects-not-frozen", "cakemp/heap.py", "    gc.freeze()\n", "",
           ("tests/test_heap.py", "tests/node/test_node_flags.py")),
    Mutant("device-heap-not-kept", "cakemp/device/process.py", "    heap.keep_freed_memory()  #", "    #",
           ("tests/node/test_prompt_memory.py",)),
    Mutant("pools-not-presized", "cakemp/compute/kv_cache.py", "            self.pool(block_idx).grow(share, share)",
           "            self.pool(block_idx)", ("tests/compute/test_kv_cache.py", "tests/compute/test_decode_graph.py")),
    Mutant("no-graphs-at-start", "cakemp/compute/runner.py", "            self._prepare_graphs()", "            pass",
           ("tests/compute/test_decode_graph.py",)),
    Mutant("graph-padding-not-reset", "cakemp/compute/decode_graph.py",
           "            self.slot_ids[:, B:self.rows] = SCRATCH_BLOCK * BLOCK\n", "",
           ("tests/compute/test_decode_graph.py",)),
    Mutant("graph-step-reads-a-value-back", "cakemp/model/rotary.py",
           "        at = positions.to(torch.float32)[:, None]  # [N, 1]\n",
           "        at = positions.to(torch.float32)[:, None]  # [N, 1]\n        assert int(positions.max()) >= 0\n",
           ("tests/compute/test_decode_graph.py",)),
    Mutant("graph-input-rebound", "cakemp/compute/decode_graph.py", "        self.x[:, :B] = x\n",
           "        self.x = torch.cat((x, self.x[:, B:]), dim=1)\n", ("tests/compute/test_decode_graph.py",)),
    Mutant("graph-tables-rebound", "cakemp/compute/decode_graph.py",
           "        self.tables[:, :B, :reach] = tables[:, :, :reach]\n",
           "        self.tables = self.tables.clone()\n        self.tables[:, :B, :reach] = tables[:, :, :reach]\n",
           ("tests/compute/test_decode_graph.py",)),
    Mutant("fp8-kernel-reads-a-plain-global", "cakemp/model/weights/fp8_gemm.py",
           "(cols // _SCALE_BLOCK)", "(cols // BLOCK)", ("tests/model/test_fp8_gemm.py",)),
    # --- a GPU's decode rows attending in place (model/paged_attention.py), through Triton's interpreter
    Mutant("paged-attention-reads-a-key-past-the-row", "cakemp/model/paged_attention.py",
           "    hi = tl.minimum(end, (split + 1) * split_keys)\n",
           "    hi = tl.minimum(end + 1, (split + 1) * split_keys)\n", PAGED_ATTENTION),
    Mutant("paged-attention-splits-overlap", "cakemp/model/paged_attention.py",
           "    lo = tl.maximum(first, split * split_keys)\n",
           "    lo = tl.maximum(first, split * split_keys - 1)\n", PAGED_ATTENTION),
    Mutant("paged-attention-window-one-key-short", "cakemp/model/paged_attention.py",
           "tl.maximum(end - window, 0)", "tl.maximum(end - window + 1, 0)", PAGED_ATTENTION),
    Mutant("paged-attention-splits-merged-unweighted", "cakemp/model/paged_attention.py",
           "        acc = acc * alpha[:, None] + weight[:, None] * o\n", "        acc = acc * alpha[:, None] + o\n",
           PAGED_ATTENTION),
    Mutant("paged-attention-reads-past-the-keys-named", "cakemp/model/paged_attention.py",
           "tl.minimum(end, reach)", "end", PAGED_ATTENTION),
    Mutant("paged-attention-reads-a-plain-global", "cakemp/model/paged_attention.py",
           "keys // _BLOCK", "keys // BLOCK", PAGED_ATTENTION),
    Mutant("paged-step-in-place-without-the-window", "cakemp/compute/paged_step.py",
           "step.positions[self.index, :d],\n                                           window,",
           "step.positions[self.index, :d],\n                                           None,", IN_PLACE),
    Mutant("prefix-rows-named-without-their-rotation", "cakemp/compute/runner.py",
           "share_prefixes, self._regime())", "share_prefixes, None)",
           ("tests/compute/test_prefix_cache.py", "-k", "longrope")),
    Mutant("lagging-session-dropped-by-a-request-not-continuing-it", "cakemp/compute/prefix_cache.py",
           "                if prefix is not None and prefix.lags:\n", "                if False:\n",
           ("tests/compute/test_prefix_cache.py", "-k", "not_continuing")),
    Mutant("piece-cut-on-the-device-rotated-as-its-own-request", "cakemp/device/service.py",
           "to_end = (to_end or task.tokens) - piece.start", "to_end = 0",
           ("tests/node/test_schedule_fuzz.py", "-k", "cpu:1")),
    Mutant("chunk-cut-by-the-front-rotated-as-its-own-request", "cakemp/front/pool.py",
           "to_end=0 if len(chunks) == 1 else x.shape[1] - first", "to_end=0",
           ("tests/node/test_schedule_fuzz.py", "-k", "cpu:2")),
    Mutant("retired-cap-pushes-out-the-oldest-of-all", "cakemp/compute/prefix_cache.py",
           "self._discard(next(kept for kept in self._retired if kept.source == most), evicted=True)",
           "self._discard(self._retired[0], evicted=True)", PREFIX),
    Mutant("state-kept-half-applied-after-a-partial-failure", "cakemp/front/pool_state.py",
           "        if not self._stateful:\n            return []\n", "        if True:\n            return []\n",
           ("tests/front/test_pool_state.py",)),
    Mutant("full-budget-first-come-first-served", "cakemp/compute/fair_share.py",
           "        cache.reclaim = self.reclaim\n", "", FAIR_SHARE),
    Mutant("fair-share-gives-up-the-most-recent", "cakemp/compute/fair_share.py",
           "victim = min(free, key=self._last_asked)", "victim = max(free, key=self._last_asked)", FAIR_SHARE),
    Mutant("fair-share-gives-up-a-stepping-session", "cakemp/compute/fair_share.py",
           " if other not in self._stepping]", "]", FAIR_SHARE),
    Mutant("fair-share-never-settles-the-step", "cakemp/compute/fair_share.py",
           "                self._owed.add(min(by_source[source], key=self._last_asked))\n", "", FAIR_SHARE),
    Mutant("fair-share-counts-shared-blocks-per-session", "cakemp/compute/fair_share.py",
           "held = {source: cache.held_by(sessions) for source, sessions in by_source.items()}",
           "held = {source: sum(cache.held_by([one]) for one in sessions) for source, sessions in by_source.items()}",
           FAIR_SHARE),
    Mutant("fair-share-past-the-askers-own-share", "cakemp/compute/fair_share.py",
           "            if held.get(mine, 0) + nbytes > share:\n                return\n", "", FAIR_SHARE),
    Mutant("given-up-session-continues-unwarned", "cakemp/compute/fair_share.py",
           "        self._given_up.add(session)\n", "", FAIR_SHARE),
    Mutant("decode-rows-padded-to-the-longest", "cakemp/compute/paged_step.py",
           "    if _pads_alike(widths, max(widths), split):", "    if True:", SPANS),
    Mutant("decode-rows-from-their-windows-first-block-but-one", "cakemp/compute/paged_step.py",
           "columns = (starts + torch.arange(width, device=device))",
           "columns = ((starts - 1).clamp(min=0) + torch.arange(width, device=device))", SPANS),
    Mutant("decode-rows-read-past-their-tables-width", "cakemp/compute/paged_step.py",
           ".clamp_(max=self.cache.tables.shape[2] - 1)", "", SPANS),
    Mutant("windowed-request-reads-its-whole-table", "cakemp/compute/paged_step.py",
           "skipped = 0 if window is None else max(0, start + 1 - window) // BLOCK", "skipped = 0", SPANS),
    Mutant("windowed-request-skips-a-block-of-its-window", "cakemp/compute/paged_step.py",
           "skipped = 0 if window is None else max(0, start + 1 - window) // BLOCK",
           "skipped = 0 if window is None else max(0, start + 1 - window) // BLOCK + 1", SPANS),
    Mutant("decode-rows-of-a-group-put-back-in-turn", "cakemp/compute/paged_step.py",
           "out.index_copy_(0, span.picked, ", "out.index_copy_(0, span.picked.sort().values, ", SPANS),
    Mutant("graph-gathers-unlike-rows-to-its-width", "cakemp/compute/decode_graph.py",
           "if self.cache.paged_attend is None and not step.gathers_alike(width, min(MIN_WIDTH, width)):",
           "if False:", ("tests/compute/test_decode_graph.py", "-k", "long_context")),
    Mutant("graph-in-place-without-the-window", "cakemp/compute/decode_graph.py",
           "graph.positions[self.index], window,", "graph.positions[self.index], None,", IN_PLACE),
    Mutant("graph-padding-keeps-its-position", "cakemp/compute/decode_graph.py",
           "            self.positions[:, B:self.rows] = 0", "            pass",
           ("tests/compute/test_decode_graph.py", "-k", "padding")),
    Mutant("unit-leaves-triton-in-the-home", "deploy/systemd/cakemp@.service",
           "Environment=TRITON_CACHE_DIR=%C/cakemp-%i/triton\n", "", ("tests/deploy/test_systemd.py",)),
    Mutant("bench-side-drops-its-cache", "bench/step_growth.py",
           "position_ids=positions,\n                      **{CACHE_ARGUMENT: self.cache})",
           "position_ids=positions)", ("tests/test_bench_sides.py",)),
)


def copy_tree(source: Path, rev: str | None, destination: Path) -> None:
    """The tree to mutate: `rev`'s committed files, else the working tree's (without .git and caches)."""
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(source), "archive", rev], check=True, capture_output=True).stdout
        destination.mkdir()
        subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
        return
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "*.egg-info", ".venv")
    shutil.copytree(source, destination, ignore=ignore)


def present(tree: Path, tests: tuple[str, ...]) -> list[str]:
    """`tests` without the paths this tree lacks (options and their values are kept), or [] when
    no path is left (an option alone would select from the whole suite)."""
    kept, paths, value_next = [], 0, False
    for arg in tests:
        if value_next or arg.startswith("-"):
            kept.append(arg)
            value_next = arg in ("-k", "-m")
        elif (tree / arg.split("::")[0]).exists():
            kept.append(arg)
            paths += 1
    return kept if paths else []


def run_tests(tree: Path, tests: list[str]) -> tuple[str, float]:
    """("failed: <first failing test>" | "passed" | "no tests" | "timeout" | "error rc=N", seconds)
    for `tests` in `tree`."""
    if not tests:
        return "no tests", 0.0
    env = {**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(tree / ".cache")}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=MUTANT_TIMEOUT_S, start_new_session=True)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start
    seconds = time.monotonic() - start
    if done.returncode == 1:
        failed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")]
        return f"failed: {failed[0] if failed else '?'}", seconds
    return {0: "passed", 5: "no tests"}.get(done.returncode, f"error rc={done.returncode}"), seconds


def mutate(tree: Path, mutant: Mutant) -> str | None:
    """Apply `mutant` to the copy; the reason it cannot be applied, or None."""
    path = tree / mutant.path
    if not path.exists():
        return f"{mutant.path} not in this tree"
    text = path.read_text()
    if text.count(mutant.old) != 1:
        return f"snippet occurs {text.count(mutant.old)} times in {mutant.path}"
    path.write_text(text.replace(mutant.old, mutant.new))
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="mutate this commit's tree instead of the working tree")
    parser.add_argument("--only", help="comma-separated mutant names")
    parser.add_argument("--no-baseline", action="store_true", help="skip checking that each subset passes unmutated")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cakemp-mutation-") as scratch:
        pristine = Path(scratch) / "pristine"
        copy_tree(ROOT, args.rev, pristine)
        if not args.no_baseline:
            # A subset that fails without any mutant would "kill" every mutant: check each once.
            for tests in dict.fromkeys(tuple(present(pristine, m.tests)) for m in chosen):
                outcome, seconds = run_tests(pristine, list(tests))
                print(f"baseline {' '.join(tests) or '(none)'}: {outcome} ({seconds:.0f} s)", flush=True)
                if outcome not in ("passed", "no tests"):
                    return 2
        killed = 0
        for i, mutant in enumerate(chosen):
            tree = Path(scratch) / f"mutant-{i}"
            shutil.copytree(pristine, tree)
            problem = mutate(tree, mutant)
            if problem is not None:
                outcome, seconds = f"not applied: {problem}", 0.0
            else:
                outcome, seconds = run_tests(tree, present(tree, mutant.tests))
            shutil.rmtree(tree, ignore_errors=True)
            dead = outcome.startswith("failed") or outcome == "timeout"
            killed += dead
            print(f"{'KILLED  ' if dead else 'SURVIVED'} {mutant.name:36s} {outcome} ({seconds:.0f} s)", flush=True)
    print(f"score: {killed}/{len(chosen)} killed in {(time.monotonic() - started) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
