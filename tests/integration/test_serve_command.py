"""`pdserve serve` as a user runs it: a subprocess that starts its own local Ray cluster and Serve,
then the real `openai` client, a real gRPC client, curl's SSE stream and `pdserve status` against it.
Disaggregated (1 prefill + 1 decode over gloo), with an API key, two router replicas on one port."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtransfer.netaddr import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key"


class Server:
    def __init__(self, ignore_sigint: bool = False, num_router_replicas: int = 2) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PDSERVE_API_KEY": KEY}
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--prefill", "1", "--decode", "1", "--transport", "gloo",
               "--device", "cpu", "--num-blocks", "512", "--block-size", "8",
               "--port", str(self.port), "--grpc-port", str(self.grpc_port), "--exit-after", "600",
               "--num-router-replicas", str(num_router_replicas), "--slo-ttft-ms", "60000"]
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, preexec_fn=ignore)
        self.output: list[str] = []
        deadline = time.monotonic() + 240
        assert self.proc.stdout is not None
        self.ray_address = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            if line.strip().startswith("Ray "):
                self.ray_address = line.split()[1]
            if "gRPC " in line:
                return
        self.stop()
        raise AssertionError("pdserve serve did not come up:\n" + "".join(self.output[-40:]))

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 180 s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(180)  # NOTE: its Serve and Ray shutdown, beside other servers, on 2 busy cores
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # It starts a Ray cluster of its own ("local"), beside any other. NOTE: its ports are free when
    # drawn, but Ray's own processes draw from the same range meanwhile: one that took the HTTP port
    # first ("Failed to bind", seen once in a full run) gets a second start on new ports.
    try:
        s = Server()
    except AssertionError as err:
        if "Failed to bind" not in str(err):
            raise
        s = Server()
    yield s
    # SIGTERM, whose handler Ray's start replaces with one that aborts the process, stops the server
    # cleanly (exit code 0, its Ray cluster gone): checked here, on the module's server, at its end.
    assert s.stop() == 0, "".join(s.output[-40:])


def test_openai_client_completions_and_chat(server):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=60)
    whole = client.completions.create(model="default", prompt="def main():", max_tokens=12, temperature=0)
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    stream = client.completions.create(model="default", prompt="def main():", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0)
    assert chat.usage.completion_tokens == 6 and chat.choices[0].message.role == "assistant"
    chat_stream = list(client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or ""
                   for c in chat_stream if c.choices) == chat.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="default", prompt="x", max_tokens=0)
    # the next good request is served
    assert client.completions.create(model="default", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_http_and_grpc_listen_on_loopback_only(server):
    """The default --host 127.0.0.1 holds for every port (Serve's own gRPC proxy would bind every
    interface, '[::]:port'; router/grpc_server.py binds the host), and --port is served by the router
    replicas themselves, both of them, Serve's proxy on a port of its own."""
    import psutil

    http_line = next(line for line in server.output if line.strip().startswith("HTTP "))
    assert "served by 2 router replicas" in http_line, http_line
    proxy_port = int(http_line.split("Serve's proxy also on :")[1].split(")")[0])
    ports = (server.port, server.grpc_port, proxy_port)
    listening: dict[int, set[tuple[str, int | None]]] = {}  # port -> (address, pid) of each listener
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports:
            listening.setdefault(conn.laddr.port, set()).add((conn.laddr.ip.removeprefix("::ffff:"), conn.pid))
    # NOTE: ours are the processes on 127.0.0.1:port; another process may hold the same number on another
    # address (a Ray process on the node's address once did, in CI), which is not a port of this server.
    ours = {port: {pid for ip, pid in listening.get(port, ()) if ip == "127.0.0.1"} for port in ports}
    assert all(ours.values()), listening
    assert not [(port, ip) for port in ports for ip, pid in listening[port] if ip != "127.0.0.1"
                and (pid in ours[port] or ip in ("0.0.0.0", "::"))], listening
    # --port is the router replicas' own servers (no proxy hop); the proxy listens elsewhere.
    assert any("Router" in psutil.Process(pid).name() for pid in ours[server.port] if pid), ours
    pids = ours[server.port] | ours[server.grpc_port]
    assert len(pids) == 2, pids  # each router replica listens on both ports


def test_new_connections_reach_both_router_replicas(server):
    """The kernel spreads new connections to --port over the replicas (SO_REUSEPORT); /health names the
    replica that answered. 24 connections all on one of two replicas: odds 2 in 2^24 if spread evenly."""
    import urllib.request

    routers = set()
    for _ in range(24):  # NOTE: urllib opens a new connection each time
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as reply:
            routers.add(json.loads(reply.read())["router"])
    assert len(routers) == 2 and all(r.startswith("router-") for r in routers), routers


