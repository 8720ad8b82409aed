"""Overlap scheduling at GPU-like step times: the real scheduler against a stand-in executor.

    .venv/bin/python -m bench.overlap_sim [--step-ms 2,5,20] [--requests 64] [--max-tokens 64] [--rounds 2]

On this CPU a step takes ~100-200 ms, so the few milliseconds the scheduler
and the gRPC hop spend between steps are ~2% of it. On a GPU a decode step
of a small model takes a few milliseconds, and the same gap would be a large
share. This runs the real scheduler process, over the real Step stream, against
an executor process that holds no model: it keeps the protocol's request state
(tests/fake_executor.py, which also checks every plan) and sleeps `--step-ms`
per step in place of a forward pass. Each configuration runs with overlap
scheduling off, then on, alternated per round, and reports, over the steps
after the first ten, the executor's busy fraction (as bench.overhead) and
output tokens per second.

Run as `python -m bench.overlap_sim --serve ADDRESS --step-ms X` it is that
stand-in executor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from types import SimpleNamespace

from bench.overhead import step_lines, step_stats
from pagedserve_client import AsyncClient
from tests.servers import Servers

VOCAB = 200  # a word-level tokenizer: ids 1..199 are the words "w1".."w199"
PROMPT_LEN = 64


class StandInWorker:
    """What ExecutorServicer needs of a Worker: configure() and a runner whose execute() sleeps."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.runner = None

    @property
    def configured(self) -> bool:
        return self.runner is not None

    def configure(self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int):
        from fake_executor import FakeExecutor, word_tokenizer_json

        num_blocks = 8192
        fake = FakeExecutor(block_size, num_blocks, VOCAB, verify_kv=False)
        step_s = self.step_s

        def execute(plan):
            start = time.perf_counter_ns()
            result = fake.execute(plan)
            time.sleep(max(0.0, step_s - (time.perf_counter_ns() - start) / 1e9))
            result.execute_time_ns = time.perf_counter_ns() - start
            return result

        self.runner = SimpleNamespace(execute=execute)
        model = SimpleNamespace(
            model_name="stand-in", architecture="none", vocab_size=VOCAB, eos_token_ids=(), bos_token_id=None
        )
        tokenizer = SimpleNamespace(
            tokenizer_json=word_tokenizer_json(VOCAB), chat_template="", bos_token="", eos_token="", add_bos_token=False
        )
        return SimpleNamespace(
            model=model,
            tokenizer=tokenizer,
            max_model_len=4096,
            num_kv_blocks=num_blocks,
            kv_cache_bytes=0,
            dtype_name="none",
            device="none",
            attention_backend="none",
        )


async def serve_stand_in(listen: str, step_s: float) -> None:
    from grpc_health.v1 import health_pb2

    from executor_svc.metrics import ExecutorMetrics
    from executor_svc.server import forward_thread, serve
    from shared.executor_secret import default_secret_dir, installation_secret

    # The secret the scheduler it serves uses (the same variable the real executor reads).
    secret = installation_secret(os.environ.get("PAGEDSERVE_SECRET_DIR") or default_secret_dir(os.environ))
    server, health = await serve(StandInWorker(step_s), listen, ExecutorMetrics(), secret, forward_thread())
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


class SimServers(Servers):
    """Servers whose executor is the stand-in."""

    step_ms: float = 0.0

    def start_executor(self) -> None:
        self.executor = self._spawn(
            "bench.overlap_sim", ["--serve", self.executor_addr, "--step-ms", str(self.step_ms)], "executor.log"
        )


def run_once(step_ms: float, overlap: bool, num_requests: int, max_tokens: int) -> dict:
    scheduler_args = ["--log-level", "debug", "--log-json"] + ([] if overlap else ["--no-overlap-scheduling"])
    servers = SimServers(scheduler_args=scheduler_args)
    servers.step_ms = step_ms
    prompts = [[1 + (7 * i + j) % (VOCAB - 1) for j in range(PROMPT_LEN)] for i in range(num_requests)]

    async def submit_all(target: str) -> None:
        # All at once from one event loop, so every decode step carries every request.
        async with AsyncClient(target) as c:
            await asyncio.gather(
                *(c.complete(token_ids=p, max_tokens=max_tokens, ignore_eos=True, temperature=0.0) for p in prompts)
            )

    with servers as s:
        asyncio.run(submit_all(s.public_addr))
        st = step_stats(step_lines(s.logs("scheduler")))
    return dict(
        steps=st["steps"],
        busy=st["busy"] / st["wall"],
        ms_per_step=1e3 * st["wall"] / st["steps"],
        tokens_per_s=st["tokens"] / st["wall"],
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", default="2,5,20", help="the stand-in's time per step, comma list")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        sys.path.insert(0, "tests")
        import uvloop  # as the real executor runs

        uvloop.run(serve_stand_in(a.serve, float(a.step_ms) / 1e3))
        return
    print(f"{'step ms':>7} {'overlap':>7} {'round':>5} {'steps':>5} {'busy':>6} {'ms/step':>8} {'tok/s':>8}")
    for step_ms in (float(x) for x in a.step_ms.split(",")):
        per_mode = {False: [], True: []}
        for r in range(a.rounds):
            for overlap in (False, True):
                out = run_once(step_ms, overlap, a.requests, a.max_tokens)
                per_mode[overlap].append(out)
                print(
                    f"{step_ms:7.1f} {'on' if overlap else 'off':>7} {r + 1:5d} {out['steps']:5d} "
                    f"{100 * out['busy']:5.1f}% {out['ms_per_step']:8.2f} {out['tokens_per_s']:8.0f}",
                    flush=True,
                )
        med = {m: statistics.median(o["tokens_per_s"] for o in v) for m, v in per_mode.items()}
        print(f"{step_ms:7.1f} ms steps: overlap on / off = {med[True] / med[False]:.2f}x output tok/s (medians)")


if __name__ == "__main__":
    main()
