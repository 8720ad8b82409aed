"""Faults lose nothing: executor SIGKILL mid-generation, recovery timeout, SIGTERM drain;
an executor that comes back different; a second scheduler on one executor."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve_client import Client
from tests.servers import Servers, free_port, health_status, wait_serving

pytestmark = pytest.mark.e2e
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def prompts(english_prompts: list[str], n: int) -> list[str]:
    return [f"{english_prompts[i % len(english_prompts)][: 40 + 7 * i]} (part {i})" for i in range(n)]


def test_executor_sigkill_mid_generation_resumes_every_stream_identically(english_prompts):
    jobs = prompts(english_prompts, 32)
    with (
        Servers(
            executor_args=["--dtype", "float32", "--kv-cache-gib", "1"],
            scheduler_args=["--executor-recovery-timeout", "180"],
        ) as s,
        Client(s.public_addr) as c,
    ):
        run = lambda p: c.complete(p, max_tokens=20, temperature=0.0, ignore_eos=True, timeout=600)[0]
        with ThreadPoolExecutor(32) as pool:
            reference = list(pool.map(run, jobs))
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(run, p) for p in jobs]
            steps_before = c.server_status().num_steps
            deadline = time.monotonic() + 60  # bounded: a wait that cannot end hangs the suite
            while c.server_status().num_steps < steps_before + 4:
                assert time.monotonic() < deadline, "the engine did not take 4 steps in 60 s"
                time.sleep(0.02)
            s.executor.send_signal(signal.SIGKILL)
            s.executor.wait()
            killed_at = time.monotonic()
            while health_status(s.public_addr) != NOT_SERVING:
                assert time.monotonic() - killed_at < 1.0, "scheduler did not notice the executor's death within 1 s"
                time.sleep(0.02)
            assert not all(f.done() for f in futures), "the kill came too late to interrupt anything"
            s.start_executor()
            results = [f.result() for f in futures]
        assert health_status(s.public_addr) == SERVING
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
        assert all(r.finish_reason == "length" for r in results)
        assert c.server_status().kv_blocks_used == 0


def test_executor_that_stays_away_fails_requests_with_unavailable():
    with (
        Servers(
            executor_args=["--dtype", "float32", "--kv-cache-gib", "0.5"],
            scheduler_args=["--executor-recovery-timeout", "1"],
        ) as s,
        Client(s.public_addr) as c,
    ):
        stream = c.generate("Once upon a time", max_tokens=500, ignore_eos=True, timeout=60)
        next(stream)
        s.executor.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            c.complete("Hello", max_tokens=2, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_drains_in_flight_requests_then_exits_zero():
    with (
        Servers(
            executor_args=["--dtype", "float32", "--kv-cache-gib", "0.5"], scheduler_args=["--drain-timeout", "60"]
        ) as s,
        Client(s.public_addr) as c,
    ):
        results, errors = [], []

        def one(i):
            try:
                results.append(c.complete(f"Item {i}:", max_tokens=24, ignore_eos=True, timeout=120)[0])
            except grpc.RpcError as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60  # bounded: a wait that cannot end hangs the suite
        while c.server_status().num_running < 4:
            assert not errors, f"a request failed before the four ran together: {errors[0]}"
            assert time.monotonic() < deadline, "the four requests never ran together"
            time.sleep(0.01)
        s.scheduler.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while health_status(s.public_addr) != NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.02)
        assert health_status(s.public_addr) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            c.complete("late arrival", max_tokens=2, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join()
        assert not errors and len(results) == 4 and all(r.completion_tokens == 24 for r in results)
        assert s.scheduler.wait(timeout=30) == 0
        s.executor.send_signal(signal.SIGTERM)
        assert s.executor.wait(timeout=30) == 0


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def test_a_second_scheduler_is_refused_until_the_first_is_gone():
    with Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.2"]) as s, Client(s.public_addr) as c:
        second_addr = f"127.0.0.1:{free_port()}"
        second = s._spawn("scheduler_svc", ["--listen", second_addr, "--executor", s.executor_addr], "scheduler2.log")
        try:
            wait_for(lambda: "another scheduler is connected" in s.logs("scheduler2"), 60, "refusal in the log")
            assert health_status(second_addr) != SERVING
            # The first scheduler's requests were not disturbed by the refused handshakes.
            assert c.complete("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)[0].completion_tokens == 4
            s.scheduler.send_signal(signal.SIGKILL)
            s.scheduler.wait()
            wait_serving(second_addr, [second], timeout=60)
            with Client(second_addr) as c2:
                assert c2.complete("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)[0].completion_tokens == 4
        finally:
            second.terminate()
            second.wait(timeout=30)


def test_executor_back_with_another_kv_size_is_adopted():
    with Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.2"]) as s, Client(s.public_addr) as c:
        before = c.server_status().kv_blocks_total
        s.executor.send_signal(signal.SIGTERM)
        s.executor.wait()
        s.executor_args = ["--dtype", "float32", "--kv-cache-gib", "0.1"]
        s.start_executor()
        wait_for(
            lambda: health_status(s.public_addr) == SERVING and c.server_status().kv_blocks_total != before,
            180,
            "serving with the new KV capacity",
        )
        assert abs(c.server_status().kv_blocks_total - before / 2) <= 2
        assert c.complete("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)[0].completion_tokens == 4
        assert "executor_capacity_changed" in s.logs("scheduler")


def test_executor_back_with_another_model_is_refused_loudly(tmp_path):
    from tests.model_utils import save_tiny_model_with_tokenizer

    save_tiny_model_with_tokenizer(str(tmp_path / "tiny"))
    with Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.2"]) as s:
        s.executor.send_signal(signal.SIGTERM)
        s.executor.wait()
        s.executor_args = ["--dtype", "float32", "--kv-cache-gib", "0.2", "--model", str(tmp_path / "tiny")]
        s.start_executor()
        wait_for(lambda: "executor_refused" in s.logs("scheduler"), 180, "refusal in the scheduler's log")
        assert "different model" in s.logs("scheduler") and health_status(s.public_addr) == NOT_SERVING


def test_executor_ownership_one_scheduler_reconnects_at_once_others_are_refused():
    """The Handshake/Step ownership rules against a real executor, driven by hand."""
    from pagedserve.executor.v1 import executor_pb2 as epb
    from pagedserve.executor.v1 import executor_pb2_grpc as epb_grpc

    s = Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.1"])
    s.start_executor()
    try:
        wait_for(lambda: health_status(s.executor_addr) == SERVING, 180, "executor serving")
        auth = s.executor_metadata()
        with grpc.insecure_channel(s.executor_addr) as ch:
            stub = epb_grpc.ExecutorStub(ch)

            def handshake(sid):
                return stub.Handshake(
                    epb.HandshakeRequest(
                        block_size_tokens=16, max_num_batched_tokens=64, max_num_seqs=4, scheduler_id=sid
                    ),
                    timeout=30,
                    metadata=auth,
                )

            def refused(call) -> bool:
                try:
                    call()
                except grpc.RpcError as e:
                    return e.code() == grpc.StatusCode.FAILED_PRECONDITION
                return False

            handshake("A")
            # A second scheduler is refused while A's claim is fresh, even before A's stream opens.
            with ThreadPoolExecutor(2) as pool:
                assert all(pool.map(refused, [lambda: handshake("B"), lambda: handshake("C")]))
            plans = __import__("queue").Queue()
            stream_a = stub.Step(iter(plans.get, None), metadata=auth + (("pagedserve-scheduler-id", "A"),))
            plans.put(epb.StepPlan(step_id=1))
            assert next(stream_a).step_id == 1
            t0 = time.monotonic()
            assert refused(lambda: handshake("B"))  # after the 2 s grace: A's stream stays open
            assert time.monotonic() - t0 >= 1.5
            assert refused(
                lambda: list(
                    stub.Step(
                        iter([epb.StepPlan(step_id=1)]), metadata=auth + (("pagedserve-scheduler-id", "B"),), timeout=10
                    )
                )
            )
            # A reconnects (its old stream possibly half-open): at once, and the old stream ends.
            t0 = time.monotonic()
            handshake("A")
            assert time.monotonic() - t0 < 1.5
            with pytest.raises(grpc.RpcError):
                next(stream_a)
            stream_a2 = stub.Step(iter([epb.StepPlan(step_id=2)]), metadata=auth + (("pagedserve-scheduler-id", "A"),))
            assert [r.step_id for r in stream_a2] == [2]
            # A's stream closed: B may take over, and the change of owner is logged as such, with both ids.
            handshake("B")
            plans.put(None)
            changes = [json.loads(line) for line in s.logs("executor").splitlines() if "executor_owner_changed" in line]
            assert [(c["level"], c["previous_scheduler_id"], c["scheduler_id"]) for c in changes] == [
                ("warning", "A", "B")
            ]
    finally:
        s.stop()


def test_stopped_executor_goes_not_serving_then_unavailable_then_back():
    """SIGSTOP breaks no connection: only the step watchdog (--step-timeout) notices."""
    step_timeout_s, recovery_s = 2.0, 3.0
    with (
        Servers(
            executor_args=["--dtype", "float32", "--kv-cache-gib", "0.2"],
            scheduler_args=["--step-timeout", str(step_timeout_s), "--executor-recovery-timeout", str(recovery_s)],
        ) as s,
        Client(s.public_addr) as c,
    ):
        stream = c.generate("Once upon a time", max_tokens=400, ignore_eos=True, timeout=120)
        next(stream)
        s.executor.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            while health_status(s.public_addr) != NOT_SERVING:
                assert time.monotonic() - stopped_at < step_timeout_s + 3, "a stopped executor went unnoticed"
                time.sleep(0.05)
            assert not c.server_status().executor_connected
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            failed_after_s = time.monotonic() - stopped_at
            assert failed_after_s < step_timeout_s + recovery_s + 8, failed_after_s  # + one handshake attempt's timeout
            with pytest.raises(grpc.RpcError) as info:
                c.complete("Hello", max_tokens=2, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            s.executor.send_signal(signal.SIGCONT)
        wait_for(lambda: health_status(s.public_addr) == SERVING, 60, "SERVING after SIGCONT")
        status = c.server_status(include_requests=True)
        assert status.executor_connected and status.kv_blocks_used == 0 and not status.requests
        assert c.complete("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)[0].completion_tokens == 4
        assert c.server_status().kv_blocks_used == 0
        assert "executor_lost" in s.logs("scheduler") and "--step-timeout" in s.logs("scheduler")
