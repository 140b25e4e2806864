"""`cakemp serve` running requests at once, over a live `cakemp run --gpus cpu:2` node, driven by the
official `openai` client from several threads.

The cluster is test_serve.py's (the node serves model.layers.1-3 and 5, the master keeps 0 and 4), the
server runs with --max-concurrent 8 --max-waiting 2. A second server keeps every layer itself. The
checkpoint is synthetic and computes in f32.

Near-ties: batched rounding (the node's and the master's GEMMs over several sessions' rows at once)
moves a logit by a few f32 units (tests/support/tolerance.py's F32 bound), so a greedy token could only
differ where its top two logits are that close. `greedy_margins` measures, for every prompt, the gap
between the two largest logits at each step of the lone greedy generation, in-process through the same
node, and the tests assert each gap is far above the bound before comparing texts: a near-tie would be
named, not silently compared.
"""

import asyncio
import json
import socket
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import yaml

from cakemp.cli import DEFAULT_SYSTEM_PROMPT
from cakemp.master.connections import DIALS_AT_ONCE, ConnectionPool, Dialer
from cakemp.master.generator import Generator
from cakemp.master.sampler import SamplingParams
from cakemp.master.step_loop import LayerRun, SequenceState, StepLoop
from cakemp.topology import Topology
from cakemp.wire import DType
from tests.master.test_serve import DEVICES, MODEL_ID, NODE_LAYERS, Node, model  # noqa: F401  (the module's checkpoint)
from tests.support.distance import Distance
from tests.support.node import LoggedProcess, samples, scrape, wait_until, waiting
from tests.support.tolerance import F32_REL

STEPS = 16
GREEDY = {"temperature": 0, "max_tokens": STEPS}
QUESTIONS = [f"Question number {i}: what comes next?" for i in range(8)]
CONCURRENT = 8


def chat(content):
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": content}]


@pytest.fixture(scope="module")
def node(model, tmp_path_factory):  # noqa: F811
    node = Node(model, tmp_path_factory.mktemp("node"))
    yield node
    assert node.running.stop() == 0


def start_server(model, *args):  # noqa: F811
    return LoggedProcess(["serve", "--model", str(model), "--dtype", "f32", "--address", "127.0.0.1:0",
                          "--repeat-penalty", "1", "--log-format", "json", *args], ready="api listening")


@pytest.fixture(scope="module")
def server(model, node):  # noqa: F811
    serving = start_server(model, "--topology", str(node.topology), "--max-concurrent", str(CONCURRENT),
                           "--max-waiting", "2")
    yield serving
    assert serving.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=120)


