"""The executor serves only its scheduler, and one owner never reads another's KV.

- another local user (a process under `nobody`) cannot read the installation
  secret, so it cannot Handshake or Step against a default-configured executor;
- a second scheduler that holds the secret and takes over finds the KV memory
  zeroed: replaying the first owner's block ids does not reproduce its output,
  and the change of owner is logged at WARNING with both ids;
- a plan whose cached_requests arrays are misaligned, or that carries a token id
  outside the vocabulary, fails its step with a clear error and leaves the
  other requests as they were.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import time

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2

from executor_svc.config import ExecutorConfig
from executor_svc.metrics import ExecutorMetrics
from executor_svc.server import forward_thread, serve
from executor_svc.worker import Worker
from pagedserve.executor.v1 import executor_pb2 as pb
from pagedserve.executor.v1 import executor_pb2_grpc as pb_grpc
from shared.executor_secret import installation_secret
from shared.sampling_params import SamplingParams
from shared.step_codec import plan_from_proto, plan_to_proto, result_from_proto
from shared.step_plan import CachedRequestData, NewRequestData, StepPlan
from tests.servers import REPO, free_port, health_status

BLOCK = 16
PROMPT = [5 + (7 * i) % 300 for i in range(20)]
GREEDY = SamplingParams(temperature=0.0)
SECRET = "s" * 43


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from tests.model_utils import save_tiny_model_with_tokenizer

    folder = str(tmp_path_factory.mktemp("tiny_qwen2"))
    save_tiny_model_with_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def worker(tiny_model) -> Worker:
    return Worker(ExecutorConfig(model=tiny_model, dtype="float32", kv_cache_gib=0.01))


# ---- another local user ------------------------------------------------------------------


def as_nobody():
    pw = pwd.getpwnam("nobody")

    def drop() -> None:
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)

    return drop


def nobody_python() -> list[str]:
    """An interpreter `nobody` can run with this grpc and these protos (this one may live under /root)."""
    env = nobody_env()
    for exe in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        if exe is None:
            continue
        try:
            probe = subprocess.run(
                [
                    exe,
                    "-c",
                    "import sys, grpc, pagedserve.executor.v1.executor_pb2; "
                    f"sys.exit(sys.version_info[:2] != {tuple(sys.version_info[:2])})",
                ],
                preexec_fn=as_nobody(),
                env=env,
                cwd="/",
                capture_output=True,
                timeout=60,
            )
        except OSError:  # nobody may not execute it
            continue
        if probe.returncode == 0:
            return [exe]
    pytest.skip("no Python interpreter that user nobody can run with grpc")


def nobody_env() -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": "/nonexistent",
        "PYTHONPATH": os.pathsep.join([REPO, sysconfig.get_paths()["purelib"]]),
    }


INTRUDER = """
import json, sys
import grpc
from pagedserve.executor.v1 import executor_pb2 as pb, executor_pb2_grpc as pb_grpc

addr, secret_path = sys.argv[1:]
out = {}
try:
    open(secret_path).read()
    out["read_secret"] = "read"
except OSError as e:
    out["read_secret"] = type(e).__name__
stub = pb_grpc.ExecutorStub(grpc.insecure_channel(addr))
for name, md in (("no_token", ()), ("guessed_token", (("authorization", "Bearer guess"),))):
    try:
        stub.Handshake(pb.HandshakeRequest(block_size_tokens=16, scheduler_id="intruder"), metadata=md, timeout=20)
        out["handshake_" + name] = "OK"
    except grpc.RpcError as e:
        out["handshake_" + name] = e.code().name
    try:
        list(stub.Step(iter([pb.StepPlan(step_id=1)]), metadata=md + (("pagedserve-scheduler-id", "intruder"),),
                       timeout=20))
        out["step_" + name] = "OK"
    except grpc.RpcError as e:
        out["step_" + name] = e.code().name
