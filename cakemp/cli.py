"""`cakemp` commands: thin; each builds a config object and hands it on.

Every flag also reads CAKEMP_<FLAG> from the environment (--cluster-key also Cake's
CAKE_CLUSTER_KEY). A configuration error exits with status 78 (EX_CONFIG) and one line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import PurePath

import click

from cakemp import __version__, log
from cakemp.device import process as device_process
from cakemp.errors import CakempError, ConfigError
from cakemp.front import Front
from cakemp.front.config import RUN_FLAGS, Flag, node_config, run_flag, scrub_cluster_key
from cakemp.front.devices import device_environment
from cakemp.front.notify import Notifier
from cakemp.wire import Revision

# The front's and `cakemp serve`'s event loop where installed, the stdlib's otherwise: uvloop cut the front's
# CPU per decode Batch by ~6% at 1 session (bench/request_cost.py, 475 -> 450 µs), none at 8 sessions.
try:
    import uvloop
except ImportError:
    uvloop = None

EXIT_CONFIG = 78
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant."  # Cake's --system-prompt default (cake-core/src/lib.rs)


def _env(flag: str) -> str:
    return "CAKEMP_" + flag.upper().replace("-", "_")


def _flag(*decls: str, **kwargs):
    """A click option that also reads CAKEMP_<FLAG> (unless given its own envvar) and says so in --help."""
    kwargs.setdefault("envvar", _env(decls[0].lstrip("-")))
    return click.option(*decls, show_envvar=True, **kwargs)


def _option(flag: Flag):
    """`flag` as a click option: it also reads CAKEMP_<FLAG>, after the flag's own variables."""
    own = _env(flag.key)
    return _flag(flag.name, type=flag.type, default=flag.default, help=flag.help, is_flag=flag.is_flag,
                 envvar=[*flag.envvar, own] if flag.envvar else own)


def _options(flags: tuple[Flag, ...]):
    """A decorator adding a click option per flag, listed in --help in their order."""
    def decorate(command):
        for flag in reversed(flags):
            command = _option(flag)(command)
        return command
    return decorate


def _like_run(name: str, **changes):
    """`cakemp run`'s flag `name` (its default, type and variables) for another command, with `changes`
    (its own help, say)."""
    return _option(dataclasses.replace(run_flag(name), **changes))


@click.group(context_settings={"show_default": True})
@click.version_option(__version__, prog_name="cakemp")
def cli() -> None:
    """cakemp: a multi-GPU worker node for Cake distributed LLM inference."""


@cli.command()
@_options(RUN_FLAGS)
def run(**flags) -> None:
    """Serve this worker's layers: its entry's in a Cake topology, or (with --cluster-key and no
    --topology: zero-config) those a master discovering it assigns and pushes."""
    log.configure(flags["log_format"], flags["log_level"])
    # First: it takes the manager's variables out of the environment the device processes inherit.
    notifier = Notifier.from_env()
    scrub_cluster_key(os.environ)  # read into flags by now; before anything is started that would inherit it
    os.environ.update(device_environment(os.environ))  # for the device processes, which inherit it
    model_source = click.get_current_context().get_parameter_source("model")
    config = node_config(flags, model_given=model_source != click.core.ParameterSource.DEFAULT)
    # The front's exit status; a CakempError (a device that died while loading, say) exits 1.
    sys.exit(_run_or_exit(Front(config, device_process.main, notifier).run()))


