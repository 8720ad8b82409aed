"""The OpenAI gateway, driven by the official `openai` client, in front of live
scheduler + executor processes (the embedded model, float32).

One scheduler for the module, started with a bearer token: every call passes it
through the gateway, and the auth tests check that a wrong or missing one is
refused by the scheduler behind it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from openai_gateway.translate import APIError, chat_request, completion_request
from pagedserve_client import Client, build_request
from tests.servers import REPO, Servers, free_port

pytestmark = pytest.mark.e2e
TOKEN = "secret"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def start_gateway(scheduler: str, log_path: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "openai_gateway",
            "--listen",
            f"127.0.0.1:{port}",
            "--scheduler",
            scheduler,
            "--log-level",
            "warning",
            *args,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return proc, base
        except urllib.error.HTTPError:
            return proc, base  # up, answering (503 when the scheduler is not serving)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"gateway did not start; see {log_path}") from None
            time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def servers():
    with Servers(executor_args=["--dtype", "float32"], scheduler_args=["--auth-token", TOKEN]) as s:
        yield s


@pytest.fixture(scope="module")
def base(servers):
    proc, url = start_gateway(
        servers.public_addr,
        os.path.join(servers.tmp, "gateway.log"),
        "--served-model-name",
        "m",
        "--allowed-origins",
        "https://app.example",
    )
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0)


@pytest.fixture(scope="module")
def grpc_client(servers):
    with Client(servers.public_addr, token=TOKEN) as c:
        yield c


def wait_idle(grpc_client, timeout: float) -> bool:
    """True once the scheduler runs nothing and holds no KV blocks, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = grpc_client.server_status()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0:
            return True
        time.sleep(0.05)
    return False


# -- translation alone (no servers) ---------------------------------------------------------------


def test_translated_requests_build_grpc_requests():
    t = completion_request({"model": "m", "prompt": [[1, 2, 3]], "n": 2, "seed": 5, "stop": "x", "logprobs": 1})
    req = build_request(**t.prompts[0], **t.kwargs)
    assert list(req.token_ids.ids) == [1, 2, 3] and req.sampling.n == 2 and req.sampling.seed == 5
    assert list(req.stopping.stop) == ["x"] and req.sampling.logprobs == 1 and req.stopping.max_tokens == 16
    t = chat_request(
        {
            "model": "m",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}],
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    req = build_request(**t.prompts[0], **t.kwargs)
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "Be brief.")]
    assert req.stopping.max_tokens == 7 and req.sampling.logprobs == 3 and not req.stopping.HasField("min_tokens")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a", 3]}, "prompt"),
        ({"model": "m", "prompt": "a", "echo": True, "logprobs": 1}, "echo"),
        ({"model": "m", "prompt": "a", "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "prompt": "a", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "a", "temperature": 10**400}, "temperature"),  # valid JSON, no float
        ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a"}, "model"),
    ],
)
def test_untranslatable_requests_name_the_parameter(body, param):
    with pytest.raises(APIError) as e:
        completion_request(body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize(
    "message, ok",
    [
        ({"role": "user"}, False),
        ({"role": "user", "content": None}, False),
        ({"role": "assistant", "content": None}, True),
    ],
)
def test_only_an_assistant_turn_may_lack_content(message, ok):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}, message]}
    if ok:
        t = chat_request(body)
        assert build_request(**t.prompts[0], **t.kwargs).chat.messages[1].content == ""
        return
    with pytest.raises(APIError) as e:
        chat_request(body)
    assert e.value.status == 400 and e.value.param == "messages[1].content"


# -- live ----------------------------------------------------------------------------------------


def test_models_lists_the_served_name_and_404s_others(oai):
    from shared.model_id import model_id

    assert model_id("Smollm2 135M 8k Lc100K Mix1 Ep2") == "smollm2-135m-8k-lc100k-mix1-ep2"
    assert model_id("Qwen/Qwen2.5-0.5B-Instruct") == "qwen/qwen2.5-0.5b-instruct"
    assert [m.id for m in oai.models.list().data] == ["m"]  # --served-model-name m
    assert oai.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    for call in (
        lambda: oai.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2),
        lambda: oai.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2, stream=True),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert (
            e.value.code == "model_not_found"
            and e.value.param == "model"
            and "`gpt-4` does not exist" in e.value.message
        )


