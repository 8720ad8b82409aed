"""The engine's parts, each on its own and without an executor: the output
processor (stop strings, finish reasons, aborts), intake (the n > 1 fan-out,
id collisions, the queue limit) and the executor link (a different model is
refused; the recovery timeout expires live requests)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from fake_executor import word_tokenizer_json
from scheduler_factories import make_scheduler

from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.executor_connection import ExecutorInfo, ExecutorLost, ExecutorRefused
from scheduler_svc.executor_link import ExecutorLink
from scheduler_svc.intake import GenerationInput, Intake, QueueFull, fan_out
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.output_processor import FinishReason, OutputProcessor, RequestHandle
from scheduler_svc.request import RequestOutput, RequestStatus
from scheduler_svc.scheduler import RequestTooLong
from scheduler_svc.scheduler_config import SchedulerPolicy
from scheduler_svc.tokenizer import Tokenizer
from shared.sampling_params import SamplingParams

VOCAB = 50
EOS = frozenset({2})


def metrics() -> SchedulerMetrics:
    m = SchedulerMetrics(SimpleNamespace(scheduler=None, connected=False))
    m.bind("m")
    return m


def finished_count(m: SchedulerMetrics, reason: str) -> float:
    return m.registry.get_sample_value(
        "pagedserve:request_success_total", {"model_name": "m", "finished_reason": reason}
    )


def gen(request_id="x", n=1, stop=(), **kw) -> GenerationInput:
    return GenerationInput(
        request_id, [1, 3], kw.pop("sampling", SamplingParams(temperature=0.0)), n, 8, stop=stop, **kw
    )


def parts(max_waiting=100):
    m = metrics()
    outputs = OutputProcessor(m)
    scheduler = make_scheduler()
    tokenizer = Tokenizer.from_info(word_tokenizer_json(VOCAB), "", "", "", False)
    intake = Intake(scheduler, outputs, tokenizer, grammars=None, eos_token_ids=EOS, max_waiting=max_waiting)
    return intake, outputs, scheduler, m


def out(request_id, token, finished=False, status=RequestStatus.RUNNING, error="") -> RequestOutput:
    return RequestOutput(request_id, [token] if token is not None else [], [], finished, status, None, 0, error=error)


def drain(handle: RequestHandle) -> list:
    messages = []
    while not handle.queue.empty():
        messages.append(handle.queue.get_nowait())
    return messages


def test_a_stop_string_over_two_tokens_finishes_the_sample_and_asks_to_abort_it():
    intake, outputs, _, m = parts()
    handle = intake.submit(gen(stop=("w5 w6",)), None, None, "")
    assert outputs.process([out("x", 4)]) == {}
    assert outputs.process([out("x", 5)]) == {}  # " w5" is held back: it may start the stop string
    assert outputs.process([out("x", 6)]) == {"x": RequestStatus.FINISHED_STOPPED}  # the scheduler must abort it
    messages = drain(handle)
    assert "".join(msg.text for msg in messages) == " w4 "
    assert [msg.finish_reason for msg in messages] == [None, None, FinishReason.STOP]
    assert messages[-1].matched_stop == "w5 w6" and "x" not in outputs and handle.num_open == 0
    assert finished_count(m, "stop") == 1
    assert outputs.process([out("x", 7)]) == {}  # a token of a step already in flight is dropped


def test_a_stop_string_in_the_last_token_of_a_finished_sample_needs_no_abort():
    intake, outputs, _, _ = parts()
    handle = intake.submit(gen(stop=("w5",)), None, None, "")
    assert outputs.process([out("x", 5, finished=True, status=RequestStatus.FINISHED_LENGTH)]) == {}
    (msg,) = drain(handle)
    assert (msg.finish_reason, msg.matched_stop, msg.completion_tokens) == (FinishReason.STOP, "w5", 0)


def test_finish_reasons_come_from_the_scheduler_and_a_failed_step_carries_its_error():
    intake, outputs, _, m = parts()
    handle = intake.submit(gen(n=2), None, None, "")
    outputs.process(
        [
            out("x#0", 4, finished=True, status=RequestStatus.FINISHED_LENGTH),
            out("x#1", None, finished=True, status=RequestStatus.FINISHED_ABORTED, error="kernel exploded"),
        ]
    )
    by_index = {msg.index: msg for msg in drain(handle)}
    assert by_index[0].finish_reason is FinishReason.LENGTH and by_index[0].text == " w4"
    assert (by_index[1].finish_reason, by_index[1].error) == (FinishReason.ABORT, "kernel exploded")
    assert len(outputs) == 0 and finished_count(m, "length") == finished_count(m, "abort") == 1


def test_a_sample_whose_output_cannot_be_streamed_fails_alone(monkeypatch):
    """A bug detokenizing one sample (here its detokenizer raises) ends that
    sample with the error and asks the scheduler to abort it; the sample
    beside it in the same step streams on, and the step loop is not hurt."""
    intake, outputs, _, m = parts()
    handle = intake.submit(gen(n=2), None, None, "")
    broken = outputs._samples["x#1"].detok

    def explode(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer bug")

    monkeypatch.setattr(broken, "add_tokens", explode)
    assert outputs.process([out("x#0", 4), out("x#1", 5)]) == {"x#1": RequestStatus.FINISHED_ABORTED}
    by_index = {msg.index: msg for msg in drain(handle)}
    assert by_index[0].finish_reason is None and by_index[0].text == " w4"
    assert by_index[1].finish_reason is FinishReason.ABORT and "UnicodeDecodeError" in by_index[1].error
    assert outputs.process([out("x#0", 6, finished=True, status=RequestStatus.FINISHED_LENGTH)]) == {}
    assert drain(handle)[0].finish_reason is FinishReason.LENGTH and len(outputs) == 0


def test_n_samples_fan_out_with_consecutive_seeds_that_wrap_at_two_to_the_64():
    sampling = SamplingParams(temperature=1.0, seed=2**64 - 2)
    requests = fan_out(gen(n=3, sampling=sampling, min_tokens=2, stop_token_ids=frozenset({7})), None, EOS, 5.0)
    assert [r.request_id for r in requests] == ["x#0", "x#1", "x#2"]
    assert [r.sampling.seed for r in requests] == [2**64 - 2, 2**64 - 1, 0]
    assert all(r.sampling.min_tokens_masked_ids == (2, 7) and r.arrival_time == 5.0 for r in requests)
    assert requests[0].prompt_token_ids is not requests[1].prompt_token_ids
    (only,) = fan_out(gen(n=1, min_tokens=2, ignore_eos=True), None, EOS, 0.0)
    assert only.request_id == "x" and only.sampling.min_tokens_masked_ids == ()


def test_intake_refuses_a_colliding_id_or_a_full_queue_before_touching_anything():
    intake, outputs, scheduler, _ = parts(max_waiting=3)
    handle = intake.submit(gen(n=2), None, 7.0, "alice")
    assert handle.arrival == 7.0 and handle.sample_ids == ["x#0", "x#1"] and len(scheduler.waiting) == 2
    assert outputs.owner("x#1") == "alice"
    with pytest.raises(KeyError):
        intake.submit(gen("x#1"), None, None, "")  # sample 1 of the live "x"
    with pytest.raises(QueueFull):
        intake.submit(gen("y", n=2), None, None, "")
    assert len(outputs) == 2 and len(scheduler.waiting) == 2


def test_a_request_the_shrunken_context_no_longer_fits_is_refused_before_any_stream_opens():
    """Validated against the old context, submitted after an executor came
    back with less KV memory (Scheduler.resize): refused as too long, with no
    sample stream left open under its id (which would block the id and drain)."""
    intake, outputs, scheduler, _ = parts()
    scheduler.resize(dataclasses.replace(scheduler.config, num_blocks=17, max_model_len=64))
    with pytest.raises(RequestTooLong):
        intake.submit(dataclasses.replace(gen("x", n=2), max_tokens=100), None, None, "")
    assert len(outputs) == 0 and not scheduler.requests and not outputs.taken("x", ["x#0", "x#1"])
    assert intake.submit(dataclasses.replace(gen("x", n=2), max_tokens=40), None, None, "").sample_ids == ["x#0", "x#1"]


def test_an_abort_closes_only_this_handles_samples():
    intake, outputs, scheduler, m = parts()
    first = intake.submit(gen(n=2), None, None, "")
    outputs.process([out("x#0", 4, finished=True, status=RequestStatus.FINISHED_LENGTH)])
    scheduler.abort_request("x#0", RequestStatus.FINISHED_LENGTH)  # as update_from_result would have finished it
    reused = intake.submit(gen("x#0"), None, None, "")  # the finished sample's id, live again
    assert sorted(outputs.abort(first)) == ["x#1"]
    assert "x#0" in outputs and outputs.abort(reused) == ["x#0"] and len(outputs) == 0
    assert finished_count(m, "abort") == 2


INFO = ExecutorInfo(
    model_name="fake",
    architecture="llama",
    vocab_size=VOCAB,
    eos_token_ids=(2,),
    bos_token_id=None,
    max_model_len=512,
    dtype="float32",
    num_kv_blocks=64,
    kv_cache_bytes=0,
    instance_id="a",
    device="cpu",
    attention_backend="fake",
    tokenizer_json="{}",
    chat_template="",
    bos_token="",
    eos_token="",
    add_bos_token=False,
)


class ScriptedClient:
    """Answers each handshake with the next of `answers` (an ExecutorInfo, or an exception to raise)."""

    def __init__(self, *answers):
        self.answers, self.closed = list(answers), 0

    async def connect(self, block_size, max_num_batched_tokens, max_num_seqs, timeout_s=5.0):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def close(self):
        self.closed += 1


CONFIG = SchedulerServiceConfig(
    scheduler=SchedulerPolicy(block_size=4, max_num_batched_tokens=64, max_num_seqs=8),
    step_timeout_s=1.0,
    executor_recovery_timeout_s=0.0,
)


def test_the_link_refuses_an_executor_that_came_back_with_another_model():
    async def scenario():
        adopted = []
        link = ExecutorLink(ScriptedClient(INFO, dataclasses.replace(INFO, model_name="other")), CONFIG)
        await link.connect(lambda info, previous: adopted.append(previous))
        link.lost("test", live_requests=0)
        with pytest.raises(ExecutorRefused, match="different model"):
            await link.connect(lambda info, previous: adopted.append(previous))
        assert adopted == [None] and link.client.closed == 1 and not link.connected and link.info is INFO

    asyncio.run(scenario())


def test_reconnecting_past_the_recovery_timeout_expires_live_requests_then_adopts_the_new_capacity():
    async def scenario():
        bigger = dataclasses.replace(INFO, num_kv_blocks=128, instance_id="b")
        link = ExecutorLink(ScriptedClient(INFO, ExecutorLost("down"), bigger), CONFIG)
        changes, adopted, expired = [], [], []
        link.on_connection_change(changes.append)
        await link.connect(lambda info, previous: None)
        link.lost("test", live_requests=1)
        await link.reconnect(
            lambda info, previous: adopted.append((info, previous)), live=lambda: 1, expire=lambda: expired.append(True)
        )
        assert expired == [True] and adopted == [(bigger, INFO)] and link.info is bigger
        assert changes == [True, False, True]

    asyncio.run(scenario())
