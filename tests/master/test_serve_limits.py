"""What one client of `cakemp serve` cannot do to the others: a real server over a live node, each hostile
request sent while another client's request is answered with the greedy answer.

The cluster: one `cakemp run --gpus cpu:2` node serving model.layers.1-3 and 5 of the synthetic checkpoint,
made with a context of 131,072 positions (so a 1 MiB prompt of words is tokenized before it is refused)
and a chat template that loops forever, or asks for gigabytes, when the last message says so.
The server: --max-tokens 24, --max-body-kib 2048, --chat-template-seconds 4.
"""

import json
import os
import re
import socket
import threading
import urllib.request
from pathlib import Path

import openai
import pytest

from cakemp.demo.synthetic import SyntheticSpec, write_checkpoint
from tests.master.chat_templates import CHATML, with_template
from tests.master.test_serve import node  # noqa: F401  (the module's node, over this module's model)
from tests.support.node import LoggedProcess, gone, scrape

MODEL_ID = "tiny-chat"
CONTEXT = 1 << 17
MAX_TOKENS = 24
GREEDY = {"temperature": 0, "max_tokens": 20}
REFUSED = ("cakemp_serve_errors_total", (("status", "400"),))
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
# The hostile branches depend on the messages, so that jinja cannot fold them into constants at compile time.
HOSTILE = ("{% if messages[-1].content == 'loop' %}{% for a in range(100000) %}{% for b in range(100000) %}"
           "{% endfor %}{% endfor %}{% elif messages[-1].content == 'explode' %}"
           "{{ 'x' * (messages[-1].content | length * 2 ** 30) }}{% elif messages[-1].content == 'long' %}"
           "{{ 'x' * (messages[-1].content | length * 2 ** 22) }}{% endif %}" + CHATML)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    base = tmp_path_factory.mktemp("base") / "ckpt"
    base.mkdir()
    write_checkpoint(base, SyntheticSpec(max_position_embeddings=CONTEXT))
    return with_template(base, tmp_path_factory.mktemp("chat") / MODEL_ID, HOSTILE, in_jinja_file=True)


@pytest.fixture(scope="module")
def server(model, node):  # noqa: F811
    serving = LoggedProcess(["serve", "--model", str(model), "--topology", str(node.topology), "--dtype", "f32",
                             "--address", "127.0.0.1:0", "--repeat-penalty", "1", "--max-tokens", str(MAX_TOKENS),
                             "--max-body-kib", "2048", "--chat-template-seconds", "4", "--log-format", "json"],
                            ready="api listening")
    yield serving
    assert serving.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(client):
    """The bystander's greedy answer, asked alone."""
    return client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, **GREEDY).choices[0].message.content


@pytest.fixture(scope="module")
def expected_raw(client):
    """The greedy continuation of the raw prompt, asked alone."""
    return client.completions.create(model=MODEL_ID, prompt="Once upon a time", **GREEDY).choices[0].text


def send(server, path, body: bytes) -> socket.socket:
    """A connection that has sent one whole POST of `body` (its answer left unread)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (path.encode(), len(body), body))
    return sock


def answer(sock) -> tuple[int, dict]:
    """The status and JSON body of the answer on `sock` (the server closes it after)."""
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def answered(sock) -> bool:
    """Whether the server has begun to answer on `sock`."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)


def stream_text(client) -> str:
    chunks = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True, **GREEDY)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def health(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=60) as response:
        return json.loads(response.read())["status"]


def test_long_prompts_are_tokenized_off_the_event_loop(client, server, expected):
    """Eight 1 MiB prompts (about a second of tokenizing each) are all sent; meanwhile another client's
    streamed greedy answer and /health come whole, before the last of the eight is answered (tokenizing on
    the event loop, the stream would wait behind every one). Each of the eight gets the 400 the context
    check gives; a 1.5 MiB prompt, more bytes than the context's tokens can stand for, gets it untokenized."""
    prompt = json.dumps({"model": MODEL_ID, "prompt": "many words in a row " * ((1 << 20) // 20)}).encode()
    senders = []
    attackers = []
    for _ in range(8):
        senders.append(threading.Thread(target=lambda: attackers.append(send(server, "/v1/completions", prompt))))
        senders[-1].start()
    for sender in senders:
        sender.join()
    assert stream_text(client) == expected and health(server) == "ok"
    assert not all(answered(sock) for sock in attackers)
    for status, body in map(answer, attackers):
        assert (status, body["error"]["code"]) == (400, "context_length_exceeded")
        assert "tokens; this model's context is 131072" in body["error"]["message"]
    longer = json.dumps({"model": MODEL_ID, "prompt": "x" * (3 << 19)}).encode()
    status, body = answer(send(server, "/v1/completions", longer))
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded")
    assert body["error"]["message"].startswith("the prompt is 1572864 bytes, more than this model's context")


@pytest.mark.parametrize("trigger, refusal", [
    ("loop", "the chat template took longer than 4 s on these messages"),
    ("explode", "the chat template ran out of its 512 MiB on these messages"),
    ("long", "the chat template rendered more than 8388608 bytes for these messages")])
def test_a_chat_template_that_loops_or_explodes_is_stopped(client, server, expected, expected_raw, trigger, refusal):
    """A chat whose template loops (a hundred thousand squared iterations), asks for gigabytes or renders
    megabytes is stopped: a 400 saying which, while /health and another client's completion (raw, no
    template) are answered before it; the next chat is rendered, with the greedy answer."""
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": trigger}]}).encode()
    hostile = send(server, "/v1/chat/completions", body)
    assert health(server) == "ok"
    assert trigger != "loop" or not answered(hostile)
    assert client.completions.create(model=MODEL_ID, prompt="Once upon a time", **GREEDY).choices[0].text \
        == expected_raw
    status, answer_body = answer(hostile)
    assert (status, answer_body["error"]["message"], answer_body["error"]["param"]) == (400, refusal, "messages")
    assert client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, **GREEDY).choices[0].message.content \
        == expected



def test_chats_waiting_behind_a_slow_template_hold_no_ones_tokens(client, server, expected, expected_raw):
    """More looping chats than the server's default thread pool has threads (its step loop computes there)
    wait for the one template child: another client's completion (raw, no template) still gets its greedy
    answer before any of them is answered (rendered in that pool, the waiting chats held every thread and
    the completion's steps waited for three renderings). Their clients then leave: the renderings still
    waiting are dropped, not run (each would cost 4 s): none of them is counted as a 400 before another
    client's chat is rendered and answered; the server keeps one child and no zombie."""
    threads = min(32, os.cpu_count() + 4)  # ThreadPoolExecutor's default, as asyncio's default executor has it
    refusals_before = scrape(server.port).get(REFUSED, 0)
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "loop"}]}).encode()
    hostile = [send(server, "/v1/chat/completions", body) for _ in range(threads + 2)]
    assert client.completions.create(model=MODEL_ID, prompt="Once upon a time", **GREEDY).choices[0].text \
        == expected_raw
    assert not any(answered(sock) for sock in hostile)
    for sock in hostile:
        sock.close()
    assert client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, **GREEDY).choices[0].message.content \
        == expected
    assert scrape(server.port).get(REFUSED, 0) - refusals_before <= 1  # at most the one rendering when they left
    pid = server.process.pid  # its children, a zombie included, under each thread that started one
    (child,) = {int(c) for task in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()}
    assert not gone(child)


