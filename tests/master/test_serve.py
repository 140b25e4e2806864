"""`cakemp serve` as a real subprocess over a live local cluster, driven by the official `openai` client.

The cluster: one `cakemp run --gpus cpu:2` node serving model.layers.1-3 and model.layers.5 of the
synthetic checkpoint (given a ChatML template), the master (`cakemp serve`) keeping layers 0 and 4.
The server runs with --max-concurrent 1 --max-waiting 0 (a request that comes while another runs is
refused with 503, which makes "busy" observable) and --max-body-kib 64. Greedy answers are compared with `cakemp
generate`'s over the same node; prefix reuse is read from the node's /metrics.
"""

import json
import os
import select
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest
import yaml
from click.testing import CliRunner

from cakemp.cli import DEFAULT_SYSTEM_PROMPT, cli
from cakemp.demo.local_node import free_port
from cakemp.demo.synthetic import write_checkpoint
from cakemp.sources import PER_SOURCE
from tests.master.chat_templates import CHATML, with_template
from tests.support.distance import Distance
from tests.support.flood import ConnectFlood
from tests.support.node import LoggedProcess, RunningNode, answered, scrape, wait_until, waiting

NODE_LAYERS = ["model.layers.1-3", "model.layers.5"]
MODEL_ID = "tiny-chat"
PROMPT = "Once upon a time"
STEPS = 20
DEVICES = ("cpu:0", "cpu:1")
MAX_BODY = 64 * 1024
GREEDY = {"temperature": 0, "max_tokens": STEPS}


def chat(content=PROMPT):
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": content}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    base = tmp_path_factory.mktemp("base") / "ckpt"
    base.mkdir()
    write_checkpoint(base)
    return with_template(base, tmp_path_factory.mktemp("chat") / MODEL_ID, CHATML, in_jinja_file=True)


class Node:
    """The cluster's one node on a fixed port, so that it can be restarted where the server finds it."""

    def __init__(self, model, work):
        self.model, self.port = model, free_port()
        self.node_topology = work / "node.yml"
        self.node_topology.write_text(yaml.safe_dump({"worker": {"host": "127.0.0.1:10128", "layers": NODE_LAYERS}}))
        self.topology = work / "master.yml"
        self.topology.write_text(yaml.safe_dump({"worker": {"host": f"127.0.0.1:{self.port}", "layers": NODE_LAYERS}}))
        self.start()

    def start(self):
        self.running = RunningNode(self.model, self.node_topology, "--gpus", "cpu:2", "--dtype", "f32",
                                   "--address", f"127.0.0.1:{self.port}", "--metrics-address", "127.0.0.1:0")

    def __iter__(self):  # running, topology = node
        return iter((self.running, self.topology))


@pytest.fixture(scope="module")
def node(model, tmp_path_factory):
    node = Node(model, tmp_path_factory.mktemp("node"))
    yield node
    assert node.running.stop() == 0


