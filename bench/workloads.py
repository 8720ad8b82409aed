"""Benchmark workloads: seeded request lists and a JSONL reader.

A workload is a list of `BenchRequest`s. Every suite sends prompts as token
ids with `ignore_eos`, so each request produces exactly `max_tokens` tokens
and two systems given the same list do the same work; greedy (temperature
0) unless --temperature/--top-p/--top-k ask every request to sample.

Generators are pure functions of their seed: the same arguments give the same
list on every machine, which is what lets PagedServe, Hugging Face and vLLM be
compared on identical requests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass

# Random prompts skip the first ids of the vocabulary, where tokenizers keep
# their special and control tokens (SmolLM2's are 0..16): a prompt should look
# like ordinary text to the model, not like a stream of chat-turn markers.
FIRST_ORDINARY_TOKEN_ID = 100


@dataclass
class BenchRequest:
    """One request: a prompt (token ids, or text to be tokenized once) and its output length."""

    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("a BenchRequest needs exactly one of prompt_token_ids and prompt")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"need temperature >= 0, top_p in (0, 1], top_k >= 0; got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def prompt_len(self) -> int:
        assert self.prompt_token_ids is not None, "prompt_len of a text prompt: tokenize the workload first"
        return len(self.prompt_token_ids)


def parse_range(text: str) -> tuple[int, int]:
    """'64:512' -> (64, 512); '128' -> (128, 128). Both ends inclusive."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"bad length range {text!r}: expected LO:HI with 1 <= LO <= HI")
    return lo_i, hi_i


def _random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(length)]


def with_distinct_first_token(requests: list[BenchRequest], k: int, vocab_size: int) -> list[BenchRequest]:
    """Copies whose prompts start with a token id unique to pass k.

    Block hashes chain from the first block, so pass k shares no cached
    prefix with the passes before it: repeating a workload against one
    engine must not turn later passes into prefix-cache hits. Lengths, and
    so the work, stay the same.
    """
    token = FIRST_ORDINARY_TOKEN_ID + k % (vocab_size - FIRST_ORDINARY_TOKEN_ID)
    return [dataclasses.replace(r, prompt_token_ids=[token, *r.prompt_token_ids[1:]]) for r in requests]


def uniform_workload(
    num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """Prompt and output lengths uniform over the inclusive ranges; random-token prompts."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        p, o = rng.randint(*prompt_len), rng.randint(*output_len)
        out.append(BenchRequest(max_tokens=o, prompt_token_ids=_random_prompt(rng, p, vocab_size)))
    return out


def _clipped_lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def long_tail_workload(
    num_requests: int,
    vocab_size: int,
    seed: int = 0,
    *,
    prompt_median: int = 160,
    output_median: int = 96,
    prompt_max: int = 1024,
    output_max: int = 512,
) -> list[BenchRequest]:
    """Lengths like chat traffic: log-normal, most requests short, a few long.

    Medians and spreads are chosen to resemble public chat logs (prompts a few
    hundred tokens with a tail past a thousand, answers around a hundred with a
    tail of long ones), clipped so that prompt + output fits a small context.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        p = _clipped_lognormal(rng, prompt_median, 0.9, 8, prompt_max)
        o = _clipped_lognormal(rng, output_median, 0.8, 8, output_max)
        out.append(BenchRequest(max_tokens=o, prompt_token_ids=_random_prompt(rng, p, vocab_size)))
    return out


def shared_prefix_workload(
    num_requests: int, prefix_len: int, suffix_len: tuple[int, int], output_len: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """One shared 'system prompt' of prefix_len tokens, then a distinct suffix per request.

    request i:  [ shared prefix (prefix_len) | suffix_i (suffix_len) ]
    """
    rng = random.Random(seed)
    prefix = _random_prompt(rng, prefix_len, vocab_size)
    return [
        BenchRequest(
            max_tokens=output_len, prompt_token_ids=prefix + _random_prompt(rng, rng.randint(*suffix_len), vocab_size)
        )
        for _ in range(num_requests)
    ]


def read_jsonl(path: str, limit: int | None = None) -> list[BenchRequest]:
    """One JSON object a line: {"prompt_token_ids": [...]} or {"prompt": "..."}, and "max_tokens"."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ids = obj.get("prompt_token_ids")
                out.append(
                    BenchRequest(
                        max_tokens=int(obj["max_tokens"]),
                        prompt=obj.get("prompt"),
                        prompt_token_ids=[int(t) for t in ids] if ids is not None else None,
                    )
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if limit is not None and len(out) == limit:
                break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def tokenize_text_prompts(requests: list[BenchRequest], tokenize) -> list[BenchRequest]:
    """Replaces text prompts with token ids (tokenize: str -> list[int]), once, before any timing."""
    return [
        r
        if r.prompt_token_ids is not None
        else BenchRequest(max_tokens=r.max_tokens, prompt_token_ids=list(tokenize(r.prompt)))
        for r in requests
    ]


def check_fits(requests: list[BenchRequest], max_model_len: int, vocab_size: int) -> None:
    """Raises ValueError when a request could not produce exactly max_tokens on this server."""
    for i, r in enumerate(requests):
        if r.prompt_len + r.max_tokens > max_model_len:
            raise ValueError(
                f"request {i}: prompt {r.prompt_len} + max_tokens {r.max_tokens} exceeds the "
                f"server's max_model_len {max_model_len}"
            )
        if r.prompt_token_ids and max(r.prompt_token_ids) >= vocab_size:
            raise ValueError(f"request {i}: token id {max(r.prompt_token_ids)} >= vocab_size {vocab_size}")


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: exponential gaps with mean 1/rate; inf rate = all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def describe(requests: list[BenchRequest]) -> dict:
    """Summary recorded in every result file."""
    p = [r.prompt_len for r in requests]
    o = [r.max_tokens for r in requests]
    return dict(
        num_requests=len(requests),
        prompt_tokens=sum(p),
        output_tokens=sum(o),
        prompt_len_min=min(p),
        prompt_len_max=max(p),
        output_len_min=min(o),
        output_len_max=max(o),
        sampling=sorted({(r.temperature, r.top_p, r.top_k) for r in requests}),
    )


def add_workload_args(p, *, num_requests: int = 64, prompt_len: str = "64:512", output_len: str = "32:256") -> None:
    """The workload flags shared by the throughput and memory suites."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=("uniform", "longtail"),
        default="uniform",
        help="uniform: lengths uniform over --prompt-len/--output-len; longtail: log-normal like chat traffic",
    )
    g.add_argument(
        "--jsonl",
        default=None,
        help="read requests from a JSONL file ({prompt_token_ids | prompt, max_tokens} a line) instead",
    )
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument("--prompt-len", default=prompt_len, help="LO:HI tokens (uniform workload)")
    g.add_argument("--output-len", default=output_len, help="LO:HI tokens (uniform workload)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="every request's (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="every request's (0: off)")


def workload_from_args(args, vocab_size: int, tokenize) -> list[BenchRequest]:
    """Builds (or reads, then tokenizes) the workload the flags describe."""
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.jsonl:
        requests = tokenize_text_prompts(read_jsonl(args.jsonl, limit=args.num_requests), tokenize)
    elif args.workload == "longtail":
        requests = long_tail_workload(args.num_requests, vocab_size, args.seed)
    else:
        requests = uniform_workload(
            args.num_requests, parse_range(args.prompt_len), parse_range(args.output_len), vocab_size, args.seed
        )
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    return [dataclasses.replace(r, **sampling) for r in requests]
