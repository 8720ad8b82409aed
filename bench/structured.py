"""Structured output's cost: a workload where 25% of requests carry a JSON schema, against
the same workload unconstrained, alternating on one engine.

    python -m bench.structured [--num-requests 32] [--repeats 3] [--fraction 0.25]

Each round runs the plain workload (A), then the same prompts with every
fourth request constrained by one of bench/grammar_schemas.py's schemas (B).
Reported per round and as medians: wall time, engine steps, output tokens/s, and the mean
time per output token (TPOT) of the requests that are unconstrained in both
(what the constrained ones cost their neighbours, the issue's target) and of
the constrained ones (which run in lockstep under overlap scheduling, so they
are expected to be slower per token). Greedy, ignore_eos: an unconstrained
request always runs to max_tokens; a constrained one may finish earlier when
its JSON is complete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from bench.grammar_schemas import SCHEMAS
from bench.run_servers import EngineFlags, running_engine
from bench.workloads import FIRST_ORDINARY_TOKEN_ID
from pagedserve.v1 import generation_pb2 as pb
from pagedserve_client import AsyncClient


async def _one(client, prompt, max_tokens, constraint, t0):
    sent = time.perf_counter() - t0
    times, tokens = [], 0
    async for msg in client.generate(
        token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0, constraint=constraint
    ):
        if msg.token_ids:
            times.append(time.perf_counter() - t0)
            tokens += len(msg.token_ids)
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
    return {"sent": sent, "end": times[-1], "tokens": tokens, "tpot": tpot}


async def _run(target, prompts, max_tokens, constraints):
    async with AsyncClient(target) as client:
        steps = (await client.server_status()).num_steps
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(_one(client, p, max_tokens, c, t0) for p, c in zip(prompts, constraints)))
        steps = (await client.server_status()).num_steps - steps
    return recs, max(r["end"] for r in recs), steps


def _summary(recs, wall, steps, constrained):
    plain = [r["tpot"] for r, c in zip(recs, constrained) if not c and r["tpot"] is not None]
    cons = [r["tpot"] for r, c in zip(recs, constrained) if c and r["tpot"] is not None]
    out = sum(r["tokens"] for r in recs)
    return {
        "wall_s": round(wall, 2),
        "steps": steps,
        "output_tokens": out,
        "tok_per_s": round(out / wall, 1),
        "tpot_ms_unconstrained": round(1e3 * statistics.mean(plain), 2),
        "tpot_ms_constrained": round(1e3 * statistics.mean(cons), 2) if cons else None,
        "constrained_tokens": sum(r["tokens"] for r, c in zip(recs, constrained) if c),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--target", default=None)
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(FIRST_ORDINARY_TOKEN_ID, 49152) for _ in range(a.prompt_len)] for _ in range(a.num_requests)
    ]
    every = round(1 / a.fraction)
    schemas = [json.dumps(s) for s, _ in SCHEMAS.values()]
    constraints = [
        pb.OutputConstraint(json_schema=schemas[i // every % len(schemas)]) if i % every == 0 else None
        for i in range(a.num_requests)
    ]
    constrained = [c is not None for c in constraints]
    rounds = []
    with running_engine(EngineFlags(num_threads=a.num_threads), a.target) as target:
        asyncio.run(_run(target, prompts[:4], 8, [None] * 4))  # warm-up
        for k in range(a.repeats):
            for name, cons in (("plain", [None] * a.num_requests), ("25pct_json", constraints)):
                recs, wall, steps = asyncio.run(_run(target, prompts, a.max_tokens, cons))
                row = {"round": k, "workload": name, **_summary(recs, wall, steps, constrained)}
                rounds.append(row)
                print(json.dumps(row), flush=True)
    for name in ("plain", "25pct_json"):
        rows = [r for r in rounds if r["workload"] == name]
        med = {
            key: statistics.median(r[key] for r in rows)
            for key in ("wall_s", "steps", "tok_per_s", "tpot_ms_unconstrained")
        }
        if name != "plain":
            med["tpot_ms_constrained"] = statistics.median(r["tpot_ms_constrained"] for r in rows)
        print(json.dumps({"median": name, **med}))


if __name__ == "__main__":
    main()