def test_metrics_count_both_router_replicas_whichever_answers(server):
    """A scrape of --port reaches one replica; it answers with both replicas' counts (router/metrics_share.py):
    every scrape shows the same total, that of all the requests, on new connections spread over both."""
    import urllib.request

    headers = {"Authorization": f"Bearer {KEY}"}

    def finished() -> float:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as reply:
            text = reply.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdserve:request_success_total{"))

    time.sleep(1.5)  # NOTE: a replica that answers no scrape publishes its counts every second
    before = {finished() for _ in range(6)}
    assert len(before) == 1, before
    body = json.dumps({"model": "default", "prompt": "import os", "max_tokens": 2}).encode()
    for _ in range(8):  # NOTE: urllib opens a new connection each time: 2 in 2^8 that all reach one replica
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", data=body,
                                         headers={**headers, "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.status == 200
    time.sleep(1.5)
    after = [finished() for _ in range(8)]
    assert after == [before.pop() + 8] * 8, after


def test_grpc_streaming_client_with_reflection(server):
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from router.proto import pdserve_pb2 as pb
    from router.proto import pdserve_pb2_grpc as pbg

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "pdserve.v1.Generation" in services
    stub = pbg.GenerationStub(channel)
    metadata = (("authorization", f"Bearer {KEY}"),)
    request = pb.GenerateRequest(text="def main():", sampling=pb.SamplingOptions(max_tokens=12, temperature=0))
    parts = list(stub.Generate(request, metadata=metadata, timeout=60))
    assert parts[-1].finish_reason == "length" and parts[-1].usage.completion_tokens == 12
    assert sum(len(p.token_ids) for p in parts) == 12
    whole = stub.Complete(request, metadata=metadata, timeout=60)
    assert whole.text == "".join(p.text for p in parts)
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(request, timeout=60)  # no key
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    bad = pb.GenerateRequest(text="x", sampling=pb.SamplingOptions(max_tokens=4, temperature=-1))
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(bad, metadata=metadata, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_sse_stream_and_status(server, tmp_path):
    body = json.dumps({"model": "default", "prompt": "import os", "max_tokens": 5, "stream": True})
    out = subprocess.run(
        ["curl", "-sN", "-m", "60", f"http://127.0.0.1:{server.port}/v1/completions",
         "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {KEY}", "-d", body],
        capture_output=True, text=True, timeout=90, check=True,
    ).stdout
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["object"] for e in events[:-1]] == ["text_completion"] * (len(events) - 1)
    trace = tmp_path / "trace.json"
    status = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--address", server.ray_address,
                             "--trace", str(trace)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "prefill-0" in status.stdout and "decode-0" in status.stdout
    # --trace writes the autoscaler's readings: none here (no autoscaler; tests/integration/test_autoscaler.py
    # reads some)
    assert json.loads(trace.read_text()) == [] and "autoscaler readings: 0 written" in status.stdout
    assert "engine of decode-0: weights float32, KV cache float32" in status.stdout, status.stdout
    assert " INFO " not in status.stderr and "object at 0x" not in status.stderr, status.stderr  # a table only
    # The router replicas reached the decode worker over the request channel (protocol/channel.py),
    # not through Ray calls: the worker counts the routers connected (each replica opens its own channel
    # when it first calls the worker: one or both, as the connections fell).
    header, *rows = status.stdout.splitlines()
    decode_row = next(row.split() for row in rows if row.startswith("decode-0"))
    assert header.split()[-2] == "channels" and decode_row[-2] in ("1", "2"), status.stdout
    # its longest recent step and collector pause, as milliseconds
    assert header.split()[-6:-1] == ["step", "max", "gc", "max", "channels"], status.stdout
    assert re.fullmatch(r"\d+ms", decode_row[-4]) and re.fullmatch(r"\d+ms", decode_row[-3]), status.stdout
    # the routers tell the controller their first tokens against the TTFT SLO with each poll (the autoscaler's;
    # how many are in the window depends on how long this status call took to connect)
    assert re.search(r"first tokens over the routers' last 10 s: \d+, 0 of them later than the TTFT SLO",
                     status.stdout), status.stdout


def test_a_long_prompt_goes_through_the_prefill_worker_over_its_channel(server):
    """A prompt past DispatcherConfig.local_prefill's short-prompt bound is prefilled on prefill-0,
    which the router reaches over its request channel (the decode worker named in the call goes as
    a pickled Ray handle); the greedy text equals the offline engine's."""
    import random

    import openai

    from engine import LLM, SamplingParams

    rng = random.Random(11)
    prompt = [rng.randrange(4, 2000) for _ in range(240)]  # > max_short_prompt_tokens (192)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=60)
    served = client.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0)
    offline = LLM(device="cpu").generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    assert served.choices[0].text == offline.outputs[0].text and served.usage.prompt_tokens == 240
    status = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--address", server.ray_address], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    header, *rows = status.stdout.splitlines()
    assert header.split()[-2] == "channels", status.stdout
    channels = {row.split()[0]: row.split()[-2] for row in rows if row.strip()}  # routers connected to each
    # NOTE: a router replica opens a worker's channel when it first calls it: the one that served this
    # prompt at least
    assert channels.get("prefill-0") in ("1", "2") and channels.get("decode-0") in ("1", "2"), status.stdout


def test_sigint_stops_a_server_started_with_sigint_ignored(server):
    """A background job of a non-interactive script inherits SIGINT as ignored; the server installs
    its own handler, so SIGINT still stops it, and cleanly (exit code 0, its Ray cluster gone). SIGTERM
    is checked on the module's server when it stops (the fixture)."""
    del server  # NOTE: after the module's server is up: one Ray start at a time on a 2-core machine
    s = Server(ignore_sigint=True, num_router_replicas=1)  # NOTE: the fewest processes beside the module's server
    try:
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(180) == 0  # NOTE: its Serve and Ray shutdown, beside the module's server, on 2 busy cores
    finally:
        s.stop()


def test_start_up_prints_pdserves_banner_alone(server):
    """Ray's and Serve's own start-up lines (token auth, "ready at" Serve's proxy port...) stay out:
    what serves where is the banner's to say."""
    start = next(i for i, line in enumerate(server.output) if line.startswith("pdserve: serving"))
    noise = [line for line in server.output[:start] if " INFO " in line or "WARNING" in line]
    assert not noise, "".join(server.output[: start + 4])
    assert any(line.strip().startswith("HTTP  http://127.0.0.1:") for line in server.output[start:])


STRUCTURED_SCHEMAS = [
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "role": {"enum": ["admin", "guest"]}},
        "required": ["id", "role"]}, "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "minItems": 1, "maxItems": 3},
                                      "score": {"type": "number", "minimum": -2.5, "maximum": 7}},
     "required": ["tags", "score"]},
]


