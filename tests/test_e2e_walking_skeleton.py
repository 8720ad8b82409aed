"""End to end: both processes as subprocesses, gRPC all the way, the embedded model.

Greedy outputs must equal Hugging Face transformers' greedy `generate` on the
same GGUF weights in float32, token for token, for prompts sent concurrently.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedserve_client import Client
from tests.servers import Servers

pytestmark = pytest.mark.e2e
MAX_TOKENS = 24
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def servers():
    with Servers(executor_args=["--dtype", "float32"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(servers):
    with Client(servers.public_addr) as c:
        yield c


def hf_greedy(model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(input_ids) :].tolist()


def test_greedy_outputs_match_hf_transformers(client, hf_smollm2, english_prompts):
    model, tok = hf_smollm2
    jobs = [dict(prompt=p) for p in english_prompts] + [dict(messages=CHAT)]
    assert len(jobs) >= 6 and len({len(j.get("prompt", "")) for j in jobs}) == len(jobs)
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: client.complete(**j, max_tokens=MAX_TOKENS, temperature=0.0)[0], jobs))
    for job, got in zip(jobs, results):
        if "prompt" in job:
            ids = tok(job["prompt"]).input_ids
        else:
            ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert got.prompt_tokens == len(ids)
        want = hf_greedy(model, ids, MAX_TOKENS)
        assert got.token_ids == want[: len(got.token_ids)], f"diverged for {job}"
        # Either both ran to max_tokens or we stopped exactly where HF emitted EOS.
        assert len(got.token_ids) == len(want) or got.finish_reason == "stop"
        assert got.text == tok.decode(got.token_ids, skip_special_tokens=True)


def test_scheduler_process_never_loads_torch(servers, client):
    client.complete("Hello", max_tokens=2)
    with open(f"/proc/{servers.scheduler.pid}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps and "/torch/" not in maps
    with open(f"/proc/{servers.executor.pid}/maps") as f:
        assert "libtorch" in f.read(), "sanity: the check must see torch where it is loaded"


def test_blocks_are_returned_after_requests_finish(client):
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: client.complete(f"Count to {i}:", max_tokens=8), range(4)))
    status = client.server_status()
    assert status.kv_blocks_total > 0
    assert status.kv_blocks_used == 0
    assert status.num_running == 0 and status.num_waiting == 0


def test_model_info_and_tokenize(client, hf_smollm2):
    _, tok = hf_smollm2
    info = client.model_info()
    assert info.vocab_size == 49152 and info.architecture == "llama" and info.has_chat_template
    text = "Paged attention manages KV memory like virtual memory."
    assert client.tokenize(text) == tok(text).input_ids
    assert client.detokenize(tok(text).input_ids) == text
