"""Request intake: a validated GenerationInput becomes scheduler requests.

A request with `n` samples is n independent scheduler requests, "id#0" ..
"id#{n-1}" (just "id" when n == 1), that share the prompt (the prefix cache
shares its blocks) and differ in seed: sample i uses (seed + i) mod 2**64.
Each constrained sample gets its own grammar matcher, compiled once per
request beforehand (`compile_constraint`, off the event loop), and each
sample its own incremental detokenizer, built from the request's stop
options (the output processor runs it).

Admission refuses, before touching anything: an id that collides with a live
request's or sample's (KeyError), and a queue already at --max-waiting
(QueueFull).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.grammar import CompiledGrammar, Constraint, GrammarCompiler
from scheduler_svc.output_processor import OutputProcessor, RequestHandle
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.tokenizer import Tokenizer
from shared.sampling_params import SamplingParams


class QueueFull(RuntimeError):
    """Too many requests are waiting."""


@dataclass(frozen=True)
class GenerationInput:
    """A validated request, ready to run: everything the engine needs."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # sample i uses (seed + i) mod 2**64 when a seed is set
    n: int
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    priority: int = 0
    constraint: Constraint | None = None  # structured output; compile with Engine.compile_constraint


def sample_ids(gen: GenerationInput) -> list[str]:
    return [gen.request_id] if gen.n == 1 else [f"{gen.request_id}#{i}" for i in range(gen.n)]


def fan_out(
    gen: GenerationInput, grammar: CompiledGrammar | None, eos_token_ids: frozenset[int], arrival: float
) -> list[Request]:
    """The scheduler requests of `gen`'s samples, in sample order."""
    # While min_tokens is not reached, the sampler masks the stop tokens and (unless ignored) EOS.
    masked = (
        tuple(sorted(gen.stop_token_ids | (frozenset() if gen.ignore_eos else eos_token_ids))) if gen.min_tokens else ()
    )
    requests = []
    for i, sample_id in enumerate(sample_ids(gen)):
        # Seeds are uint64 end to end: sample i of a seed near 2**64 wraps around.
        seed = None if gen.sampling.seed is None else (gen.sampling.seed + i) % 2**64
        sampling = SamplingParams(
            **{**gen.sampling.__dict__, "seed": seed, "min_tokens": gen.min_tokens, "min_tokens_masked_ids": masked}
        )
        requests.append(
            Request(
                request_id=sample_id,
                prompt_token_ids=list(gen.prompt_token_ids),
                sampling=sampling,
                max_tokens=gen.max_tokens,
                eos_token_ids=eos_token_ids,
                stop_token_ids=gen.stop_token_ids,
                ignore_eos=gen.ignore_eos,
                min_tokens=gen.min_tokens,
                priority=gen.priority,
                arrival_time=arrival,
                grammar=None if grammar is None else grammar.matcher(),
            )
        )
    return requests


class Intake:
    def __init__(
        self,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        tokenizer: Tokenizer,
        grammars: GrammarCompiler,
        eos_token_ids: frozenset[int],
        max_waiting: int,
    ):
        self._scheduler = scheduler
        self._outputs = outputs
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._eos = eos_token_ids
        self._max_waiting = max_waiting

    async def compile_constraint(self, gen: GenerationInput) -> CompiledGrammar | None:
        """The request's compiled constraint (None if it has none); raises GrammarError.

        Runs in a worker thread: other requests keep running while it compiles.
        The request keeps its arrival time, so it queues as if it had waited
        in the queue meanwhile.
        """
        return None if gen.constraint is None else await self._grammars.compile(gen.constraint)

    def submit(
        self, gen: GenerationInput, grammar: CompiledGrammar | None, arrival: float | None, owner: str
    ) -> RequestHandle:
        """Admits `gen`: its samples' streams open and their requests wait in the scheduler."""
        # Sample ids share one namespace with plain request ids: a request named
        # "x#0" collides with sample 0 of a live "x" (n > 1), and vice versa.
        # Refuse before touching anything, or the live sample's stream is lost.
        if self._outputs.taken(gen.request_id, sample_ids(gen)):
            raise KeyError(gen.request_id)
        waiting = len(self._scheduler.waiting)
        if waiting + gen.n > self._max_waiting:
            raise QueueFull(f"{waiting} requests are waiting (limit --max-waiting {self._max_waiting})")
        handle = RequestHandle(gen.request_id, gen.n, prompt_tokens=len(gen.prompt_token_ids), owner=owner)
        if arrival is not None:
            handle.arrival = arrival
        requests = fan_out(gen, grammar, self._eos, handle.arrival)
        for request in requests:  # before any stream opens: a refusal leaves nothing behind
            self._scheduler.check_fits(request)
        detoks = [
            IncrementalDetokenizer(
                self._tokenizer, gen.prompt_token_ids, list(gen.stop), gen.include_stop_str_in_output
            )
            for _ in requests
        ]
        self._outputs.add(handle, requests, detoks)
        for request in requests:
            self._scheduler.add_request(request)
        return handle
