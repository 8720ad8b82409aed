"""The public gRPC edge: the `Generation` service, health and reflection.

Status codes a client can receive:
  INVALID_ARGUMENT    a field is out of range (BadRequest details name it), or the message does not parse
  OUT_OF_RANGE        prompt (+ max_tokens) longer than the context or KV cache
  ALREADY_EXISTS      request_id is already live
  RESOURCE_EXHAUSTED  the waiting queue is full, the message is too large, or the
                      output constraint took longer than --grammar-compile-timeout to compile
  UNAVAILABLE         executor unreachable (past --executor-recovery-timeout) or draining
  UNAUTHENTICATED     bearer token missing or wrong (when tokens are configured), unknown methods included
  DEADLINE_EXCEEDED   the client's deadline passed (the request is aborted and freed)
  INTERNAL            an unexpected failure of this request's step; others continue

Tokenizing, chat rendering and detokenizing of large inputs run in worker
threads (scheduler_svc/text_work.py), never on the event loop. Request
listings are scoped to the caller (shared/grpc_auth.py) unless it is an admin.
"""

from __future__ import annotations

import time

import grpc
import structlog
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.engine import Engine, EngineUnavailable
from scheduler_svc.grammar import GrammarError, GrammarTimeout
from scheduler_svc.intake import QueueFull
from scheduler_svc.output_processor import FinishReason, SampleOutput
from scheduler_svc.scheduler import RequestTooLong
from scheduler_svc.text_work import TextWorkers
from scheduler_svc.validation import InvalidRequest, Limits, chat_work_size, render_chat, to_generation_input, work_size
from shared.grpc_auth import ANONYMOUS, Caller, TokenTable
from shared.sampling_params import MAX_LOGPROBS

log = structlog.get_logger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name

_FINISH_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


async def abort_invalid(context, err: InvalidRequest):
    detail = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=err.field, description=err.description)]
    )
    status = status_pb2.Status(code=getattr(code_pb2, err.code.name), message=str(err))
    status.details.add().Pack(detail)
    await context.abort_with_status(rpc_status.to_status(status))


def to_response(request_id: str, out: SampleOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=request_id, index=out.index, token_ids=out.token_ids, text=out.text)
    for lp, token in zip(out.logprobs, out.token_ids):
        msg.logprobs.add(
            token_id=token, logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top]
        )
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH_PB[out.finish_reason]
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                cached_prompt_tokens=out.cached_prompt_tokens,
            )
        )
        msg.matched_stop = out.matched_stop
        if out.matched_stop_token_id is not None:
            msg.matched_stop_token_id = out.matched_stop_token_id
    return msg


_CHUNK = 1 << 15  # elements per piece of a large response: a few ms of GIL each


def tokenize(tok, request: pb.TokenizeRequest, special_tokens_in_content: bool) -> pb.TokenizeResponse | bytes:
    """The Tokenize RPC's work (may run in a worker thread).

    A large answer comes back serialized, in pieces (serialized messages
    concatenate to their merge): building and serializing millions of elements
    in one C call would hold the GIL, and so the event loop, for most of a
    second. shared.grpc_codec.CodecInterceptor passes the bytes through.
    """
    if request.WhichOneof("input") == "chat":
        ids = render_chat(tok, request.chat, "chat", special_tokens_in_content)
    else:
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = tok.encode(request.text, add_special_tokens=add)
    if len(ids) <= _CHUNK:
        return pb.TokenizeResponse(token_ids=ids, tokens=tok.id_to_token(ids))
    return b"".join(
        pb.TokenizeResponse(
            token_ids=ids[i : i + _CHUNK], tokens=tok.id_to_token(ids[i : i + _CHUNK])
        ).SerializeToString()
        for i in range(0, len(ids), _CHUNK)
    )


