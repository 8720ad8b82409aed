"""Tensor parallelism: two executor ranks on CPU (gloo) serve exactly what one does.

The model is a tiny random Qwen2 (4 attention heads, 2 KV heads, q/k/v biases,
an untied LM head) saved as an HF folder with a word-level tokenizer, so the
real servers can load it: rank r of 2 holds heads 2r..2r+1 and KV head r.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from model_utils import DenseAttentionBackend, save_tiny_model_with_tokenizer

from executor_svc.hf_loader import HFCheckpoint
from executor_svc.model import LlamaForCausalLM
from pagedserve_client import Client
from tests.servers import REPO, Servers, health_status, wait_serving

EXECUTOR_ARGS = ["--dtype", "float32", "--kv-cache-gib", "0.05"]
# Prompts of different lengths, two of them sharing a prefix (prefix-cache hits
# and chunks of various sizes reach the sharded attention).
PROMPTS = [[(7 * i + 13 * j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(4)]
PROMPTS.append(PROMPTS[3][:32] + [11, 12, 13])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tiny_qwen2"))
    save_tiny_model_with_tokenizer(folder)
    return folder


def load_shard(folder: str, tp_rank: int, tp_size: int) -> LlamaForCausalLM:
    checkpoint = HFCheckpoint(folder)
    model = LlamaForCausalLM(checkpoint.config, DenseAttentionBackend(), tp_rank=tp_rank, tp_size=tp_size)
    model.load_weights(checkpoint.tensor)
    return model


def test_shards_concatenate_back_to_the_full_weights(tiny_model):
    full = load_shard(tiny_model, 0, 1)
    shards = [load_shard(tiny_model, r, 2) for r in range(2)]
    cfg = full.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    # Within each shard's fused matrices: [its q heads | its k head | its v head], [its gate | its up].
    local_q, local_k, local_v = slice(0, q // 2), slice(q // 2, q // 2 + kv // 2), slice(q // 2 + kv // 2, None)
    local_gate, local_up = slice(0, inter // 2), slice(inter // 2, None)

    def gathered(i: int, name: str, local: slice = slice(None), dim: int = 0) -> torch.Tensor:
        return torch.cat([getattr(s.layers[i], name)[local] for s in shards], dim=dim)

    for i, layer in enumerate(full.layers):
        assert shards[0].layers[i].qkv_weight.shape == ((q + 2 * kv) // 2, cfg.hidden_size)
        assert torch.equal(gathered(i, "qkv_weight", local_q), layer.qkv_weight[:q])
        assert torch.equal(gathered(i, "qkv_weight", local_k), layer.qkv_weight[q : q + kv])
        assert torch.equal(gathered(i, "qkv_weight", local_v), layer.qkv_weight[q + kv :])
        assert torch.equal(gathered(i, "qkv_bias", local_q), layer.qkv_bias[:q])
        assert torch.equal(gathered(i, "qkv_bias", local_k), layer.qkv_bias[q : q + kv])
        assert torch.equal(gathered(i, "qkv_bias", local_v), layer.qkv_bias[q + kv :])
        assert torch.equal(gathered(i, "o_weight", dim=1), layer.o_weight)
        assert torch.equal(gathered(i, "gate_up_weight", local_gate), layer.gate_up_weight[:inter])
        assert torch.equal(gathered(i, "gate_up_weight", local_up), layer.gate_up_weight[inter:])
        assert torch.equal(gathered(i, "down_weight", dim=1), layer.down_weight)
        for s in shards:
            assert torch.equal(s.layers[i].input_norm, layer.input_norm)
            assert torch.equal(s.layers[i].post_norm, layer.post_norm)
    for s in shards:  # replicated
        assert torch.equal(s.embed_tokens, full.embed_tokens)
        assert torch.equal(s.lm_head, full.lm_head)
        assert torch.equal(s.norm, full.norm)


def test_a_size_that_does_not_divide_the_kv_heads_is_refused_at_start(tiny_model):
    config = HFCheckpoint(tiny_model).config
    with pytest.raises(ValueError, match=r"does not divide num_key_value_heads=2 .*sizes that fit this model: 1, 2"):
        LlamaForCausalLM(config, DenseAttentionBackend(), tp_rank=0, tp_size=4)
    # The executor refuses before it starts any other rank, with the same message.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "executor_svc",
            "--listen",
            "127.0.0.1:0",
            "--model",
            tiny_model,
            "--tensor-parallel-size",
            "4",
            *EXECUTOR_ARGS,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "--tensor-parallel-size 4 does not divide num_key_value_heads=2" in proc.stderr + proc.stdout
    assert "tensor_parallel_rank_started" not in proc.stderr + proc.stdout


def generate_all(s: Servers) -> list[list[int]]:
    with Client(s.public_addr) as c:
        return [
            c.complete(token_ids=p, max_tokens=16, temperature=0.0, ignore_eos=True, timeout=120)[0].token_ids
            for p in PROMPTS
        ]


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.e2e
def test_two_ranks_generate_what_one_does_and_stop_together(tiny_model):
    with Servers(executor_args=["--model", tiny_model, *EXECUTOR_ARGS]) as s:
        reference = generate_all(s)
    assert all(len(tokens) == 16 for tokens in reference)
    with Servers(executor_args=["--model", tiny_model, *EXECUTOR_ARGS, "--tensor-parallel-size", "2"]) as s:
        assert generate_all(s) == reference
        # Again: the second round hits the prefix cache of the first on both ranks.
        assert generate_all(s) == reference
        followers = children(s.executor.pid)
        assert len(followers) == 1, f"rank 0 should have one follower, has {followers}"
        s.executor.send_signal(signal.SIGTERM)
        assert s.executor.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while alive(followers[0]):
            assert time.monotonic() < deadline, "rank 1 outlived rank 0's SIGTERM"
            time.sleep(0.1)


@pytest.mark.e2e
def test_rank_0_exits_nonzero_when_a_follower_dies(tiny_model):
    s = Servers(executor_args=["--model", tiny_model, *EXECUTOR_ARGS, "--tensor-parallel-size", "2"])
    try:
        s.start_executor()
        target = s.executor_addr
        wait_serving(target, [s.executor], timeout=120)
        (follower,) = children(s.executor.pid)
        os.kill(follower, signal.SIGKILL)
        assert s.executor.wait(timeout=30) != 0
        assert health_status(target) is None
        assert '"tensor_parallel_rank_died"' in s.logs("executor")
    finally:
        s.stop()