def answer(client, question, stream=False, **kwargs):
    """The text of a chat completion, streamed or not."""
    kwargs = {**GREEDY, **kwargs}
    if not stream:
        return client.chat.completions.create(model=MODEL_ID, messages=chat(question), **kwargs).choices[0].message.content
    chunks = client.chat.completions.create(model=MODEL_ID, messages=chat(question), stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def at_once(calls):
    """Each call's result, the calls made from their own threads, released together."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def serve_metrics(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
        return samples(response.read().decode())


def in_flight(server):
    metrics = serve_metrics(server)
    return metrics[("cakemp_serve_requests_running", ())], metrics[("cakemp_serve_requests_waiting", ())]


def greedy_margins(model, topology, questions):  # noqa: F811
    """Per question, the smallest gap between the two largest logits over its lone greedy steps, relative to
    the largest logit's magnitude (what a relative rounding of the hidden state moves them by)."""
    async def go():
        async with await Generator.open(model, topology, dtype="f32") as generator:
            margins = []
            for question in questions:
                prompt = generator.chat.encode(chat(question))
                tokens = (await generator.generate(prompt, STEPS, SamplingParams(temperature=0, repeat_penalty=1)))
                ids, gaps = list(prompt), []
                for token in tokens.tokens:
                    hidden = await _hidden(generator, ids)
                    logits = generator.head.logits(hidden)
                    top = torch.topk(logits, 2).values
                    gaps.append(float(top[0] - top[1]) / float(logits.abs().max()))
                    ids.append(token)
                margins.append(min(gaps))
            return margins

    return asyncio.run(go())


async def _hidden(generator, ids):
    """The last layer's output [1, T, H] for `ids` from position 0, as one lone step (then Goodbye)."""
    trace = []
    await generator.generate(ids, 1, SamplingParams(temperature=0, repeat_penalty=1), trace=trace)
    return trace[-1].y  # the topology's last run is the node's


def test_eight_concurrent_greedy_answers_equal_each_alone(client, model, node):  # noqa: F811
    """8 requests at once, half of them streamed, each answer what the same request gets alone; where a
    lone step's two best logits are within two f32 evaluations' bound of each other (a near-tie batched
    rounding may move), the answer is not compared, and most must not be."""
    alone = [answer(client, q) for q in QUESTIONS]
    together = at_once([lambda q=q, i=i: answer(client, q, stream=i % 2 == 1) for i, q in enumerate(QUESTIONS)])
    clear = [m > 2 * F32_REL for m in greedy_margins(model, Topology.load(node.topology), QUESTIONS)]
    assert sum(clear) >= 6, clear
    assert [t for t, c in zip(together, clear) if c] == [a for a, c in zip(alone, clear) if c]
    assert len(set(alone)) > 1  # the prompts lead to different answers: a mix-up between sessions would show


def test_seeded_sampling_is_the_same_alone_and_concurrent(client):
    """Each request's own seed, temperature and top_p give it the same text alone and among 7 others."""
    sampling = [{"temperature": 0.9, "top_p": 0.95, "seed": 100 + i, "max_tokens": STEPS} for i in range(8)]
    alone = [answer(client, q, **s) for q, s in zip(QUESTIONS, sampling)]
    together = at_once([lambda q=q, s=s, i=i: answer(client, q, stream=i % 2 == 0, **s)
                        for i, (q, s) in enumerate(zip(QUESTIONS, sampling))])
    assert together == alone


def read_some(stream, pieces=3):
    chunks = iter(stream)
    for _ in range(pieces):
        next(chunks)
    return chunks


def test_leaving_mid_stream_and_refused_or_gone_mid_queue_leave_the_others_answered(client, server, node):
    """8 long streams hold every place and 2 requests wait: the next is refused with 503; a waiting client
    that leaves, and a stream whose client leaves, free their places within a step, so the short requests
    queued behind get them and are answered as alone; then nothing runs or waits, on the server or node."""
    expected = answer(client, QUESTIONS[0])
    streams = [client.chat.completions.create(model=MODEL_ID, messages=chat(q), stream=True, temperature=0,
                                              max_tokens=1500) for q in QUESTIONS]
    for stream in streams:
        read_some(stream)
    wait_until(lambda: in_flight(server) == (8, 0), what="eight streams running")
    with ThreadPoolExecutor(3) as pool:
        queued = [pool.submit(answer, client, QUESTIONS[0]) for _ in range(2)]
        wait_until(lambda: in_flight(server) == (8, 2), what="two requests waiting")
        with pytest.raises(openai.APIStatusError) as refused:
            answer(client, QUESTIONS[0])
        streams[0].close()  # a place frees: the first waiting request runs
        streams[1].close()
        assert [q.result(timeout=120) for q in queued] == [expected, expected]
    for stream in streams[2:]:
        stream.close()
    assert refused.value.status_code == 503
    wait_until(lambda: in_flight(server) == (0, 0), what="every request gone")
    wait_until(lambda: all(waiting(scrape(node.running.metrics_port()), d) == 0 for d in DEVICES),
               what="nothing waiting on the node")


def test_a_running_stream_shows_its_first_token_and_token_latencies_in_metrics(client, server):
    """While a long stream still runs, /metrics has observed its time to first token and the latencies of
    the tokens read so far: they are observed as each token is sampled, not once the request ends."""
    def counts():
        metrics = serve_metrics(server)
        return (metrics.get(("cakemp_serve_time_to_first_token_seconds_count", ()), 0.0),
                metrics.get(("cakemp_serve_token_latency_seconds_count", ()), 0.0),
                metrics[("cakemp_serve_completion_tokens_total", ())])

    first_before, later_before, tokens_before = counts()
    stream = client.chat.completions.create(model=MODEL_ID, messages=chat(QUESTIONS[0]), stream=True,
                                            temperature=0, max_tokens=1500)
    read_some(stream, pieces=4)  # the role chunk, then three tokens' text
    first, later, tokens = counts()
    assert in_flight(server) == (1, 0)  # it still runs
    stream.close()
    assert first - first_before == 1
    assert later - later_before >= 2
    assert tokens - tokens_before >= 3
    metrics = serve_metrics(server)
    parts = sum(metrics[(f"cakemp_serve_{part}_seconds_total", ())] for part in ("local_layers", "head", "workers"))
    assert metrics[("cakemp_serve_steps_total", ())] >= 3
    assert 0 < parts <= metrics[("cakemp_serve_loop_seconds_total", ())]  # the step loop's parts of its time


def test_isolation_keys_keep_prefix_reuse_within_one_user(client, node):
    """A prompt a user sent is reused on the node by that user's next request only: not by another user
    (another cache_salt), nor by requests naming no key (the server does not share across clients)."""
    def reused():
        metrics = scrape(node.running.metrics_port())
        return sum(metrics.get(("cakemp_prefix_reused_tokens_total", (("device", d),)), 0.0) for d in DEVICES)

    question = "A secret system prompt and question"
    answer(client, question, user="alice")
    before = reused()
    answer(client, question, user="bob")
    answer(client, question, extra_body={"cache_salt": "mallory"})
    answer(client, question)
    answer(client, question)
    assert reused() == before
    answer(client, question, user="alice")
    assert reused() - before >= 16


def test_a_worker_restarted_under_load_fails_its_requests_and_the_next_are_answered(client, server, node):
    """Streams running when the node stops fail (502 or an error event); once it is back, 8 requests at once
    are answered as alone, and the server's running and waiting return to zero."""
    expected = [answer(client, q) for q in QUESTIONS]
    streams = [client.chat.completions.create(model=MODEL_ID, messages=chat(q), stream=True, temperature=0,
                                              max_tokens=1500) for q in QUESTIONS[:4]]
    chunks = [read_some(stream) for stream in streams]
    assert node.running.stop() == 0
    for stream in chunks:
        with pytest.raises(openai.APIError):  # the stream ends with an error event, which the client raises
            for _ in stream:
                pass
    node.start()
    wait_until(lambda: in_flight(server) == (0, 0), what="the failed requests gone")
    assert at_once([lambda q=q: answer(client, q) for q in QUESTIONS]) == expected
    assert in_flight(server) == (0, 0)
    assert serve_metrics(server)[("cakemp_serve_errors_total", (("status", "502"),))] >= 4


def test_health_answers_during_an_all_local_generation(model):  # noqa: F811
    """With every layer computed by the server itself, /health answers while a long stream is generated,
    and the stream then goes on: the step's compute runs off the event loop."""
    serving = start_server(model)
    try:
        local = openai.OpenAI(base_url=f"http://127.0.0.1:{serving.port}/v1", api_key="unused", max_retries=0)
        stream = local.chat.completions.create(model=MODEL_ID, messages=chat(QUESTIONS[0]), stream=True,
                                               temperature=0, max_tokens=1500)
        chunks = read_some(stream)
        with urllib.request.urlopen(f"http://127.0.0.1:{serving.port}/health", timeout=30) as response:
            assert json.loads(response.read())["requests"] == 1
        next(chunks)  # the stream still runs after /health answered
        stream.close()
    finally:
        assert serving.stop() == 0


def test_running_streams_step_on_while_another_request_dials(model, node, tmp_path):  # noqa: F811
    """A server (--max-concurrent 2) reaching the node through a door that holds new connections: a request
    naming no user, whose set must be dialed (both sets last served users), waits while its dial is held,
    counted as waiting; meanwhile a stream on the set its user last had runs to its end; released, the
    dialed request is answered, each as alone. A request whose client leaves while its dial is held is
    gone at once, and its place is free again: two streams then run at once."""
    topology = tmp_path / "through-the-door.yml"
    with Distance(node.port, "127.0.0.1", 0) as door, ThreadPoolExecutor(1) as pool:
        topology.write_text(yaml.safe_dump({"worker": {"host": f"127.0.0.1:{door.port}", "layers": NODE_LAYERS}}))
        serving = start_server(model, "--topology", str(topology), "--max-concurrent", "2")
        try:
            # A limit for a stream that would otherwise wait for the held dial for as long as it is held.
            near = openai.OpenAI(base_url=f"http://127.0.0.1:{serving.port}/v1", api_key="unused", max_retries=0,
                                 timeout=30)
            alone = [answer(near, q) for q in QUESTIONS[:2]]
            for user in ("alice", "bob"):  # a raw prompt: no 16 rows in common with a chat's, so nothing reused
                near.completions.create(model=MODEL_ID, prompt="Zebra crossing", max_tokens=1, user=user)
            door.hold()
            dialed = pool.submit(answer, near, QUESTIONS[1])  # in place of alice's set, the least recent
            wait_until(lambda: door.held == 1, what="the dial held at the door")
            stream = near.chat.completions.create(model=MODEL_ID, messages=chat(QUESTIONS[0]), stream=True,
                                                  user="bob", **GREEDY)
            pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
            assert door.held == 1  # the whole stream came while the other request's dial was held
            assert in_flight(serving) == (0, 1)
            door.release()
            assert [dialed.result(timeout=60), "".join(pieces)] == alone[::-1]
            assert len(pieces) >= STEPS // 2

            door.hold()
            leaving = post_unread(serving, {"model": MODEL_ID, "messages": chat(QUESTIONS[0]), **GREEDY})
            wait_until(lambda: door.held == 1 and in_flight(serving) == (0, 1), what="a request dialing")
            leaving.close()
            wait_until(lambda: in_flight(serving) == (0, 0), what="the leaving request gone")
            assert door.held == 1
            door.release()
            streams = [near.chat.completions.create(model=MODEL_ID, messages=chat(q), stream=True, temperature=0,
                                                    max_tokens=1500) for q in QUESTIONS[:2]]
            for each in streams:
                read_some(each)
            assert in_flight(serving) == (2, 0)
            for each in streams:
                each.close()
        finally:
            door.release()  # before the pool's thread is waited for
            assert serving.stop() == 0


def post_unread(server, body):
    """A connection that has sent one whole chat completion request of `body` (its answer left unread)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_at_most_four_sets_are_dialed_at_once_however_many_requests_may_run(node):
    """A pool of 8 sets, every one to dial, behind a door that holds new connections: 8 requests naming
    8 users take their places at once, and 4 dials reach the door (each dial has one connection in its
    handshake at a time), never more; released, all 8 sets are dialed and said Hello."""

    async def main(door):
        pool = ConnectionPool(Dialer(), [(1, f"127.0.0.1:{door.port}")], size=8)
        door.hold()
        taking = [pool.take(("user", str(i))) for i in range(8)]
        await asyncio.to_thread(wait_until, lambda: door.held >= DIALS_AT_ONCE, what="four dials at the door")
        most = max([door.held] + [await asyncio.sleep(0.05) or door.held for _ in range(20)])
        door.release()
        sets = await asyncio.wait_for(asyncio.gather(*taking), 60)
        for connections in sets:
            await pool.give_back(connections, broken=False)
        await pool.close()
        return most, len(sets)

    with Distance(node.port, "127.0.0.1", 0) as door:
        most, dialed = asyncio.run(main(door))
    assert (most, dialed) == (DIALS_AT_ONCE, 8)


def test_a_request_whose_client_left_before_it_had_a_place_takes_none_and_dials_nothing(node):
    """The step loop is handed a request whose client has already left (its `halt` set) while the pool
    has a place free and a set to dial for its user: the request ends without taking the place, and no
    dial begins (the door, holding new connections, sees none; the pool's place stays free)."""

    async def main(door):
        host = f"127.0.0.1:{door.port}"
        pool = ConnectionPool(Dialer(), [(1, host)], size=1)
        ended = []
        loop = StepLoop(None, None, [LayerRun(host, (("model.layers.1", 1),))], pool, frozenset(), DType.F32,
                        ended.append)
        door.hold()
        halt = asyncio.Event()
        halt.set()
        gone = SequenceState((1, 2, 3), 4, None, None, ("user", "gone"), halt=halt)
        loop.submit(gone)
        await asyncio.wait_for(loop.close(), 10)
        free = pool.free
        door.release()
        await pool.close()
        return ended == [gone], free, door.held

    with Distance(node.port, "127.0.0.1", 0) as door:
        assert asyncio.run(main(door)) == (True, True, 0)


def test_a_spray_of_one_shot_users_leaves_a_returning_user_its_set(node):
    """A pool of 8 sets: alice's request comes back and reuses her set; then 200 requests, three at a time,
    each naming a new user, close and dial sets, while alice comes back after every 20 of them: she gets
    her own set every time (its worker sessions, and the prefixes they keep, intact). A user whose set was
    closed for others' and who comes back counts as returning from then on. (Before, each one-shot user
    closed the least recently used set, whoever's, and alice's was gone after a few.)"""

    async def main():
        pool = ConnectionPool(Dialer(), [(1, f"127.0.0.1:{node.port}")], size=8)
        await pool.open()

        async def request(key):
            connections = await pool.take(key)
            await pool.give_back(connections, broken=False)
            return connections

        async def spray(name: str, count: int, alice_every: int | None = None) -> list:
            """`count` one-shot users, three at a time; alice after every `alice_every` of them."""
            alices = []
            for start in range(0, count, 3):
                await asyncio.gather(*(request((f"{name}-{i}", "")) for i in range(start, min(start + 3, count))))
                if alice_every is not None and (start + 3) % alice_every == 0:
                    alices.append(await request(("alice", "")))
            return alices

        alice = await request(("alice", ""))
        got = [await request(("alice", ""))] + await spray("once", 200, 21)
        # bob's set is closed by a spray; once he is back, he keeps his next one.
        bob = await request(("bob", ""))
        await spray("twice", 30)
        bob_again = await request(("bob", ""))
        await spray("thrice", 30)
        bob_kept = await request(("bob", ""))
        await pool.close()
        return [each is alice for each in got], bob_again is not bob, bob_kept is bob_again

    kept, bob_redialed, bob_kept = asyncio.run(main())
    assert kept == [True] * len(kept) and len(kept) == 10
    assert bob_redialed and bob_kept
