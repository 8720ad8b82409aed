"""The public stream's promises, checked against a real scheduler and executor.

Each test names one promise of `pagedserve.v1.Generation` (see generation.proto):
text deltas that concatenate to the detokenized tokens, stop strings that never
leak, n > 1 samples that share the prompt's KV and reproduce single requests,
cancellation and deadlines that free KV blocks at once, min_tokens, logprobs,
seeds that reproduce whatever else is running, and the unary helpers.
"""

from __future__ import annotations

import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import Client, Completion
from tests.servers import Servers

pytestmark = pytest.mark.e2e
STOP, LENGTH = "stop", "length"
REPLACEMENT_CHAR = "\ufffd"
BLOCK_SIZE = 16  # the scheduler's default --block-size


@pytest.fixture(scope="module")
def servers():
    with Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.5"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(servers):
    with Client(servers.public_addr) as c:
        yield c


def stream(client: Client, prompt=None, **kw) -> list[Completion]:
    return list(client.generate(prompt, timeout=kw.pop("timeout", 180), **kw))


def by_index(msgs) -> dict[int, list[Completion]]:
    out: dict[int, list[Completion]] = {}
    for m in msgs:
        out.setdefault(m.index, []).append(m)
    return out


def token_ids(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def wait_idle(client: Client, timeout: float = 10.0) -> pb.ServerStatus:
    """The status once no request holds a KV block or a queue slot; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.server_status()
        if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
            return s
        assert time.monotonic() < deadline, f"engine not idle after {timeout}s: {s}"
        time.sleep(0.01)


def assert_well_formed(msgs, n: int = 1, prompt_tokens: int | None = None) -> None:
    """Each of the n samples ends with exactly one message carrying finish_reason and usage."""
    samples = by_index(msgs)
    assert sorted(samples) == list(range(n)), f"sample indices {sorted(samples)}"
    for index, sample in samples.items():
        assert sample[-1].finish_reason is not None, f"sample {index} has no final message"
        assert all(m.finish_reason is None for m in sample[:-1]), f"sample {index} finished twice"
        assert sample[-1].usage is not None
        assert sample[-1].usage.completion_tokens == len(token_ids(sample)), (
            f"sample {index}: usage disagrees with the stream"
        )
        if prompt_tokens is not None:
            assert sample[-1].usage.prompt_tokens == prompt_tokens


# ---- incremental detokenization ---------------------------------------------------------

DETOK_CASES = [
    dict(messages=[{"role": "user", "content": "Reply only with emoji, at least twenty: 🎉🐍🔥🌍🚀😀🦊🍕"}]),
    dict(messages=[{"role": "user", "content": "用中文写一首关于大海和月亮的短诗。"}]),
    dict(
        messages=[
            {"role": "user", "content": "Écris une phrase: déjà, où, naïve, garçon. Затем по-русски, then 日本語で。"}
        ]
    ),
    dict(prompt="Emoji story: 🐉🏰👑🗡️✨ Once upon a time, 🧙‍♂️"),
    dict(prompt="The three laws of thermodynamics are"),
]


def test_text_deltas_concatenate_to_the_detokenized_tokens(client):
    with ThreadPoolExecutor(len(DETOK_CASES)) as pool:
        runs = list(
            pool.map(
                lambda i: stream(client, **DETOK_CASES[i], max_tokens=40, temperature=0.8, seed=i),
                range(len(DETOK_CASES)),
            )
        )
    split_characters = 0  # characters spread over several tokens: what the hold-back logic exists for
    for case, msgs in zip(DETOK_CASES, runs):
        assert_well_formed(msgs)
        ids = token_ids(msgs)
        full = client.detokenize(ids)
        assert "".join(m.text for m in msgs) == full, case
        if REPLACEMENT_CHAR not in full:
            assert not any(REPLACEMENT_CHAR in m.text for m in msgs), f"a delta split a character: {case}"
        split_characters += sum(REPLACEMENT_CHAR in client.detokenize([t]) for t in set(ids))
    assert split_characters > 0, "no output had a multi-token character; the cases test nothing"


# ---- stop strings -------------------------------------------------------------------------

STOP_PROMPT = "The capital of France is"  # 5 tokens: no prefix-cache hit, the same greedy run every time


def pick_stop(client: Client, ids: list[int], text: str) -> str:
    """A 5-character substring around the token boundary nearest the middle of `text`."""
    bounds = [len(client.detokenize(ids[:k])) for k in range(1, len(ids))]
    inner = [b for b in bounds if 3 <= b <= len(text) - 4 and text[b - 2 : b + 3].strip()]
    assert inner, f"greedy output too short to pick a stop string from: {text!r}"
    b = min(inner, key=lambda b: abs(b - len(text) / 2))
    return text[b - 2 : b + 3]


@pytest.fixture(scope="module")
def greedy_base(client) -> tuple[list[int], str]:
    base = stream(client, STOP_PROMPT, max_tokens=32, temperature=0.0, ignore_eos=True)
    return token_ids(base), "".join(m.text for m in base)


def test_one_stop_string_is_one_string_not_its_characters(client, greedy_base):
    """stop="abcde" stops at "abcde", as stop=["abcde"] does; not at its first character."""
    base_ids, text = greedy_base
    stop = pick_stop(client, base_ids, text)
    single = client.complete(STOP_PROMPT, max_tokens=32, temperature=0.0, ignore_eos=True, stop=stop, timeout=180)[0]
    assert single.finish_reason == STOP and single.matched_stop == stop and single.text == text[: text.find(stop)]
    whole = client.complete(STOP_PROMPT, max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop], timeout=180)[0]
    assert (single.text, single.token_ids) == (whole.text, whole.token_ids)


@pytest.mark.parametrize("include", [False, True], ids=["stop-excluded", "stop-included"])
def test_stop_string_ends_the_text_right_before_it_and_frees_blocks(client, greedy_base, include):
    base_ids, text = greedy_base
    stop = pick_stop(client, base_ids, text)
    at = text.find(stop)

    msgs = stream(
        client,
        STOP_PROMPT,
        max_tokens=32,
        temperature=0.0,
        ignore_eos=True,
        stop=[stop, "never-in-output-§"],
        include_stop_str_in_output=include,
    )
    status = client.server_status()  # the stop frees the sample's blocks before its last message is sent
    assert status.kv_blocks_used == 0 and status.num_running == 0, status
    assert_well_formed(msgs)
    last = msgs[-1]
    assert last.finish_reason == STOP and last.matched_stop == stop
    assert last.matched_stop_token_id is None
    got = "".join(m.text for m in msgs)
    assert got == (text[: at + len(stop)] if include else text[:at]), (stop, text)
    if not include:
        assert not any(stop in m.text for m in msgs)
    ids = token_ids(msgs)
    assert ids == base_ids[: len(ids)] and len(ids) < len(base_ids), (
        "generation did not stop where the stop string appeared"
    )


# ---- n > 1 ----------------------------------------------------------------------------------


def test_n_samples_each_finish_reproduce_single_requests_and_share_the_prompt(client):
    # A prompt nobody sent before, 5+ blocks long, so every prefix hit below comes from the n samples.
    prompt = (
        f"Samples share a prompt (n-test {uuid.uuid4().hex[:8]}). "
        + "The Roman Empire spanned many centuries and lands. " * 7
    )
    prompt_len = len(client.tokenize(prompt))
    assert prompt_len > 4 * BLOCK_SIZE
    full_blocks = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt token is always recomputed
    before = client.server_status()
    msgs = stream(client, prompt, n=4, seed=77, temperature=1.0, max_tokens=12)
    after = client.server_status()
    assert_well_formed(msgs, n=4, prompt_tokens=prompt_len)
    assert {m.request_id for m in msgs} and len({m.request_id for m in msgs}) == 1
    samples = by_index(msgs)
    cached = sorted(samples[i][-1].usage.cached_prompt_tokens for i in range(4))
    assert cached == [0, full_blocks, full_blocks, full_blocks], (
        "samples after the first did not reuse the prompt's blocks"
    )
    assert after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens == 3 * full_blocks
    assert len({tuple(token_ids(s)) for s in samples.values()}) > 1, "four samples at temperature 1 all agree"
    with ThreadPoolExecutor(4) as pool:
        singles = list(
            pool.map(lambda i: stream(client, prompt, seed=77 + i, temperature=1.0, max_tokens=12), range(4))
        )
    for i, single in enumerate(singles):
        assert token_ids(single) == token_ids(samples[i]), f"sample {i} differs from a single request with seed 77+{i}"
    wait_idle(client, timeout=1.0)


@pytest.mark.parametrize(
    "live,late", [(("fan", 2), ("fan#0", 1)), (("solo#1", 1), ("solo", 2))], ids=["sample-id", "request-id"]
)
def test_request_id_that_names_a_live_sample_is_refused_and_harms_nothing(client, live, late):
    # Samples of n > 1 run as "<id>#<i>": a request literally named so must not take over their stream.
    (live_id, live_n), (late_id, late_n) = live, late
    call = client.generate(
        "Tell me a story.", request_id=live_id, n=live_n, max_tokens=12, ignore_eos=True, timeout=120
    )
    first = next(call)
    with pytest.raises(grpc.RpcError) as info:
        stream(client, "Hi", request_id=late_id, n=late_n, max_tokens=2, timeout=30)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    msgs = [first, *call]
    assert_well_formed(msgs, n=live_n)
    assert all(len(token_ids(s)) == 12 for s in by_index(msgs).values())
    wait_idle(client, timeout=1.0)


def test_seeds_of_n_samples_wrap_around_at_two_to_the_64(client):
    # Sample i uses seed + i as a uint64: the largest seed must not break the step (or the server).
    top = 2**64 - 1
    samples = by_index(stream(client, "Pick a number:", n=2, seed=top, temperature=1.0, max_tokens=6))
    for i, seed in enumerate((top, 0)):
        assert token_ids(stream(client, "Pick a number:", seed=seed, temperature=1.0, max_tokens=6)) == token_ids(
            samples[i]
        )


# ---- cancellation and deadlines ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
def test_cancelled_stream_frees_its_blocks_long_before_it_would_finish(client, n):
    """The scheduler frees a cancelled request's blocks as the cancel arrives
    (Scheduler.abort_request, unit-tested). Seen from a client, the steps
    between its status snapshot and the cancel's arrival count too: a step
    takes ~20 ms here and a loaded 2-core host has delayed the cancel by 24
    steps, so the bound is 50 steps of the 497 the request had left."""
    call = client.generate(
        "Write a very long story about a lighthouse keeper.",
        n=n,
        max_tokens=500,
        ignore_eos=True,
        temperature=1.0,
        seed=5,
        timeout=120,
    )
    received = 0
    for msg in call:
        received += len(msg.token_ids)
        if received >= 3 * n:
            break
    status = client.server_status()
    assert status.num_running == n and status.kv_blocks_used > 0, status
    call.cancel()
    idle = wait_idle(client)
    assert idle.num_steps - status.num_steps <= 50, f"blocks freed only after {idle.num_steps - status.num_steps} steps"


def test_closing_or_dropping_a_stream_cancels_its_request(client):
    with client.generate(
        "Write a very long story about a lighthouse keeper.", max_tokens=500, ignore_eos=True, timeout=120
    ) as stream:
        next(stream)
        assert client.server_status().num_running == 1
    wait_idle(client, timeout=5)  # closed, still referenced: cancelled by close(), not by garbage collection
    assert stream.code() == grpc.StatusCode.CANCELLED
    for _ in client.generate(
        "Write a very long story about a lighthouse keeper.", max_tokens=500, ignore_eos=True, timeout=120
    ):
        break  # the loop held the only reference
    wait_idle(client, timeout=5)


def test_async_client_tokenizes_like_the_sync_one(servers, client):
    import asyncio

    from pagedserve_client import AsyncClient

    async def tokenize():
        async with AsyncClient(servers.public_addr) as ac:
            return await ac.tokenize("Hello, world!")

    assert asyncio.run(tokenize()) == client.tokenize("Hello, world!")


def test_deadline_exceeded_aborts_and_frees(client):
    start = client.server_status().num_steps
    with pytest.raises(grpc.RpcError) as info:
        stream(
            client, "Write a very long story about a lighthouse keeper.", max_tokens=500, ignore_eos=True, timeout=0.5
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    at_deadline = client.server_status().num_steps
    idle = wait_idle(client)
    # The abort came with the deadline: at most the steps already in flight ran
    # after it, where finishing 500 tokens would take hundreds more. (A count
    # from the start would measure the machine: a fast one runs 100+ decode
    # steps of this model inside 0.5 s.)
    assert at_deadline - start < 500, f"{at_deadline - start} steps before the deadline: the request finished"
    assert idle.num_steps - at_deadline < 25, f"{idle.num_steps - at_deadline} steps ran after the deadline"


# ---- unary helpers and request ids ----------------------------------------------------------


def test_tokenize_detokenize_model_info_and_request_ids(client):
    info = client.model_info()
    assert info.vocab_size == 49152 and info.max_model_len_tokens > 0 and list(info.eos_token_ids)
    assert info.block_size_tokens == BLOCK_SIZE and info.dtype == "float32" and info.has_chat_template
    assert info.max_n >= 1 and info.max_logprobs == 20 and info.max_stop_strings > 0 and info.max_stop_string_bytes > 0

    text = "Paged attention: blocks, tables — and ünïcödé 🙂."
    resp = client._stub.Tokenize(pb.TokenizeRequest(text=text))
    assert len(resp.tokens) == len(resp.token_ids) > 0
    assert client.detokenize(list(resp.token_ids)) == text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]))
    chat_ids = list(client._stub.Tokenize(chat).token_ids)
    assert "Name a colour." in client.detokenize(chat_ids, skip_special_tokens=False)
    by_chat = stream(client, messages=messages, max_tokens=4, temperature=0.0, request_id="client-chosen-id-1")
    by_ids = stream(client, token_ids=chat_ids, max_tokens=4, temperature=0.0)
    assert by_chat[-1].usage.prompt_tokens == len(chat_ids)
    assert token_ids(by_chat) == token_ids(by_ids), "a chat prompt and its Tokenize ids generate differently"
    assert all(m.request_id == "client-chosen-id-1" for m in by_chat)
    assigned = {m.request_id for m in stream(client, "Hi", n=2, max_tokens=3)}
    assert len(assigned) == 1 and assigned != {""}, f"server-assigned ids: {assigned}"


# ---- min_tokens and logprobs ----------------------------------------------------------------


def test_min_tokens_holds_back_stop_tokens(client):
    prompt = "Count: one, two, three,"
    free = stream(client, prompt, max_tokens=12, temperature=0.0)
    stop_token = token_ids(free)[1]  # the greedy output's second token, e.g. ","
    early = stream(client, prompt, max_tokens=12, temperature=0.0, stop_token_ids=[stop_token])
    assert early[-1].finish_reason == STOP and early[-1].matched_stop_token_id == stop_token
    assert len(token_ids(early)) == 2

    held = stream(client, prompt, max_tokens=12, temperature=0.0, stop_token_ids=[stop_token], min_tokens=6)
    assert_well_formed(held)
    ids = token_ids(held)
    eos = set(client.model_info().eos_token_ids)
    assert len(ids) >= 6 and not ({stop_token} | eos) & set(ids[:6]), ids
    last = held[-1]
    if last.finish_reason == STOP:
        assert last.matched_stop_token_id == ids[-1] and len(ids) > 6
    else:
        assert last.finish_reason == LENGTH and len(ids) == 12


def test_min_tokens_holds_back_stop_strings(client):
    prompt = "Count: one, two, three,"
    free = stream(client, prompt, max_tokens=12, temperature=0.0)
    text = "".join(m.text for m in free)
    stop = text[: text.index(",") + 1][-2:]  # ends the greedy text at its first comma
    early = stream(client, prompt, max_tokens=12, temperature=0.0, stop=[stop])
    assert early[-1].finish_reason == STOP and len(token_ids(early)) < 6

    held = stream(client, prompt, max_tokens=12, temperature=0.0, stop=[stop], min_tokens=6)
    assert_well_formed(held)
    ids = token_ids(held)
    assert len(ids) >= 6 and ids[: len(token_ids(early))] == token_ids(free)[: len(token_ids(early))]
    # The first occurrence was in the first 6 tokens' text, so it is shown.
    assert stop in "".join(m.text for m in held)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_report_the_sampled_token_and_sorted_top_n(client, temperature):
    msgs = stream(
        client, "A list of fruits: apple, banana,", max_tokens=10, temperature=temperature, seed=3, logprobs=5
    )
    assert_well_formed(msgs)
    entries = 0
    for m in msgs:
        assert len(m.logprobs) == len(m.token_ids)
        for token, lp in zip(m.token_ids, m.logprobs):
            entries += 1
            assert lp.token_id == token and math.isfinite(lp.logprob) and lp.logprob <= 0
            tops = [t.logprob for t in lp.top]
            assert len(tops) == 5 and tops == sorted(tops, reverse=True), tops
            assert sum(math.exp(x) for x in tops) <= 1.0 + 1e-4
            listed = {t.token_id: t.logprob for t in lp.top}
            if token in listed:
                assert listed[token] == pytest.approx(lp.logprob, abs=1e-5)
            else:
                assert lp.logprob <= tops[-1] + 1e-5, "a token outside the top 5 is more likely than the 5th"
            if temperature == 0.0:
                assert lp.top[0].token_id == token, "greedy did not pick the most likely token"
    assert entries == 10


# ---- seeds ---------------------------------------------------------------------------------


def test_seed_reproduces_alone_and_amid_other_traffic(client):
    prompt = "Invent a name for a cat:"  # under one block: no prefix-cache hit on the second run
    run = lambda: token_ids(stream(client, prompt, seed=2024, temperature=1.0, max_tokens=12, ignore_eos=True))
    alone = run()
    with ThreadPoolExecutor(6) as pool:
        noise = [
            pool.submit(
                stream,
                client,
                f"Background request {i}: tell me about rivers.",
                max_tokens=48 + 2 * i,
                temperature=1.0,
                ignore_eos=True,
            )
            for i in range(5)
        ]
        # Bounded: an unbounded wait hung a suite run on a busy host, the five
        # done (or one failed) before a poll saw them all running.
        deadline = time.monotonic() + 60
        while client.server_status().num_running < 5:
            for f in noise:
                if f.done():
                    f.result()  # a failed background request raises here
                    pytest.fail("a background request finished before the five ran together")
            assert time.monotonic() < deadline, "the five background requests never ran together"
            time.sleep(0.01)
        amid = pool.submit(run).result()
        for f in noise:
            f.result()
    assert amid == alone
    wait_idle(client, timeout=1.0)