def _cluster_flags(command):
    """The flags saying where a master's workers are and how to reach them (`generate`, `serve`)."""
    flags = (
        _like_run("--model"),
        _flag("--topology", help="Cake topology YAML (default: a --model bundle's; without one every layer runs here)."),
        _like_run("--master-tflops", help="A topology whose nodes all list no layers: this master's TFLOPS its share "
                  "is weighed by (default: its own devices', as Cake's master counts them)."),
        _like_run("--cluster-key", help="Shared key of the workers."),
        _like_run("--dtype", help="Compute and wire dtype; must match the workers'."),
        _like_run("--protocol", help="Cake revision the workers speak."),
        _like_run("--dequantize-4bit", help="Dequantize the 4-bit weights of the layers this master runs itself "
                  "(GPTQ, MLX, GGUF Q4_0/Q4_1/Q4_K) at load instead of keeping them 4-bit for torch's int4 matmul: "
                  "4-8x the memory, results as before (the workers choose for their own layers)."),
        _flag("--discover", help="Zero-config: find the cluster's workers at these comma-separated addresses "
              "(broadcast like 255.255.255.255, or the workers' own), give them layers and push them the files."),
        _like_run("--discovery-port", help="UDP port of the workers' discovery.", type=click.IntRange(1, 65535)),
        _flag("--discovery-timeout", type=click.FloatRange(0, min_open=True), default=10.0,
              help="Seconds to collect discovery replies."),
        _flag("--min-workers", type=click.IntRange(min=0), default=0,
              help="Stop collecting replies once this many addresses answered (0: wait the whole timeout)."),
    )
    for flag in reversed(flags):
        command = flag(command)
    return command


def _repeat_flags(command):
    """Cake's repeat penalty, which OpenAI requests do not carry: a flag of `generate` and `serve`."""
    command = _flag("--repeat-last-n", type=click.IntRange(min=0), default=128,
                    help="How many recent tokens the penalty looks at.")(command)
    return _flag("--repeat-penalty", type=click.FloatRange(0, min_open=True),
                 default=1.1, help="Penalty on recently generated tokens (1.0: none).")(command)


def _open_generator(model, topology, master_tflops, cluster_key, dtype, protocol, dequantize_4bit, discover,
                    discovery_port, discovery_timeout, min_workers, max_concurrent=1):
    """The flags of `_cluster_flags` checked; a coroutine opening the `Generator` over the cluster they name
    (discovering it and pushing it the files first, with --discover), with `max_concurrent` connection sets."""
    import torch  # here, not at the top: `cakemp run`'s front must never import torch

    from cakemp.master.cluster import discover_cluster
    from cakemp.master.generator import Generator
    from cakemp.placement import master_checkpoint

    if discover and topology:
        raise ConfigError("--discover and --topology exclude each other")
    if discover and not cluster_key:
        raise ConfigError("--discover needs --cluster-key (the cluster's workers answer only to its hash)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    revision = Revision(int(protocol))
    model, layout = master_checkpoint(model, topology, master_tflops, on_gpu=device == "cuda",
                                      every_layer=bool(discover), report=lambda line: click.echo(line, err=True))

    async def open_generator() -> Generator:
        nonlocal layout
        if discover:
            targets = [target.strip() for target in discover.split(",") if target.strip()]
            layout = await discover_cluster(model, cluster_key, targets, port=discovery_port, timeout=discovery_timeout,
                                            min_workers=min_workers, revision=revision, on_gpu=device == "cuda",
                                            dtype=dtype, report=lambda line: click.echo(line, err=True))
        return await Generator.open(model, layout, dtype=dtype, device=device, cluster_key=cluster_key or None,
                                    revision=revision, keep_int4=not dequantize_4bit, max_concurrent=max_concurrent)

    return open_generator()


@cli.command()
@_cluster_flags
@_flag("--prompt", default="Once upon a time", help="The user's message (with --raw: the text to continue).")
@_flag("--system-prompt", default=DEFAULT_SYSTEM_PROMPT,
       help="The chat's system message, as Cake's default (empty: none).")
@_flag("--raw", is_flag=True, help="Send the prompt as it is, without the checkpoint's chat template.")
@_flag("--max-tokens", type=click.IntRange(min=1), default=128,
       help="Most tokens to generate (fewer when an end token comes first).")
@_flag("--temperature", type=float, default=1.0, help="0 or less: greedy.")
@_flag("--top-k", type=click.IntRange(min=1), help="Sample among the k likeliest.")
@_flag("--top-p", type=click.FloatRange(0, 1, min_open=True), help="Nucleus mass.")
@_repeat_flags
@_flag("--seed", type=int, default=299792458, help="Sampling seed.")
def generate(prompt, system_prompt, raw, max_tokens, temperature, top_k, top_p, repeat_penalty, repeat_last_n, seed,
             **cluster) -> None:
    """Generate text as a Cake master: this process runs the layers no worker serves.

    The prompt goes through the checkpoint's chat template (chat_template.jinja or tokenizer_config.json;
    a GGUF file's tokenizer.chat_template) after the system prompt, unless --raw or the checkpoint has no
    template; the answer is printed as it comes, and ends at the model's end tokens."""
    from cakemp.master.chat import conversation
    from cakemp.master.sampler import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, repeat_penalty, repeat_last_n, seed)
    opening = _open_generator(**cluster)

    async def stream():
        async with await opening as generator:
            if raw or generator.chat is None:
                if not raw:
                    click.echo("cakemp: the checkpoint has no chat template: the prompt goes raw", err=True)
                request = prompt
                click.echo(prompt, nl=False)
            else:
                request = generator.chat.encode(conversation(system_prompt, prompt))
            done = await generator.generate(request, max_tokens, sampling, on_text=lambda t: click.echo(t, nl=False))
        click.echo()
        click.echo(done.summary(), err=True)

    _run_or_exit(stream())


