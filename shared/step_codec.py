"""Converts the step protocol between dataclasses and protobuf.

Used only at the gRPC edges of the two services: the scheduler encodes plans
and decodes results, the executor does the reverse. Decoding is faithful:
arrays keep their lengths, and a StepResult whose arrays are not aligned is
refused (ValueError). A plan's cached_requests arrays are checked where they
are applied (RequestTable.apply), so a malformed plan fails its step the
way every other inconsistent plan does.
"""

from __future__ import annotations

from pagedserve.executor.v1 import executor_pb2 as pb
from shared.sampling_params import SamplingParams
from shared.step_plan import (
    CachedRequestData,
    NewRequestData,
    StepPlan,
    StepResult,
    TokenLogprobs,
)


def sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens,
        min_tokens_masked_ids=s.min_tokens_masked_ids,
        logit_bias_token_ids=[t for t, _ in s.logit_bias],
        logit_bias_values=[b for _, b in s.logit_bias],
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        min_tokens=msg.min_tokens,
        min_tokens_masked_ids=tuple(msg.min_tokens_masked_ids),
        logit_bias=tuple(zip(msg.logit_bias_token_ids, msg.logit_bias_values)),
    )


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    cached = plan.cached_requests
    return pb.StepPlan(
        step_id=plan.step_id,
        new_requests=[
            pb.NewRequest(
                request_id=r.request_id,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_to_proto(r.sampling),
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
            )
            for r in plan.new_requests
        ],
        cached_requests=pb.CachedRequests(
            request_ids=cached.request_ids,
            new_block_ids=[pb.BlockIds(ids=ids) for ids in cached.new_block_ids],
            num_computed_tokens=cached.num_computed_tokens,
            num_scheduled_tokens=cached.num_scheduled_tokens,
        ),
        finished_request_ids=plan.finished_request_ids,
        last_result_step_id=plan.last_result_step_id,
        allowed_token_masks=pb.TokenMasks(
            request_ids=list(plan.allowed_token_masks),
            bitmasks=b"".join(plan.allowed_token_masks.values()),
        )
        if plan.allowed_token_masks
        else None,
    )


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    cached = msg.cached_requests
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[
            NewRequestData(
                request_id=r.request_id,
                token_ids=list(r.token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_from_proto(r.sampling),
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
            )
            for r in msg.new_requests
        ],
        cached_requests=CachedRequestData(
            request_ids=list(cached.request_ids),
            new_block_ids=[list(b.ids) for b in cached.new_block_ids],
            num_computed_tokens=list(cached.num_computed_tokens),
            num_scheduled_tokens=list(cached.num_scheduled_tokens),
        ),
        finished_request_ids=list(msg.finished_request_ids),
        last_result_step_id=msg.last_result_step_id,
        allowed_token_masks=_masks_from_proto(msg.allowed_token_masks),
    )


def _masks_from_proto(msg: pb.TokenMasks) -> dict[str, bytes]:
    ids = msg.request_ids
    if not ids:
        return {}
    width, rest = divmod(len(msg.bitmasks), len(ids))
    if rest or width % 4:
        raise ValueError(f"{len(msg.bitmasks)} mask bytes do not split into {len(ids)} rows of uint32 words")
    data = msg.bitmasks
    return {rid: data[i * width : (i + 1) * width] for i, rid in enumerate(ids)}


def result_to_proto(result: StepResult) -> pb.StepResult:
    ids = list(result.sampled)
    msg = pb.StepResult(
        step_id=result.step_id,
        request_ids=ids,
        sampled_token_ids=[result.sampled[i] for i in ids],
        execute_time_ns=result.execute_time_ns,
        error=result.error,
        failed_request_ids=result.failed_request_ids,
    )
    if result.logprobs:
        for rid in ids:
            lp = result.logprobs.get(rid)
            entry = msg.logprobs.add()
            if lp is not None:
                entry.logprob = lp.logprob
                entry.top.extend(pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top)
    return msg


def result_from_proto(msg: pb.StepResult) -> StepResult:
    n = len(msg.request_ids)
    if len(msg.sampled_token_ids) != n or (msg.logprobs and len(msg.logprobs) != n):
        raise ValueError(
            f"StepResult {msg.step_id}: {n} request_ids, {len(msg.sampled_token_ids)} "
            f"sampled_token_ids and {len(msg.logprobs)} logprobs entries (they must be aligned)"
        )
    sampled = dict(zip(msg.request_ids, msg.sampled_token_ids))
    logprobs = {}
    if msg.logprobs:
        for rid, lp in zip(msg.request_ids, msg.logprobs):
            if lp.HasField("logprob"):
                logprobs[rid] = TokenLogprobs(lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
    return StepResult(
        step_id=msg.step_id,
        sampled=sampled,
        logprobs=logprobs,
        execute_time_ns=msg.execute_time_ns,
        error=msg.error,
        failed_request_ids=list(msg.failed_request_ids),
    )
