"""From the scheduler's per-step RequestOutputs to the clients' streams.

One live sample per scheduler request (a request with n samples is n
scheduler requests, see intake.py). Each has its incremental detokenizer
(built by intake from the request's stop options) and writes to its
request's handle, the queue a gRPC handler reads. Text work
happens here, where the tokens arrive: a sample whose text hits a stop string
finishes at once, and `process` returns its id so the engine aborts it in the
scheduler and its blocks are free before the next step.

Invariants: a sample is live from `add` until exactly one final SampleOutput
(one with a finish_reason) is put on its handle's queue, or until the client
aborts it; either way it is counted once in the per-request metrics, and the
handle's request_finished line is logged when its last sample ends.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.request import Request, RequestOutput, RequestStatus
from shared.step_plan import TokenLogprobs

log = structlog.get_logger(__name__)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass
class SampleOutput:
    """One message of one sample's stream."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    matched_stop: str = ""
    matched_stop_token_id: int | None = None
    error: str = ""  # set when the sample failed inside the engine (INTERNAL)
    unavailable: bool = False  # set when the executor stayed away too long


@dataclass(eq=False)
class RequestHandle:
    """What a gRPC handler holds: the queue its samples' outputs arrive on."""

    request_id: str
    n: int
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sample_ids: list[str] = field(default_factory=list)
    num_open: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # over all samples, for the request's log line
    owner: str = ""  # the caller that submitted it (shared.grpc_auth.Caller.name)


@dataclass(eq=False)
class _Sample:
    handle: RequestHandle
    index: int
    request: Request
    detok: IncrementalDetokenizer
    first_scheduled: float | None = None
    last_token_time: float | None = None  # None until the first token