@pytest.fixture(scope="module")
def server(model, node):
    serving = LoggedProcess(["serve", "--model", str(model), "--topology", str(node.topology), "--dtype", "f32",
                             "--address", "127.0.0.1:0", "--repeat-penalty", "1", "--max-concurrent", "1", "--max-waiting", "0",
                             "--max-body-kib", str(MAX_BODY // 1024), "--log-format", "json"], ready="api listening")
    yield serving
    assert serving.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=120)


def cakemp_generate(model, topology, *args):
    """What `cakemp generate` prints, greedy for STEPS tokens over the node (without the final newline)."""
    result = CliRunner().invoke(cli, ["generate", "--model", str(model), "--topology", str(topology), "--prompt", PROMPT,
                                      "--max-tokens", str(STEPS), "--temperature", "0", "--repeat-penalty", "1",
                                      "--dtype", "f32", *args])
    assert result.exit_code == 0, result.output
    return result.stdout.removesuffix("\n")


def streamed(stream):
    """The text of a streamed chat completion and its last chunk's finish reason."""
    chunks = list(stream)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def post(server, path, body: bytes, content_type="application/json"):
    """A raw POST to the server: (status, JSON body)."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    # What it loaded (torch, the tokenizer, the web stack) is out of the garbage collector's passes.
    assert next(e for e in server.events() if e.get("event") == "api listening")["frozen_objects"] > 50_000
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as response:
        assert json.loads(response.read())["status"] == "ok"


def test_greedy_chat_answers_equal_cakemp_generates(client, model, node):
    """Non-streamed and streamed greedy answers to Cake's default system prompt and the prompt are what
    `cakemp generate` prints for them over the same node."""
    expected = cakemp_generate(model, node.topology)
    answer = client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY)
    assert answer.choices[0].message.content == expected and answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens <= STEPS and answer.usage.prompt_tokens > 16
    text, chunks = streamed(client.chat.completions.create(model=MODEL_ID, messages=chat(), stream=True,
                                                           stream_options={"include_usage": True}, **GREEDY))
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == answer.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == answer.usage.total_tokens


def test_completions_equal_cakemp_generate_raw(client, model, node):
    """/v1/completions continues the prompt as `cakemp generate --raw` does (which prints the prompt first)."""
    expected = cakemp_generate(model, node.topology, "--raw").removeprefix(PROMPT)
    answer = client.completions.create(model=MODEL_ID, prompt=PROMPT, **GREEDY)
    assert answer.choices[0].text == expected
    assert "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_ID, prompt=PROMPT, stream=True, **GREEDY)) == expected


def reused_tokens(metrics_port):
    metrics = scrape(metrics_port)
    return sum(metrics.get(("cakemp_prefix_reused_tokens_total", (("device", d),)), 0.0) for d in DEVICES)


def test_a_second_request_reuses_the_first_ones_prefix_on_the_node(client, node):
    """Each request of one `user` ends with Goodbye on connections the next of that user gets again, so
    the node answers the next request's shared prefix (system prompt and question) from the rows it kept:
    cakemp_prefix_reused_tokens_total grows on both devices' total by at least a block of 16 positions."""
    running, _ = node
    messages = chat("A question asked twice")
    first = client.chat.completions.create(model=MODEL_ID, messages=messages, user="reader", **GREEDY)
    before = reused_tokens(running.metrics_port())
    second = client.chat.completions.create(model=MODEL_ID, messages=messages, user="reader", **GREEDY)
    assert reused_tokens(running.metrics_port()) - before >= 16
    assert second.choices[0].message.content == first.choices[0].message.content


def test_a_stop_sequence_ends_the_answer_before_it(client):
    """`stop` cuts the greedy answer where the sequence first begins, streamed or not, with finish "stop"."""
    full = client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = full[:full.find(stop)]
    answer = client.chat.completions.create(model=MODEL_ID, messages=chat(), stop=[stop], **GREEDY)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (expected, "stop")
    text, chunks = streamed(client.chat.completions.create(model=MODEL_ID, messages=chat(), stop=stop, stream=True,
                                                           **GREEDY))
    assert (text, chunks[-1].choices[0].finish_reason) == (expected, "stop")


def test_seeded_sampling_is_reproducible(client):
    """The same seed, temperature and top_p give the same sampled answer, streamed or not."""
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": STEPS}
    first = client.chat.completions.create(model=MODEL_ID, messages=chat(), **sampling).choices[0].message.content
    again = client.chat.completions.create(model=MODEL_ID, messages=chat(), **sampling).choices[0].message.content
    text, _ = streamed(client.chat.completions.create(model=MODEL_ID, messages=chat(), stream=True, **sampling))
    assert first == again == text


def refusals(client, server):
    """Every kind of bad request, each answered with OpenAI's error object: (status, error) of each."""
    errors = []
    for kwargs in ({"model": "other"}, {"temperature": 5}, {"n": 2}, {"messages": []}, {"max_tokens": 5000},
                   {"messages": [{"role": "wizard", "content": "x"}]}, {"stop": ["a"] * 5}):
        try:
            client.chat.completions.create(**{"model": MODEL_ID, "messages": chat(), **kwargs})
        except openai.APIStatusError as e:
            errors.append((e.status_code, {"error": e.body}))
    for body in (b"x" * (MAX_BODY + 1), b"{not json", b"[" * 60_000, json.dumps([1, 2]).encode()):
        errors.append(post(server, "/v1/chat/completions", body))
    errors.append(post(server, "/v1/nowhere", b"{}"))
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/chat/completions", timeout=10)
    except urllib.error.HTTPError as e:
        errors.append((e.code, json.loads(e.read())))
    return errors


def read_until(chunks, length):
    """Text of the streamed chat chunks read until it is at least `length` characters long."""
    text = ""
    while len(text) < length:
        chunk = next(chunks)
        text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    return text


def test_bad_requests_and_a_client_leaving_mid_stream_leave_the_stream_and_the_cluster_well(client, server, node):
    """While a long stream runs, bad requests are refused with OpenAI's error objects (400, 404, 405, 413)
    and a good one with 503 (the cluster is busy); the stream goes on with the greedy answer. When its
    client then leaves, the generation ends after the step in flight (it says Goodbye), far short of its
    max_tokens, with no request left waiting on the node's devices, and the next request is served."""
    running, _ = node
    first = client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY)
    expected, mark = first.choices[0].message.content, served_mark(server, first.id)
    stream = client.chat.completions.create(model=MODEL_ID, messages=chat(), stream=True, temperature=0,
                                            max_tokens=1500)
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"  # the generation holds the cluster now
    errors = refusals(client, server)
    with pytest.raises(openai.APIStatusError) as busy:
        client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY)
    assert read_until(chunks, len(expected)).startswith(expected)
    stream.close()

    statuses = [status for status, _ in errors]
    assert statuses == [404, 400, 400, 400, 400, 400, 400, 413, 400, 400, 400, 404, 405]
    assert all(set(body["error"]) >= {"message", "type", "param", "code"} for _, body in errors), errors
    assert errors[0][1]["error"]["code"] == "model_not_found"
    assert errors[4][1]["error"]["code"] == "context_length_exceeded"
    assert busy.value.status_code == 503 and busy.value.body["code"] == "overloaded"
    served = server.wait_for(lambda e: e.get("event") == "request served", timeout=120, after=mark)
    assert served["halted"] and served["completion_tokens"] < 1500
    metrics = scrape(running.metrics_port())
    assert all(waiting(metrics, device) == 0 for device in DEVICES)
    assert client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY).choices[0].message.content == expected