def test_structured_outputs_and_tool_calls_through_1p1d_with_the_openai_client(server):
    """Sampled at temperature 1 by the random-weight model, so the grammar alone makes them valid;
    long prompts (past the short-prompt bound): the first token is the prefill worker's, the rest
    the decode worker's."""
    import random
    import re

    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=120)
    rng = random.Random(5)
    long_text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "record", "value"]) for _ in range(260))
    for i, schema in enumerate(STRUCTURED_SCHEMAS):
        for n in range(3):
            messages = [{"role": "system", "content": long_text}, {"role": "user", "content": f"record {i} {n}"}]
            chat = client.chat.completions.create(
                model="default", messages=messages, temperature=1.0, max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
            assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
            assert chat.usage.prompt_tokens > 192
            jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    regex = r"(red|green|blue)-[0-9]{2,4}"
    for n in range(3):
        done = client.completions.create(model="default", prompt=f"{long_text} {n}", temperature=1.0, max_tokens=20,
                                         extra_body={"structured_outputs": {"regex": regex}})
        assert re.fullmatch(regex, done.choices[0].text), done.choices[0].text

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": STRUCTURED_SCHEMAS[0]}}
    tags = {"type": "function", "function": {"name": "tag", "parameters": STRUCTURED_SCHEMAS[1]}}
    ask = [{"role": "user", "content": "call a tool"}]
    named = client.chat.completions.create(model="default", messages=ask, tools=[weather, tags], temperature=1.0,
                                           tool_choice={"type": "function", "function": {"name": "tag"}},
                                           max_tokens=200)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "tag"
    jsonschema.validate(json.loads(call.function.arguments), STRUCTURED_SCHEMAS[1])
    with client.chat.completions.stream(model="default", messages=ask, tools=[weather, tags], temperature=1.0,
                                        tool_choice="required", parallel_tool_calls=False, max_tokens=300) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and final.choices[0].finish_reason == "tool_calls"
    for call in calls:
        schema = {"get_weather": STRUCTURED_SCHEMAS[0], "tag": STRUCTURED_SCHEMAS[1]}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema"):
        client.chat.completions.create(model="default", messages=ask, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object", "minProperties": "x"}}})
