"""The baseline for bench/pool.py: Cake's worker design as one Python process.

    python -m bench.single_worker --model DIR --layers model.layers.0-3 [--port 0] [--dtype f32] [--threads N]

TCP, the wire codec and BlockRunner in one asyncio loop, each request computed inline on the
loop's thread, one KV session per connection, as Cake's Rust worker does: no front process, no
ZeroMQ, no second process. Prints "PORT <n>" once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import torch

from cakemp.compute import tensors
from cakemp.compute.runner import BlockRunner
from cakemp.errors import BadTensor, ProtocolError, RequestError
from cakemp.topology import expand_layers
from cakemp.wire import (
    Batch,
    FrameDecoder,
    Goodbye,
    Hello,
    RawTensor,
    Revision,
    SingleOp,
    TensorMessage,
    WorkerError,
    WorkerInfo,
    encode_frame,
)

INFO = WorkerInfo("0.1.0", "F32", "linux", "x86_64", "cpu", 0, 0)


def serve_request(runner: BlockRunner, session: int, x: RawTensor, ops) -> TensorMessage | WorkerError:
    if not ops:  # nothing to compute: echo, as cakemp's front does without touching a device
        return TensorMessage(x)
    try:
        t = tensors.to_tensor(x.data, x.dtype, x.shape).to(runner.device, runner.dtype)
        with torch.inference_mode():
            y = runner.run(session, t, runner.ops([tuple(op) for op in ops]))
        return TensorMessage(RawTensor(tensors.to_bytes(y, x.dtype), x.dtype, x.shape))
    except RequestError as e:
        return WorkerError(str(e))


async def serve(runner: BlockRunner, port: int) -> None:
    sessions = itertools.count(1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session, decoder = next(sessions), FrameDecoder(Revision.V2)
        try:
            while True:
                while (msg := decoder.next_message()) is None:
                    data = await reader.read(1 << 20)
                    if not data:
                        return
                    decoder.feed(data)
                if isinstance(msg, (Hello, Goodbye)):
                    runner.free_session(session)
                    reply = INFO
                elif isinstance(msg, Batch):
                    reply = serve_request(runner, session, msg.x, msg.batch)
                elif isinstance(msg, SingleOp):
                    reply = serve_request(runner, session, msg.x, [(msg.layer_name, msg.index_pos, msg.block_idx)])
                else:
                    return
                writer.writelines(encode_frame(reply, Revision.V2))
                await writer.drain()
        except (ProtocolError, BadTensor, ConnectionError):
            return
        finally:
            runner.free_session(session)
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", required=True, help="topology-style entry, e.g. model.layers.0-3")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dtype", default="f32", choices=["f16", "bf16", "f32"])
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Weights plain, as a device with --max-batch 1 keeps them: packing pays only for batches.
    runner = BlockRunner.load(args.model, expand_layers([args.layers]), "cpu", tensors.compute_dtype(args.dtype),
                              pack_weights=False)
    asyncio.run(serve(runner, args.port))


if __name__ == "__main__":
    main()
