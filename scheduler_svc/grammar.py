"""Structured output in the scheduler: compile a constraint once, match each sample's tokens.

llguidance does the work (docs/structured_output.md says why: torch-free,
~1 ms compiles, ~13 us masks on this vocabulary). A `Constraint` is the
validated public request's oneof; `GrammarCompiler.compile` turns it into a
`CompiledGrammar` in a worker thread (llguidance drops the GIL while it
builds), caching results per distinct constraint (LRU), errors included, so
a repeated schema costs nothing and a repeated bad one is refused at once.
Every sample gets its own `GrammarMatcher` from the compiled grammar:

    compiled.matcher() ─► bitmask() for the next sample ─► consume(token) ─► ...
                          (EOS allowed only where the output is complete)   is_stopped: complete, nothing may follow

The matcher only ever advances on tokens the scheduler applied, so it is
always in step with the request's output tokens: preemption, recompute and a
lost executor (whose in-flight samples are dropped, never applied) leave it
valid; `GrammarMatcher.num_tokens` is checked against the outputs.
"""

from __future__ import annotations

import asyncio
import collections
import json
import queue
import threading
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from shared.token_mask import mask_width_bytes

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")


@dataclass(frozen=True)
class Constraint:
    """One output constraint, hashable (the compile cache's key).

    spec: the schema / regex / grammar text, or the tuple of choices;
    json_object has spec "".
    """

    kind: str
    spec: str | tuple[str, ...]

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind


class GrammarError(ValueError):
    """The constraint does not compile; the message is the compiler's."""


class GrammarTimeout(GrammarError):
    """Compiling took longer than the configured limit."""


def llguidance_grammar(c: Constraint) -> str:
    """The constraint in llguidance's grammar format (may raise GrammarError for unparsable input)."""
    try:
        if c.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(c.spec)
        if c.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.spec)
        if c.kind == "choice":
            # Lark string literals take JSON's escapes; its lexer also refuses a raw DEL,
            # which JSON leaves unescaped.
            alternatives = " | ".join(
                json.dumps(choice, ensure_ascii=False).replace("\x7f", "\\u007f") for choice in c.spec
            )
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if c.kind == "gbnf":
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(c.spec))
        return llguidance.LLMatcher.grammar_from_lark(c.spec)
    except Exception as e:  # noqa: BLE001 - the parsers' own exception types vary; all mean bad input
        raise GrammarError(str(e)) from e


class GrammarMatcher:
    """One sample's position in its grammar."""

    __slots__ = ("_first", "_matcher", "_width", "num_tokens")

    def __init__(self, matcher: llguidance.LLMatcher, width: int, first: bytes) -> None:
        self._matcher = matcher
        self._width = width
        self._first = first  # the start state's mask, computed when the grammar compiled
        self.num_tokens = 0  # tokens consumed: always the request's output count

    def bitmask(self) -> bytes:
        """Packed allowed-token mask for the next sample (shared/token_mask.py layout)."""
        if self.num_tokens == 0:
            return self._first
        return _fit(self._matcher.compute_bitmask(), self._width)

    def consume(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar does not allow it (then it stays in error)."""
        self.num_tokens += 1
        return self._matcher.consume_token(token_id)

    @property
    def is_stopped(self) -> bool:
        """Complete, and no token but EOS may follow: the sample is done."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class CompiledGrammar:
    """A compiled constraint: a template matcher at the start state, copied per sample."""

    def __init__(self, template: llguidance.LLMatcher, width: int, first: bytes) -> None:
        self._template = template
        self._width = width
        self._first = first

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._width, self._first)


def _fit(mask: bytes, width: int) -> bytes:
    return mask[:width] if len(mask) >= width else mask + bytes(width - len(mask))


class GrammarCompiler:
    """Compiles constraints on worker threads, off the event loop, with an LRU cache."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        workers: int = 2,
        cache_size: int = 256,
        timeout_s: float = 10.0,
    ) -> None:
        self._tokenizer_args = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error = ""
        self._tokenizer_lock = threading.Lock()
        self._width = mask_width_bytes(vocab_size)
        # `workers` daemon threads, started as compiles arrive, take compiles
        # from one queue: one that never ends (see compile_now) must not hold up
        # the process's exit, as a ThreadPoolExecutor's worker would.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers, self._started = workers, 0
        self._cache: collections.OrderedDict[Constraint, asyncio.Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self.timeout_s = timeout_s

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.3 s for 49k tokens), in a worker: a server that never sees a
        constraint never pays for it, and a tokenizer llguidance cannot read (e.g. word-level)
        only disables structured output."""
        with self._tokenizer_lock:
            if self._tokenizer is None and not self._tokenizer_error:
                tokenizer_json, vocab_size, eos = self._tokenizer_args
                try:
                    self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
                except Exception as e:  # noqa: BLE001 - any failure means: no structured output for this model
                    self._tokenizer_error = f"structured output is unavailable for this model's tokenizer: {e}"
            if self._tokenizer is None:
                raise GrammarError(self._tokenizer_error)
            return self._tokenizer

    def compile_now(self, constraint: Constraint) -> CompiledGrammar:
        """Compiles on the calling thread (a worker's job; tests), the start
        state's mask included: llguidance builds its lexer lazily, while
        computing masks, and for some grammars that first build is where all
        the time goes (`start: A B; A: /a+/; B: /a/` runs for minutes in
        llguidance 1.9 whatever its fuel limits). Computed here, it is under
        the compile timeout, off the event loop; on the step loop it would
        stall every request."""
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), llguidance_grammar(constraint), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        first = _fit(matcher.compute_bitmask(), self._width)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return CompiledGrammar(matcher, self._width, first)

    async def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar, from the cache or a worker; GrammarError if it does not compile in time.

        Identical constraints compiling at once share one compile. A compile
        that times out keeps running in its worker (threads cannot be
        stopped) and stays cached: a later identical request gets its result.
        """
        future = self._cache.get(constraint)
        if future is None:
            future = self._in_thread(constraint)
            self._cache[constraint] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(constraint)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarTimeout(
                f"compiling the constraint took longer than the server's limit of "
                f"{self.timeout_s:g} s (--grammar-compile-timeout); simplify it"
            ) from None

    def _in_thread(self, constraint: Constraint) -> asyncio.Future:
        """compile_now(constraint) on a worker thread; its result as a future of this loop."""
        future = asyncio.get_running_loop().create_future()
        self._jobs.put((constraint, asyncio.get_running_loop(), future))
        if self._started < self._workers:  # only the event loop's thread gets here
            threading.Thread(target=self._work, name="grammar", daemon=True).start()
            self._started += 1
        return future

    def _work(self) -> None:
        while True:
            constraint, loop, future = self._jobs.get()
            try:
                outcome = (future.set_result, self.compile_now(constraint))
            except Exception as e:  # noqa: BLE001 - handed to the awaiting request
                outcome = (future.set_exception, e)
            except BaseException as e:  # noqa: BLE001 - a panic in llguidance (pyo3's PanicException)
                outcome = (future.set_exception, GrammarError(f"the grammar compiler failed: {type(e).__name__}"))
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the loop closed meanwhile: nobody is waiting
                pass


def _settle(future: asyncio.Future, method, value) -> None:
    if not future.done():
        method(value)