def served_mark(server, request_id: str) -> int:
    """A mark in the server's log past the "request served" line of `request_id` (which the server may
    write after its client has the answer), and so past every earlier request's: a `wait_for` from it
    finds only later requests' lines."""
    server.wait_for(lambda e: e.get("event") == "request served" and e.get("id") == request_id, timeout=60)
    return server.mark()


def closed_by_server(sockets):
    """The sockets of `sockets` that the server has closed (reading finds the end, or a reset)."""
    closed = []
    for sock in sockets:
        if select.select([sock], [], [], 0)[0]:
            try:
                if sock.recv(1) == b"":
                    closed.append(sock)
            except ConnectionError:
                closed.append(sock)
    return closed


def health(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as response:
        return json.loads(response.read())


def test_a_flood_of_connections_sending_no_whole_request_leaves_a_real_client_answered(client, server):
    """200 connections that never send a whole request (150 idle from one address, then from 50 others
    40 that send half a request head and 10 a head and the start of a body, then a byte every 50 ms)
    do not stop the openai client's request from being answered, nor close its kept-alive connection.
    The server holds at most 8 of one address's (all but 8 of the idle ones are closed at once) and
    64 in all, and closes every other one by its deadline, trickling included; a request whose body
    never came is no crash."""
    expected = client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY).choices[0].message.content
    address = ("127.0.0.1", server.port)
    idle = [socket.create_connection(address, source_address=("127.0.0.3", 0)) for _ in range(150)]
    mark = server.mark()
    slow = [socket.create_connection(address, source_address=(f"127.0.4.{i + 1}", 0)) for i in range(50)]
    for sock in slow[:40]:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    for sock in slow[40:]:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{")
    try:
        assert client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY).choices[0].message.content \
            == expected
        wait_until(lambda: len(closed_by_server(idle)) >= 150 - PER_SOURCE, what="closing the idle connections past 8")
        open_slow = set(slow)

        def trickled_until_closed():
            for sock in list(open_slow):
                try:
                    sock.sendall(b"X")
                except OSError:  # closed by the server
                    open_slow.discard(sock)
            open_slow.difference_update(closed_by_server(open_slow))
            return not open_slow and len(closed_by_server(idle)) == len(idle)

        wait_until(trickled_until_closed, timeout=60, what="closing every incomplete connection by its deadline")
    finally:
        for sock in idle + slow:
            sock.close()
    assert health(server)["status"] == "ok"
    assert not [e for e in server.events(mark) if e.get("event") == "request crashed"]