def refused(client, **kwargs) -> tuple[int, str | None]:
    """The status and param of the 400 a chat completion with `kwargs` gets."""
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": MODEL_ID, "messages": MESSAGES, **kwargs})
    return error.value.status_code, error.value.body["param"]


def test_max_tokens_past_the_servers_is_refused(client, expected):
    """--max-tokens is a cap: a request asking one token more gets 400 (max_tokens), as OpenAI and vLLM refuse
    what they would not generate, while another client's stream goes on with the greedy answer; a request
    asking exactly the cap is served."""
    stream = iter(client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True, **GREEDY))
    assert next(stream).choices[0].delta.role == "assistant"
    assert refused(client, max_tokens=MAX_TOKENS + 1) == (400, "max_tokens")
    assert refused(client, max_completion_tokens=MAX_TOKENS + 1) == (400, "max_tokens")
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    capped = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    assert capped.usage.completion_tokens <= MAX_TOKENS and capped.choices[0].message.content.startswith(expected)


def test_temperature_and_top_p_are_held_to_openais_ranges(client, expected):
    """temperature 0 and 2 and top_p just above 0 and 1 are served; temperature -0.0001 and 2.0001, top_p 0,
    -0.0001 and 1.0001 get 400 naming the field, while another client's stream goes on with the greedy answer."""
    stream = iter(client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True, **GREEDY))
    assert next(stream).choices[0].delta.role == "assistant"
    assert [refused(client, temperature=t) for t in (-0.0001, 2.0001)] == [(400, "temperature")] * 2
    assert [refused(client, top_p=p) for p in (0, -0.0001, 1.0001)] == [(400, "top_p")] * 3
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    for sampling in ({"temperature": 0}, {"temperature": 2}, {"top_p": 1e-9}, {"top_p": 1}):
        answer = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2, seed=1, **sampling)
        assert answer.usage.completion_tokens >= 1


def test_a_lone_surrogate_is_a_400_and_no_error(client, server, expected):
    """A prompt or a message holding a lone surrogate ("\\ud800" in the JSON, which Python reads as a str no
    tokenizer takes) gets 400 naming the field, with no error-level line in the server's log, while another
    client's stream goes on with the greedy answer."""
    mark = server.mark()
    stream = iter(client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True, **GREEDY))
    assert next(stream).choices[0].delta.role == "assistant"
    prompt = b'{"model": "%s", "prompt": "abc\\ud800def"}' % MODEL_ID.encode()
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": "abc\\udfffdef"}]}' % MODEL_ID.encode()
    answers = [answer(send(server, "/v1/completions", prompt)), answer(send(server, "/v1/chat/completions", chat))]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    assert [(status, body["error"]["param"]) for status, body in answers] == \
        [(400, "prompt"), (400, "messages[0].content")]
    assert all("not valid Unicode" in body["error"]["message"] for _, body in answers)
    assert not [e for e in server.events(mark) if e.get("level") == "error"]


def test_a_502_names_no_worker_and_the_log_has_why(client, server, node, expected):  # noqa: F811
    """With the node stopped behind the server, a request gets 502 (cluster_error) whose message names
    neither the worker's address nor its error, only the request's id; the server's log has an error-level
    line under that id saying which worker and what failed. /health answers meanwhile, and once the node is
    back the next request gets the greedy answer."""
    assert node.running.stop() == 0
    mark = server.mark()
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, **GREEDY)
    message = failed.value.body["message"]
    assert (failed.value.status_code, failed.value.body["code"]) == (502, "cluster_error")
    assert "127.0.0.1" not in message and str(node.port) not in message
    request_id = re.search(r"chatcmpl-[0-9a-f]{32}", message).group()
    logged = server.wait_for(lambda e: e.get("event") == "request failed at the cluster", after=mark)
    assert (logged["level"], logged["request"]) == ("error", request_id)
    assert f"127.0.0.1:{node.port}" in logged["error"]
    assert health(server) == "ok"
    node.start()
    assert client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, **GREEDY).choices[0].message.content \
        == expected