def test_completion_stream_joins_to_the_non_streaming_text(oai):
    whole = oai.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(oai.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    choice = whole.choices[0]
    assert whole.model == "m" and choice.text
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    u = whole.usage
    assert u.completion_tokens == 10 or choice.finish_reason == "stop"
    assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens is not None


def test_chat_stream_with_usage_matches_non_streaming(oai):
    whole = oai.chat.completions.create(model="m", messages=CHAT, max_completion_tokens=12, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model="m", messages=CHAT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    *body, last = chunks
    assert last.choices == [] and all(c.usage is None for c in body)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_n2_with_seed_is_reproducible_streaming_or_not(oai):
    kw = dict(model="m", prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=1234)
    first = oai.completions.create(**kw)
    again = oai.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    streamed = {0: "", 1: ""}
    for chunk in oai.completions.create(**kw, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]
    if all(c.finish_reason == "length" for c in first.choices):
        assert first.usage.completion_tokens == 2 * 8  # usage adds up both samples


def test_stop_string_cuts_the_text(oai):
    base = oai.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert len(stop) == 2, f"greedy text too short to pick a stop string: {base!r}"
    got = oai.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0, stop=["zzzz", stop]).choices[0]
    assert got.finish_reason == "stop" and got.text == base[: base.find(stop)]
    single = oai.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop).choices[0]
    assert single.text == got.text


def test_logprobs_completion_and_chat(oai):
    c = oai.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2).choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and top[token] == logprob and max(top.values()) == logprob  # greedy: the argmax
    chat = oai.chat.completions.create(
        model="m", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and bytes(e.bytes) == e.token.encode()


def test_logprobs_of_tokens_a_constraint_rules_out_are_floored_not_infinite(oai, base):
    """More top_logprobs than the constraint allows tokens: the rest are -inf in
    the engine, -9999.0 in JSON (which has no -Infinity), streamed or not."""
    ask = dict(model="m", messages=CHAT, max_tokens=2, temperature=0, logprobs=True, top_logprobs=20)
    ask["extra_body"] = {"guided_choice": ["yes", "no"]}
    content = oai.chat.completions.create(**ask).choices[0].logprobs.content
    assert min(t.logprob for t in content[0].top_logprobs) == -9999.0
    assert content[0].top_logprobs[0].logprob > -9999.0
    streamed = [c for c in oai.chat.completions.create(**ask, stream=True) if c.choices and c.choices[0].logprobs]
    assert min(t.logprob for t in streamed[0].choices[0].logprobs.content[0].top_logprobs) == -9999.0


def test_bad_requests_name_the_field(oai, base):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt=PROMPT, temperature=-1)
    assert e.value.param == "temperature" and "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt=PROMPT, max_tokens=10**6, stream=True)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=CHAT, max_completion_tokens=10**6)
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=[{"role": "narrator", "content": "hi"}])
    assert e.value.param == "messages[0].role"
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    status, body = http("POST", base + "/v1/completions", b"{not json", auth)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = http("GET", base + "/v1/nowhere", None, auth)
    assert status == 404 and body["error"]["code"] == "not_found"
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past the parser's recursion
    status, body = http("POST", base + "/v1/completions", deep, auth)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    for path in ("/tokenize", "/v1/completions"):
        status, body = http("POST", base + path, json.dumps({"model": ["m"], "prompt": "a"}).encode(), auth)
        assert status == 400 and body["error"]["param"] == "model", (path, body)