@cli.command()
@_cluster_flags
@_flag("--address", default="127.0.0.1:8080", envvar="CAKEMP_SERVE_ADDRESS",  # not `cakemp run`'s CAKEMP_ADDRESS
       help="host:port the API listens on (port 0: any free one).")
@_flag("--model-id", help="The model's name in the API (/v1/models, requests' `model`) [default: the model "
       "directory's name, a GGUF file's name without .gguf, or the Hugging Face id --model gives].")
@_flag("--max-tokens", type=click.IntRange(min=1), default=2048,
       help="Most tokens a request may ask for (more: 400), and what it gets when it names no max_tokens (cut to "
       "the context left).")
@_repeat_flags
@_flag("--max-body-kib", type=click.IntRange(min=1), default=1024, help="Largest request body accepted.")
@_flag("--max-concurrent", type=click.IntRange(min=1), default=8,
       help="Requests generated at once, stepped together, each its own Cake session on its own connections "
       "(fewer if the workers admit fewer connections).")
@_flag("--max-waiting", type=click.IntRange(min=0), default=16,
       help="Requests that may wait for a place behind the --max-concurrent running ones; more get 503.")
@_flag("--share-prefixes-across-clients", is_flag=True,
       help="Let requests that name no `user` or `cache_salt` reuse each other's prefixes on the workers (a hit "
       "shows in latency: every such client then learns of the others' prompts). Without it they share none.")
@_flag("--chat-template-seconds", type=click.FloatRange(min=0, min_open=True), default=5.0,
       help="Longest a chat template may render one request's messages; longer is stopped, a 400.")
@_like_run("--log-format")
@_like_run("--log-level")
def serve(address, model_id, max_tokens, repeat_penalty, repeat_last_n, max_body_kib, max_concurrent, max_waiting,
          share_prefixes_across_clients, chat_template_seconds, log_format, log_level, **cluster) -> None:
    """Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)
    over the cluster, up to --max-concurrent requests at once; needs the `serve` extra (pip install
    'cakemp[serve]')."""
    from cakemp.master.serve import ServeOptions, serve_api

    log.configure(log_format, log_level)
    options = ServeOptions(address, model_id or api_model_name(cluster["model"]), max_tokens, repeat_penalty,
                           repeat_last_n, max_body_kib * 1024, max_waiting, chat_template_seconds,
                           share_prefixes_across_clients)
    _run_or_exit(serve_api(_open_generator(**cluster, max_concurrent=max_concurrent), options))


