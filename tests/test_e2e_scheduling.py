"""The scheduler's policies change when tokens are computed, never what they are.

Through the real executor (float32, greedy): outputs are identical with the
prefix cache on and off, with and without chunked prefill, with and without
overlap scheduling, and when a tiny KV capacity forces preemption and recompute.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve_client import Client
from tests.servers import Servers

pytestmark = pytest.mark.e2e
SYSTEM = (
    "You are a careful assistant who answers questions about the Python standard library "
    "accurately, briefly and without speculation. "
)


def jobs(english_prompts: list[str]) -> list[str]:
    # A shared prefix (prefix-cache hits) plus distinct tails of different lengths.
    return [SYSTEM * 3 + p for p in english_prompts] + english_prompts


def run_all(servers: Servers, prompts: list[str]):
    with Client(servers.public_addr) as c, ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: c.complete(p, max_tokens=24, temperature=0.0, ignore_eos=True)[0], prompts))
        status = c.server_status()
    assert status.kv_blocks_used == 0
    return [o.token_ids for o in outs], outs, status


@pytest.fixture(scope="module")
def reference(english_prompts):
    with Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.5"]) as s:
        tokens, outs, status = run_all(s, jobs(english_prompts))
    assert status.prefix_cache_hits_tokens > 0, "the reference run should hit the prefix cache"
    return tokens


def test_prefix_cache_off_and_no_chunked_prefill_give_identical_outputs(reference, english_prompts):
    with Servers(
        executor_args=["--dtype", "float32", "--kv-cache-gib", "0.5"],
        scheduler_args=["--no-prefix-caching", "--no-chunked-prefill", "--max-num-batched-tokens", "4096"],
    ) as s:
        tokens, outs, status = run_all(s, jobs(english_prompts))
    assert status.prefix_cache_hits_tokens == 0 and all(o.cached_prompt_tokens == 0 for o in outs)
    assert tokens == reference


def test_preemption_and_small_chunks_give_identical_outputs(reference, english_prompts):
    # ~40 blocks of 16 tokens for 12 requests of up to ~250 tokens: they cannot all fit,
    # so running requests are preempted and recomputed; 64-token chunks split every prompt.
    with Servers(
        executor_args=["--dtype", "float32", "--kv-cache-gib", "0.03"],
        scheduler_args=["--max-num-batched-tokens", "64", "--watermark", "0"],
    ) as s:
        tokens, outs, status = run_all(s, jobs(english_prompts))
    assert status.num_preemptions > 0, "the KV capacity was meant to force preemption"
    assert tokens == reference


def run_varied(servers: Servers, prompts: list[str]):
    """Requests that end every way: EOS, stop strings, max_tokens; greedy and seeded sampling, logprobs."""

    def one(i_prompt):
        i, prompt = i_prompt
        kwargs = dict(max_tokens=8 + 5 * i, logprobs=2, stop=[" the", "."] if i % 3 == 0 else [])
        if i % 2:
            kwargs.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        else:
            kwargs.update(temperature=0.0)
        return c.complete(prompt, **kwargs)[0]

    with Client(servers.public_addr) as c, ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(one, enumerate(prompts)))
        assert c.server_status().kv_blocks_used == 0
    return outs


def test_overlap_scheduling_off_gives_identical_outputs(reference, english_prompts):
    args = ["--dtype", "float32", "--kv-cache-gib", "0.5"]
    with Servers(executor_args=args, scheduler_args=["--no-overlap-scheduling"]) as s:
        tokens, _, _ = run_all(s, jobs(english_prompts))
        lockstep = run_varied(s, jobs(english_prompts))
    assert tokens == reference
    with Servers(executor_args=args) as s:
        overlapped = run_varied(s, jobs(english_prompts))
    assert {o.finish_reason for o in overlapped} >= {"stop", "length"}, (
        "the requests were meant to end in different ways"
    )
    for a, b in zip(overlapped, lockstep):
        assert (a.token_ids, a.text, a.finish_reason, a.matched_stop) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.matched_stop,
        )
        # Other batch shapes take other GEMM paths: float32 sums in another order.
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-3)