def test_bearer_token_is_passed_through(base):
    wrong = openai.OpenAI(base_url=base + "/v1", api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="m", prompt=PROMPT, max_tokens=2, stream=True)
    status, body = http(
        "POST",
        base + "/v1/chat/completions",
        json.dumps({"model": "m", "messages": CHAT}).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_client_disconnect_frees_the_request(oai, base, grpc_client):
    long = dict(model="m", prompt=PROMPT, max_tokens=2000, temperature=0, extra_body={"ignore_eos": True})
    stream = oai.completions.create(**long, stream=True)
    for _, _chunk in zip(range(3), stream):
        pass
    assert grpc_client.server_status().num_running == 1
    stream.close()
    assert wait_idle(grpc_client, timeout=5.0), "the scheduler still runs a request whose stream was closed"
    impatient = openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(**long)
    assert wait_idle(grpc_client, timeout=5.0), "the scheduler still runs a request whose caller went away"


def test_health_follows_the_scheduler(base, servers):
    assert http("GET", base + "/health") == (200, {"status": "SERVING"})
    proc, orphan = start_gateway(f"127.0.0.1:{free_port()}", os.path.join(servers.tmp, "gateway-orphan.log"))
    try:
        status, body = http("GET", orphan + "/health")
        assert status == 503 and body["status"] != "SERVING"
    finally:
        stop(proc)


def test_prompt_list_gives_n_choices_per_prompt_in_order(oai):
    prompts = [PROMPT, "Once upon a time", "1, 2, 3,"]
    whole = oai.completions.create(model="m", prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in whole.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = oai.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0).choices[0].text
        assert whole.choices[2 * p].text == whole.choices[2 * p + 1].text == alone  # greedy: both samples agree
    singles = [oai.completions.create(model="m", prompt=p, max_tokens=4, temperature=0).usage for p in prompts]
    assert whole.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)
    assert whole.usage.completion_tokens == 2 * sum(u.completion_tokens for u in singles)
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in oai.completions.create(model="m", prompt=prompts, max_tokens=4, temperature=0, n=2, stream=True):
        c = chunk.choices[0]
        streamed[c.index] = streamed.get(c.index, "") + c.text
        if c.finish_reason:
            finished.add(c.index)
    assert finished == set(range(6)) and [streamed[i] for i in range(6)] == [c.text for c in whole.choices]


def test_echo_prepends_the_prompt(oai, grpc_client):
    plain = oai.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    echoed = oai.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    ids = grpc_client.tokenize(" Paris is", add_special_tokens=False)
    by_ids = oai.completions.create(model="m", prompt=ids, max_tokens=2, temperature=0, echo=True).choices[0].text
    assert by_ids.startswith(" Paris is")
    streamed = "".join(
        c.choices[0].text
        for c in oai.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True)
    )
    assert streamed == echoed


def test_tokenize_detokenize_and_version(base, grpc_client):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    status, body = http("POST", base + "/tokenize", json.dumps({"model": "m", "prompt": PROMPT}).encode(), auth)
    assert status == 200 and body["tokens"] == grpc_client.tokenize(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == grpc_client.model_info().max_model_len_tokens
    status, chat = http("POST", base + "/tokenize", json.dumps({"messages": CHAT}).encode(), auth)
    assert status == 200 and chat["count"] > len(grpc_client.tokenize(CHAT[0]["content"]))  # the template's tokens
    status, back = http(
        "POST", base + "/detokenize", json.dumps({"model": "m", "tokens": body["tokens"]}).encode(), auth
    )
    assert status == 200 and back["prompt"] == PROMPT
    status, bad = http("POST", base + "/detokenize", json.dumps({"tokens": [10**9]}).encode(), auth)
    assert status == 400 and bad["error"]["param"] == "tokens"
    status, missing = http("POST", base + "/tokenize", json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), auth)
    assert status == 404 and missing["error"]["code"] == "model_not_found"
    from importlib.metadata import version

    assert http("GET", base + "/version") == (200, {"version": version("pagedserve")})


def test_cors_allows_only_the_configured_origin(base):
    def preflight(origin: str) -> tuple[int, dict]:
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            method="OPTIONS",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers)

    status, headers = preflight("https://app.example")
    assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
    status, headers = preflight("https://evil.example")
    assert status == 400 and "access-control-allow-origin" not in headers
    with urllib.request.urlopen(
        urllib.request.Request(base + "/health", headers={"Origin": "https://app.example"})
    ) as r:
        assert r.headers["access-control-allow-origin"] == "https://app.example"


def test_metrics_404_without_upstream(base):
    status, body = http("GET", base + "/metrics")
    assert status == 404 and "--metrics-upstream" in body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_prompt_in_a_list_cancels_the_others(oai, grpc_client, stream):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(
            model="m",
            prompt=["Tell me a long story.", [10**6]],
            max_tokens=2000,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
    assert e.value.param == "prompt"
    assert wait_idle(grpc_client, timeout=5.0), "the valid prompt went on generating for nobody"