def api_model_name(model: str) -> str:
    """The API's name for `--model`: a directory's own name, a GGUF file's (a path or a repository's
    file) without `.gguf`, or the Hugging Face id as given."""
    if model.endswith(".gguf"):
        return PurePath(model).stem
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


@cli.command()
@click.argument("address")
@_like_run("--cluster-key", help="Shared key of the node.")
@_flag("--json", "as_json", is_flag=True, help="Print the WorkerInfo as one JSON object.")
@_flag("--timeout", type=click.FloatRange(0, min_open=True), default=5.0, help="Seconds per step.")
@_like_run("--protocol", help="Cake revision the node speaks.")
@_flag("--metrics-address", help="The node's --metrics-address: also show which layers each device serves.")
def probe(address, cluster_key, as_json, timeout, protocol, metrics_address) -> None:
    """Check the node at ADDRESS (host:port): authenticate, say Hello, print its WorkerInfo.

    Exits 0 when it answers; 1 when it is down, 2 when the key handshake fails, 3 when it
    answers anything but WorkerInfo; each with one line on stderr.
    """
    import dataclasses
    import json

    from cakemp.errors import AuthError, ProtocolError, WorkerUnreachable
    from cakemp.master.probe import probe as probe_node
    from cakemp.master.probe import read_placement

    try:
        info = asyncio.run(probe_node(address, cluster_key=cluster_key or None, timeout=timeout,
                                      revision=Revision(int(protocol))))
        placement = read_placement(metrics_address, timeout=timeout) if metrics_address else None
    except WorkerUnreachable as e:
        _exit(f"down: {e}", 1)
    except AuthError as e:
        _exit(f"cluster key refused: {e}", 2)
    except ProtocolError as e:
        _exit(f"wrong answer: {e}", 3)
    if as_json:
        extra = {} if placement is None else {"placement": placement}
        click.echo(json.dumps({"address": address, **dataclasses.asdict(info), **extra}))
        return
    click.echo(f"{address} is up: version {info.version}, {info.os}/{info.arch}, device {info.device} "
               f"{info.device_idx}, dtype {info.dtype}, latency {info.latency} ms")
    for device in (placement or {}).get("devices", ()):
        click.echo(f"  {device['device']} serves {', '.join(device['layers'])}")


@cli.command()
@_flag("--checkpoint", "checkpoint_only", is_flag=True,
       help="Only build (once) the demo's checkpoint and print its directory, for a node of your own.")
def demo(checkpoint_only: bool) -> None:
    """Run a synthetic model through a local two-device node, no download needed (about 5 s)."""
    if checkpoint_only:
        from cakemp.demo.synthetic import demo_checkpoint

        click.echo(demo_checkpoint())
        return
    from cakemp.demo.run import run_demo

    _run_or_exit(run_demo())


def _run_or_exit(coroutine):
    """Run `coroutine` on uvloop where installed, returning its result; a CakempError other than ConfigError
    (that one exits 78) exits 1 with one line."""
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop else None) as runner:
            return runner.run(coroutine)
    except ConfigError:
        raise
    except CakempError as e:
        _exit(str(e), 1)


def _exit(message: str, status: int) -> None:
    click.echo(f"cakemp: error: {message}", err=True)
    sys.exit(status)


def main() -> None:
    """Console entry point: click's own usage errors and ConfigError exit 78 with one line."""
    try:
        cli.main(standalone_mode=False)
    except ConfigError as e:
        click.echo(f"cakemp: error: {e}", err=True)
        sys.exit(EXIT_CONFIG)
    except click.UsageError as e:
        click.echo(f"cakemp: error: {e.format_message()}", err=True)
        sys.exit(EXIT_CONFIG)
    except click.Abort:
        sys.exit(1)