print(json.dumps(out))
"""


@pytest.mark.e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another user needs root")
def test_another_local_user_cannot_handshake_or_step_a_default_executor(tiny_model, tmp_path):
    python = nobody_python()
    addr = f"127.0.0.1:{free_port()}"  # the default kind of address: loopback TCP, reachable by every local user
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")  # the default secret location, inside this test's tmp dir
    log = open(tmp_path / "executor.log", "wb")
    executor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "executor_svc",
            "--listen",
            addr,
            "--model",
            tiny_model,
            "--dtype",
            "float32",
            "--kv-cache-gib",
            "0.01",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while health_status(addr) != health_pb2.HealthCheckResponse.SERVING:
            assert executor.poll() is None and time.monotonic() < deadline, (tmp_path / "executor.log").read_text()[
                -2000:
            ]
            time.sleep(0.2)
        secret_path = tmp_path / "state" / "pagedserve" / "executor-secret"
        done = subprocess.run(
            [*python, "-c", INTRUDER, addr, str(secret_path)],
            preexec_fn=as_nobody(),
            env=nobody_env(),
            cwd="/",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen == {
            "read_secret": "PermissionError",
            "handshake_no_token": "UNAUTHENTICATED",
            "step_no_token": "UNAUTHENTICATED",
            "handshake_guessed_token": "UNAUTHENTICATED",
            "step_guessed_token": "UNAUTHENTICATED",
        }
        # The owner's own process, holding the secret, is served: the refusals above are the secret's doing.
        with grpc.insecure_channel(addr) as ch:
            resp = pb_grpc.ExecutorStub(ch).Handshake(
                pb.HandshakeRequest(block_size_tokens=16, max_num_batched_tokens=64, max_num_seqs=4, scheduler_id="s"),
                metadata=(("authorization", f"Bearer {installation_secret(str(secret_path.parent))}"),),
                timeout=60,
            )
        assert resp.num_kv_blocks > 0
    finally:
        executor.terminate()
        executor.wait(timeout=30)
        log.close()


# ---- a takeover by a second scheduler that holds the secret -------------------------------


def new_request(rid: str, tokens: list[int], computed: int) -> NewRequestData:
    return NewRequestData(rid, tokens, len(tokens), GREEDY, [1, 2], computed, len(tokens) - computed)


def decode(rid: str, computed: int, step_id: int) -> StepPlan:
    return StepPlan(
        step_id, cached_requests=CachedRequestData([rid], [[]], [computed], [1]), last_result_step_id=step_id - 1
    )


async def owner_session(stub, scheduler_id: str, first: StepPlan, decodes: int) -> list[int]:
    """Handshakes as `scheduler_id`, runs `first` then `decodes` decode steps of its one request; its tokens."""
    auth = (("authorization", f"Bearer {SECRET}"),)
    await stub.Handshake(
        pb.HandshakeRequest(
            block_size_tokens=BLOCK, max_num_batched_tokens=64, max_num_seqs=4, scheduler_id=scheduler_id
        ),
        metadata=auth,
        timeout=60,
    )
    call = stub.Step(metadata=auth + (("pagedserve-scheduler-id", scheduler_id),))
    new = first.new_requests[0]
    computed, out = new.num_computed_tokens + new.num_scheduled_tokens, []
    for plan in [first] + [decode(new.request_id, computed + i, first.step_id + 1 + i) for i in range(decodes)]:
        await call.write(plan_to_proto(plan))
        result = result_from_proto(await call.read())
        assert not result.error, result.error
        out.append(result.sampled[new.request_id])
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return out


def test_a_new_owner_with_the_secret_cannot_read_the_previous_owners_kv(worker, tmp_path):
    async def scenario():
        sock = f"unix://{tmp_path}/executor.sock"
        server, _ = await serve(worker, sock, ExecutorMetrics(), SECRET, forward_thread())
        try:
            async with grpc.aio.insecure_channel(sock) as ch:
                stub = pb_grpc.ExecutorStub(ch)
                # The victim: a 20-token prompt in blocks 1-2, then 3 greedy decodes.
                victim = await owner_session(stub, "victim-scheduler", StepPlan(1, [new_request("v", PROMPT, 0)]), 3)
                assert any(k.abs().sum() > 0 for k, _ in worker.runner.kv_caches)
                # The intruder claims the victim's prompt is already computed in blocks 1-2 and
                # decodes from the victim's first token: with the old KV it would replay the victim.
                with structlog.testing.capture_logs() as logs:
                    replay = StepPlan(1, [new_request("i", PROMPT + victim[:1], len(PROMPT))])
                    intruder = await owner_session(stub, "intruder-scheduler", replay, 2)
                return victim, intruder, logs
        finally:
            await server.stop(None)

    victim, intruder, logs = asyncio.run(scenario())
    assert intruder != victim[1:], "the new owner read the previous owner's KV back"
    changes = [e for e in logs if e["event"] == "executor_owner_changed"]
    assert [(e["log_level"], e["previous_scheduler_id"], e["scheduler_id"]) for e in changes] == [
        ("warning", "victim-scheduler", "intruder-scheduler")
    ]


def test_every_handshake_zeroes_the_kv_memory_it_reuses(worker):
    worker.configure(BLOCK, 64, 4)
    assert not worker.runner.execute(StepPlan(1, [new_request("a", PROMPT, 0)])).error
    assert any(k.abs().sum() > 0 for k, _ in worker.runner.kv_caches)
    kv_before = [k.data_ptr() for k, _ in worker.runner.kv_caches]
    worker.configure(BLOCK, 64, 4)
    assert [k.data_ptr() for k, _ in worker.runner.kv_caches] == kv_before  # reused, not reallocated
    assert all(not k.any() and not v.any() for k, v in worker.runner.kv_caches)
    assert worker.runner.requests == {}


def test_serving_without_a_secret_is_refused(worker):
    with pytest.raises(ValueError, match="secret"):
        asyncio.run(serve(worker, "unix:///nonexistent/x.sock", ExecutorMetrics(), "", forward_thread()))


# ---- malformed plans ---------------------------------------------------------------------


def greedy_tokens(worker: Worker, bad_step=None) -> tuple[list[int], str]:
    """Request "b": prefill then 3 decodes, with `bad_step(step_id)`'s plan run after the prefill;
    b's tokens and the bad step's error."""
    worker.configure(BLOCK, 64, 4)
    runner = worker.runner
    out = [runner.execute(StepPlan(1, [new_request("b", PROMPT, 0)])).sampled["b"]]
    step, error = 2, ""
    if bad_step is not None:
        result = runner.execute(bad_step(step))
        assert result.error and not result.sampled
        step, error = step + 1, result.error
    for i in range(3):
        out.append(runner.execute(decode("b", len(PROMPT) + i, step)).sampled["b"])
        step += 1
    return out, error


def test_misaligned_cached_request_arrays_fail_the_step_clearly(worker):
    reference, _ = greedy_tokens(worker)

    def misaligned(step_id):
        cached = CachedRequestData(["ghost"], [[], []], [0], [])
        # Through the wire format: decoding keeps every array's length, nothing is truncated.
        plan = plan_from_proto(
            plan_to_proto(StepPlan(step_id, cached_requests=cached, last_result_step_id=step_id - 1))
        )
        assert plan.cached_requests == cached
        return plan

    tokens, error = greedy_tokens(worker, misaligned)
    assert error == (
        "PlanError: cached_requests arrays must be aligned, one entry per request; got "
        "request_ids: 1, new_block_ids: 2, num_computed_tokens: 1, num_scheduled_tokens: 0"
    )
    assert tokens == reference  # "b", not in the bad step, decodes on as if nothing happened


def test_out_of_vocabulary_token_ids_fail_the_step_before_the_model(worker):
    reference, _ = greedy_tokens(worker)
    vocab = worker.model_config.vocab_size

    def oov(step_id):
        return StepPlan(step_id, [new_request("x", [5, 6, vocab, 7], 0)], last_result_step_id=step_id - 1)

    tokens, error = greedy_tokens(worker, oov)
    assert error == f"PlanError: new request 'x': token id {vocab} is outside the vocabulary (0..{vocab - 1})"
    assert tokens == reference and "x" not in worker.runner.requests


def test_a_result_with_misaligned_arrays_is_refused():
    msg = pb.StepResult(step_id=3, request_ids=["a", "b"], sampled_token_ids=[7])
    with pytest.raises(ValueError, match="2 request_ids, 1 sampled_token_ids"):
        result_from_proto(msg)