class OutputProcessor:
    def __init__(self, metrics: SchedulerMetrics):
        self._metrics = metrics
        self._samples: dict[str, _Sample] = {}  # by sample id (= the scheduler's request id)
        self._handles: dict[str, RequestHandle] = {}  # by request id, while a sample is open

    # ---- the table of live samples ------------------------------------------------

    def __len__(self) -> int:
        return len(self._samples)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._samples

    def sample_ids(self) -> list[str]:
        return list(self._samples)

    def taken(self, request_id: str, sample_ids: Sequence[str]) -> bool:
        """True if a live request has this id, or a live sample one of these ids."""
        return request_id in self._handles or any(s in self._samples for s in sample_ids)

    def owner(self, sample_id: str) -> str | None:
        """Who submitted the live sample (None if it is not live)."""
        sample = self._samples.get(sample_id)
        return None if sample is None else sample.handle.owner

    def add(self, handle: RequestHandle, requests: Sequence[Request], detoks: Sequence[IncrementalDetokenizer]) -> None:
        """Opens the streams of `handle`'s samples: the i-th request and detokenizer are sample i."""
        assert len(requests) == len(detoks)
        for i, (request, detok) in enumerate(zip(requests, detoks)):
            self._samples[request.request_id] = _Sample(handle, i, request, detok)
            handle.sample_ids.append(request.request_id)
        handle.num_open = len(requests)
        self._handles[handle.request_id] = handle

    # ---- per step -------------------------------------------------------------------

    def observe_scheduled(self, new_request_ids: Sequence[str]) -> None:
        """Queue time ends at a sample's first scheduling (not at a recompute after preemption or loss)."""
        now = time.monotonic()
        for sample_id in new_request_ids:
            sample = self._samples.get(sample_id)
            if sample is not None and sample.first_scheduled is None:
                sample.first_scheduled = now
                self._metrics.observe_scheduled(sample.handle.arrival, now)

    def process(self, outputs: Sequence[RequestOutput]) -> dict[str, RequestStatus]:
        """Detokenizes and streams a step's outputs; returns the unfinished
        requests the scheduler must abort, with their status: STOPPED where a
        stop string just ended one, ABORTED where streaming its output failed
        (a bug, logged; that sample ends with the error, the others go on)."""
        ended: dict[str, RequestStatus] = {}
        for out in outputs:
            sample = self._samples.get(out.request_id)
            if sample is None:
                continue  # aborted while its step was in flight
            if out.error:  # the scheduler already dropped it (a failed step)
                self.fail(out.request_id, out.error)
                continue
            try:
                if self._process(sample, out):
                    ended[out.request_id] = RequestStatus.FINISHED_STOPPED
            except Exception as e:
                log.exception("sample_output_failed", request_id=out.request_id)
                self.fail(out.request_id, f"streaming its output failed: {type(e).__name__}: {e}")
                if not out.finished:
                    ended[out.request_id] = RequestStatus.FINISHED_ABORTED
        return ended

    def _process(self, sample: _Sample, out: RequestOutput) -> bool:
        """Streams one sample's output; True if a stop string ended it before the scheduler did."""
        stopped = False
        req = sample.request
        self._observe_tokens(sample, len(out.new_token_ids))
        delta = sample.detok.add_tokens(out.new_token_ids, stops_armed=req.num_output_tokens >= req.min_tokens)
        msg = SampleOutput(sample.index, list(out.new_token_ids), delta.text, list(out.new_logprobs))
        if delta.matched_stop is not None:
            stopped = not out.finished
            msg.finish_reason, msg.matched_stop = FinishReason.STOP, delta.matched_stop
        elif out.finished:
            msg.text += sample.detok.flush()
            if sample.detok.matched_stop is not None:  # completed by the final flush
                msg.finish_reason, msg.matched_stop = FinishReason.STOP, sample.detok.matched_stop
            else:
                msg.finish_reason = _FINISH[out.status]
                msg.matched_stop_token_id = out.stop_token_id
        if msg.finish_reason is None:
            sample.handle.queue.put_nowait(msg)
            return False
        msg.prompt_tokens, msg.completion_tokens = req.num_prompt_tokens, req.num_output_tokens
        msg.cached_prompt_tokens = max(req.num_cached_tokens, 0)
        self._finish(sample, msg)
        return stopped

    def _observe_tokens(self, sample: _Sample, count: int) -> None:
        if not count:
            return
        now = time.monotonic()
        self._metrics.observe_tokens(count, sample.handle.arrival, sample.last_token_time, now)
        sample.last_token_time = now
        sample.handle.output_tokens += count

    # ---- ends other than a step's ---------------------------------------------------

    def fail(self, sample_id: str, error: str, unavailable: bool = False) -> None:
        """Ends a live sample with ABORT (and `error`, or `unavailable`); the caller aborts it in the scheduler."""
        sample = self._samples.get(sample_id)
        if sample is None:
            return
        req = sample.request
        self._finish(
            sample,
            SampleOutput(
                sample.index,
                [],
                "",
                finish_reason=FinishReason.ABORT,
                prompt_tokens=req.num_prompt_tokens,
                completion_tokens=req.num_output_tokens,
                error=error,
                unavailable=unavailable,
            ),
        )

    def abort(self, handle: RequestHandle) -> list[str]:
        """The client went away: closes its open samples without a message; returns their ids to abort."""
        aborted = []
        for sample_id in handle.sample_ids:
            sample = self._samples.get(sample_id)
            # A finished sample's id may be live again as another request's ("x#0").
            if sample is not None and sample.handle is handle:
                aborted.append(sample_id)
                self._samples.pop(sample_id)
                self._observe_finished(sample, FinishReason.ABORT)
        if self._handles.get(handle.request_id) is handle:
            del self._handles[handle.request_id]
            _log_finished(handle, "abort")
        return aborted

    def _finish(self, sample: _Sample, out: SampleOutput) -> None:
        self._samples.pop(sample.request.request_id, None)
        handle = sample.handle
        self._observe_finished(sample, out.finish_reason)
        handle.queue.put_nowait(out)
        handle.num_open -= 1
        if handle.num_open == 0 and self._handles.pop(handle.request_id, None) is not None:
            _log_finished(handle, out.finish_reason.value if out.finish_reason else "")

    def _observe_finished(self, sample: _Sample, reason: FinishReason) -> None:
        """Every sample that ends, client aborts included, counts once in the per-request metrics."""
        req = sample.request
        self._metrics.observe_finished(
            reason.value, req.num_prompt_tokens, req.num_output_tokens, sample.handle.arrival
        )


def _log_finished(handle: RequestHandle, reason: str) -> None:
    log.info(
        "request_finished",
        request_id=handle.request_id,
        n=handle.n,
        finish_reason=reason,
        prompt_tokens=handle.prompt_tokens,
        output_tokens=handle.output_tokens,
        latency_s=round(time.monotonic() - handle.arrival, 4),
    )