def detokenize(tok, vocab_size: int, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
    """The Detokenize RPC's work (may run in a worker thread)."""
    ids = list(request.token_ids)
    if ids and max(ids) >= vocab_size:
        bad = next(t for t in ids if t >= vocab_size)
        raise InvalidRequest("token_ids", f"token id {bad} is outside the vocabulary (size {vocab_size})")
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return pb.DetokenizeResponse(text=tok.decode(ids, skip_special_tokens=skip))


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: Engine, config, tokens: TokenTable | None = None, workers: TextWorkers | None = None):
        self.engine = engine
        self.config = config
        self.tokens = tokens  # None: no authentication, every caller is ANONYMOUS
        self.workers = workers or TextWorkers()

    def _caller(self, context) -> Caller:
        if self.tokens is None:
            return ANONYMOUS
        caller = self.tokens.identify(context.invocation_metadata())
        assert caller is not None, "BearerAuthInterceptor admits only known tokens"
        return caller

    def _limits(self) -> Limits:
        info, cfg = self.engine.info, self.config
        return Limits(
            vocab_size=info.vocab_size,
            max_model_len=self.engine.max_model_len,
            max_n=cfg.max_n,
            max_stop_strings=cfg.max_stop_strings,
            max_stop_string_bytes=cfg.max_stop_string_bytes,
            max_prompt_chars=self.engine.max_model_len * self.engine.tokenizer.max_token_chars,
            special_tokens_in_content=cfg.allow_special_tokens_in_content,
        )

    async def _require_engine(self, context) -> None:
        if self.engine.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the executor has not connected yet")

    async def Generate(self, request: pb.GenerateRequest, context):
        await self._require_engine(context)
        caller = self._caller(context)
        try:
            gen = await self.workers.run(
                work_size(request), to_generation_input, request, self.engine.tokenizer, self._limits()
            )
        except InvalidRequest as e:
            await abort_invalid(context, e)
        arrival = time.monotonic()
        try:
            grammar = await self.engine.compile_constraint(gen)
        except GrammarError as e:
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(e, GrammarTimeout)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            kind = gen.constraint.kind
            field = "constraint.grammar.source" if kind in ("lark", "gbnf") else f"constraint.{kind}"
            await abort_invalid(context, InvalidRequest(field, str(e), code))
        try:
            handle = self.engine.submit(gen, grammar, arrival, owner=caller.name)
        except KeyError:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {gen.request_id!r} is already live")
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except RequestTooLong as e:  # the context shrank (an executor came back smaller) since validation
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        finished = 0
        try:
            while finished < handle.n:
                out: SampleOutput = await handle.queue.get()
                if out.unavailable:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, "the executor did not come back within --executor-recovery-timeout"
                    )
                if out.error:
                    await context.abort(grpc.StatusCode.INTERNAL, f"request failed inside the engine: {out.error}")
                if self.engine.draining and out.finish_reason is FinishReason.ABORT:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
                finished += out.finish_reason is not None
                yield to_response(gen.request_id, out)
        finally:
            # Cancelled, deadline passed, or failed: whatever is still open frees its blocks now.
            if finished < handle.n:
                self.engine.abort(handle)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse | bytes:
        await self._require_engine(context)
        size = chat_work_size(request.chat) if request.WhichOneof("input") == "chat" else len(request.text)
        try:
            return await self.workers.run(
                size, tokenize, self.engine.tokenizer, request, self.config.allow_special_tokens_in_content
            )
        except InvalidRequest as e:
            await abort_invalid(context, e)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        await self._require_engine(context)
        try:
            return await self.workers.run(
                len(request.token_ids), detokenize, self.engine.tokenizer, self.engine.info.vocab_size, request
            )
        except InvalidRequest as e:
            await abort_invalid(context, e)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        await self._require_engine(context)
        info, cfg = self.engine.info, self.config
        return pb.ModelInfo(
            model_name=info.model_name,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            max_model_len_tokens=self.engine.max_model_len,
            eos_token_ids=list(info.eos_token_ids),
            block_size_tokens=cfg.scheduler.block_size,
            dtype=info.dtype,
            has_chat_template=self.engine.tokenizer.has_chat_template,
            max_n=cfg.max_n,
            max_logprobs=MAX_LOGPROBS,
            max_stop_strings=cfg.max_stop_strings,
            max_stop_string_bytes=cfg.max_stop_string_bytes,
        )

    async def GetServerStatus(self, request: pb.GetServerStatusRequest, context) -> pb.ServerStatus:
        await self._require_engine(context)
        s = self.engine.scheduler.stats()
        msg = pb.ServerStatus(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_cached_free=s.kv_blocks_cached_free,
            prefix_cache_queries_tokens=s.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=s.prefix_cache_hits_tokens,
            num_preemptions=s.num_preemptions,
            executor_connected=self.engine.connected,
            num_steps=s.num_steps,
        )
        if request.include_requests:
            # A caller sees only its own requests (ids and prompt lengths are its business); an admin sees all.
            caller = self._caller(context)
            for r in self.engine.live_requests(None if caller.admin else caller.name):
                msg.requests.add(
                    request_id=r.request_id,
                    status=int(r.status),
                    prompt_tokens=r.num_prompt_tokens,
                    output_tokens=r.num_output_tokens,
                    computed_tokens=r.num_computed_tokens,
                    kv_blocks=len(r.block_ids),
                    priority=r.priority,
                )
        return msg