def test_a_connect_flood_from_one_address_leaves_every_request_of_another_answered(client, server):
    """While one address connects from four threads as fast as it can and never sends a byte, six
    requests of the openai client 100 ms away (a round trip) from another address are all answered,
    as without the flood: the flood holds only its address's places and closes its own. (Before: the
    flood's newer connects closed the client's connection while its request was on the way, about
    half of them.)"""
    expected = client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY).choices[0].message.content
    with ConnectFlood(server.port, "127.0.0.3") as flood, Distance(server.port, "127.0.0.2", 0.05) as far:
        wait_until(lambda: flood.connects > 1000, what="the flood under way")
        answers = []
        for _ in range(6):  # a new client each time: a new connection, through the flood
            with openai.OpenAI(base_url=f"http://127.0.0.1:{far.port}/v1", api_key="unused", max_retries=0,
                               timeout=120) as each:
                try:
                    answers.append(each.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY)
                                   .choices[0].message.content)
                except openai.APIError as e:
                    answers.append(f"{type(e).__name__}: {e}")
    assert answers == [expected] * 6, answers
    assert health(server)["status"] == "ok"


def test_a_client_that_leaves_before_its_whole_answer_frees_the_cluster(client, server, node):
    """A non-streaming client that disconnects while its answer is generated halts the generation after the
    step in flight (it says Goodbye), far short of its max_tokens, with no request left waiting on the node's
    devices; the next request is served with the greedy answer."""
    running, _ = node
    first = client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY)
    expected, mark = first.choices[0].message.content, served_mark(server, first.id)
    before = answered(scrape(running.metrics_port()), DEVICES[0])
    body = json.dumps({"model": MODEL_ID, "messages": chat(), "temperature": 0, "max_tokens": 1500}).encode()
    leaving = socket.create_connection(("127.0.0.1", server.port))
    leaving.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_until(lambda: answered(scrape(running.metrics_port()), DEVICES[0]) >= before + 3,
               what="the generation's first steps on the node")
    leaving.close()
    served = server.wait_for(lambda e: e.get("event") == "request served", timeout=120, after=mark)
    assert served["halted"] and served["completion_tokens"] < 1500
    assert all(waiting(scrape(running.metrics_port()), device) == 0 for device in DEVICES)
    assert client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY).choices[0].message.content == expected


def test_the_server_reconnects_once_the_node_is_back(client, server, node):
    """The node restarted behind the server: the request that finds its connections closed fails with 502,
    and so does one while the node is down (connecting fails); once the node is back on its address, the
    next request is served on fresh connections, with the greedy answer."""
    expected = client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY).choices[0].message.content
    assert node.running.stop() == 0
    statuses = []
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY)
        statuses.append((failed.value.status_code, failed.value.body["code"]))
    assert statuses == [(502, "cluster_error")] * 2
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as response:
        assert json.loads(response.read())["connections"].startswith("broken")
    node.start()
    assert client.chat.completions.create(model=MODEL_ID, messages=chat(), **GREEDY).choices[0].message.content == expected


def test_without_the_serve_extra_it_says_what_to_install(tmp_path):
    """Where Starlette cannot be imported, `cakemp serve` exits 78 with one line naming the extra."""
    (tmp_path / "starlette").mkdir()
    (tmp_path / "starlette" / "__init__.py").write_text("raise ImportError('No module named starlette')\n")
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = subprocess.run([sys.executable, "-m", "cakemp", "serve", "--model", str(tmp_path)], text=True,
                            capture_output=True, env={**os.environ, "PYTHONPATH": path}, timeout=120)
    assert result.returncode == 78, result.stderr
    assert result.stderr.strip().splitlines() == [
        "cakemp: error: cakemp serve needs the serve extra (pip install 'cakemp[serve]'): No module named starlette"]
