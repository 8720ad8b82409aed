"""Security promises: bearer tokens, TLS and mutual TLS on the public API, the
executor's shared secret, and logs that never carry prompts or outputs.

One executor serves the whole module on a public address (0.0.0.0) with its
shared secret; the schedulers in front of it run one at a time (a second one's
handshake would take the executor's Step stream from the first).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.executor.v1 import executor_pb2, executor_pb2_grpc
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from pagedserve_client import Client
from tests.servers import REPO, free_port

pytestmark = pytest.mark.e2e
SERVING = health_pb2.HealthCheckResponse.SERVING
UNAUTHENTICATED, UNAVAILABLE = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE
EXECUTOR_SECRET = "executor-secret-5b1e"
PUBLIC_TOKENS = ("alpha-token-93f0", "beta-token-1c7d")
MARKER = "zebra-quartz-71"  # a prompt no log line may contain


def spawn(module: str, args: list[str], log: Path, env: dict) -> subprocess.Popen:
    # Each process gets exactly the PAGEDSERVE_* variables named here: both
    # services read PAGEDSERVE_AUTH_TOKEN, with different meanings.
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**base, "PYTHONUNBUFFERED": "1", **env},
        )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until(check, procs, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"{what} not reached after {timeout}s"
        time.sleep(0.2)


def serving(channel_factory) -> bool:
    try:
        with channel_factory() as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == SERVING
    except grpc.RpcError:
        return False


# ---- fixtures: certificates, one executor, one scheduler at a time ------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A throw-away CA, a server certificate for 127.0.0.1/localhost, and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req",
        "-x509",
        *key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=PagedServe test CA",
        cwd=d,
    )
    exts = {
        "server": "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for name, ext in exts.items():
        (d / f"{name}.ext").write_text(ext)
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=pagedserve-{name}", cwd=d)
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )
    return d


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="pagedserve-security-"))
    (d / "executor.token").write_text(EXECUTOR_SECRET + "\n")
    (d / "public.tokens").write_text("\n".join(PUBLIC_TOKENS) + "\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def executor(workdir):
    """The executor on a public address, guarded by PAGEDSERVE_AUTH_TOKEN: (process, "127.0.0.1:port")."""
    port = free_port()
    proc = spawn(
        "executor_svc",
        ["--listen", f"0.0.0.0:{port}", "--dtype", "float32", "--kv-cache-gib", "0.25"],
        workdir / "executor.log",
        {"PAGEDSERVE_AUTH_TOKEN": EXECUTOR_SECRET},
    )
    addr = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: serving(lambda: grpc.insecure_channel(addr)), [proc], 180, "executor SERVING")
        yield proc, addr
    finally:
        stop(proc)


class OneScheduler:
    """Runs at most one scheduler in front of the executor; `use` restarts it only when the flags change."""

    def __init__(self, workdir: Path, executor_addr: str, executor_proc):
        self.workdir, self.executor_addr, self.executor_proc = workdir, executor_addr, executor_proc
        self.proc: subprocess.Popen | None = None
        self.key: tuple | None = None
        self.log: Path | None = None

    def use(self, name: str, args: list[str], ready_channel) -> str:
        if self.key != (name, *args):
            self.close()
            port = free_port()
            self.target = f"127.0.0.1:{port}"
            self.log = self.workdir / f"scheduler-{name}.log"
            self.proc = spawn(
                "scheduler_svc", ["--listen", self.target, "--executor", self.executor_addr, *args], self.log, {}
            )
            self.key = (name, *args)
            wait_until(
                lambda: serving(lambda: ready_channel(self.target)),
                [self.proc, self.executor_proc],
                120,
                f"scheduler {name} SERVING",
            )
        return self.target

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)
        self.proc = self.key = None


@pytest.fixture(scope="module")
def schedulers(workdir, executor):
    one = OneScheduler(workdir, executor[1], executor[0])
    yield one
    one.close()


def insecure(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target)


@pytest.fixture
def auth_target(schedulers, workdir) -> str:
    return schedulers.use(
        "auth",
        [
            "--auth-tokens-file",
            str(workdir / "public.tokens"),
            "--executor-auth-token-file",
            str(workdir / "executor.token"),
        ],
        insecure,
    )


# ---- the executor's shared secret ---------------------------------------------------------


def test_executor_on_a_public_address_without_a_token_refuses_to_start(workdir):
    proc = spawn("executor_svc", ["--listen", f"0.0.0.0:{free_port()}"], workdir / "executor-no-token.log", {})
    assert proc.wait(timeout=120) != 0
    assert "auth-token" in (workdir / "executor-no-token.log").read_text()


def test_executor_refuses_calls_without_its_secret(executor):
    _, addr = executor
    with grpc.insecure_channel(addr) as ch:
        stub = executor_pb2_grpc.ExecutorStub(ch)
        for metadata in ((), (("authorization", "Bearer not-the-secret"),), (("authorization", EXECUTOR_SECRET),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Handshake(executor_pb2.HandshakeRequest(block_size_tokens=16), metadata=metadata, timeout=10)
            assert info.value.code() == UNAUTHENTICATED, metadata
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Step(iter([executor_pb2.StepPlan()]), metadata=metadata, timeout=10))
            assert info.value.code() == UNAUTHENTICATED, metadata
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING


# ---- bearer tokens on the public API ------------------------------------------------------


def public_calls(stub: pb_grpc.GenerationStub, metadata):
    """One call of every public method; each returns normally or raises grpc.RpcError."""
    req = pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_tokens=2))
    return [
        lambda: list(stub.Generate(req, metadata=metadata, timeout=60)),
        lambda: stub.Tokenize(pb.TokenizeRequest(text="Hello"), metadata=metadata, timeout=10),
        lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[19556]), metadata=metadata, timeout=10),
        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10),
        lambda: stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=metadata, timeout=10),
    ]


def test_public_api_needs_one_of_the_configured_bearer_tokens(auth_target):
    with grpc.insecure_channel(auth_target) as ch:
        stub = pb_grpc.GenerationStub(ch)
        bad = [
            (),
            (("authorization", "Bearer wrong-token"),),
            (("authorization", PUBLIC_TOKENS[0]),),
            (("authorization", f"Bearer {EXECUTOR_SECRET}"),),
        ]
        for metadata in bad:
            for call in public_calls(stub, metadata):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == UNAUTHENTICATED, metadata
        for token in PUBLIC_TOKENS:
            for call in public_calls(stub, (("authorization", f"Bearer {token}"),)):
                call()
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
    with Client(auth_target, token=PUBLIC_TOKENS[1]) as c:
        out = c.complete("The capital of France is", max_tokens=4, temperature=0.0)[0]
        assert out.completion_tokens == 4 or out.finish_reason == "stop"


def test_logs_carry_neither_prompts_outputs_nor_secrets(auth_target, schedulers, workdir):
    with Client(auth_target, token=PUBLIC_TOKENS[0]) as c:
        out = c.complete(
            f"Repeat after me: {MARKER} {MARKER} {MARKER}",
            max_tokens=24,
            temperature=0.0,
            ignore_eos=True,
            request_id="log-check-1",
        )[0]
        chat = c.complete(messages=[{"role": "user", "content": f"Say {MARKER}."}], max_tokens=8, temperature=0.0)[0]
    # The per-request INFO line shows the log is being written: without it the checks below would prove nothing.
    wait_until(lambda: "log-check-1" in schedulers.log.read_text(errors="replace"), [], 10, "the request_finished line")
    scheduler_log = schedulers.log.read_text(errors="replace")
    executor_log = (workdir / "executor.log").read_text(errors="replace")
    outputs = [t.strip() for t in (out.text, chat.text) if len(t.strip()) >= 8]
    assert outputs, "outputs too short to look for in the logs"
    for name, log in (("scheduler", scheduler_log), ("executor", executor_log)):
        assert MARKER not in log, f"the prompt appears in the {name} log"
        for text in outputs:
            assert text not in log, f"generated text appears in the {name} log"
        for secret in (EXECUTOR_SECRET, *PUBLIC_TOKENS):
            assert secret not in log, f"a secret appears in the {name} log"


# ---- TLS and mutual TLS -------------------------------------------------------------------


def test_tls_client_with_the_ca_works_and_a_plaintext_client_is_refused(schedulers, pki):
    def tls_channel(target):
        return grpc.secure_channel(target, grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes()))

    target = schedulers.use(
        "tls",
        [
            "--tls-cert",
            str(pki / "server.pem"),
            "--tls-key",
            str(pki / "server.key"),
            "--executor-auth-token",
            EXECUTOR_SECRET,
        ],
        tls_channel,
    )
    with Client(target, tls_ca=str(pki / "ca.pem")) as c:
        assert c.health(timeout=10) == SERVING
        out = c.complete("Hello", max_tokens=3, temperature=0.0, timeout=60)[0]
        assert out.finish_reason in ("length", "stop") and out.token_ids
    with Client(target) as c, pytest.raises(grpc.RpcError) as info:
        c.model_info()
    assert info.value.code() == UNAVAILABLE


def test_mutual_tls_refuses_clients_without_a_certificate(schedulers, pki):
    def mtls_channel(target):
        creds = grpc.ssl_channel_credentials(
            (pki / "ca.pem").read_bytes(), (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
        )
        return grpc.secure_channel(target, creds)

    target = schedulers.use(
        "mtls",
        [
            "--tls-cert",
            str(pki / "server.pem"),
            "--tls-key",
            str(pki / "server.key"),
            "--tls-client-ca",
            str(pki / "ca.pem"),
            "--executor-auth-token",
            EXECUTOR_SECRET,
        ],
        mtls_channel,
    )
    with Client(target, tls_ca=str(pki / "ca.pem")) as c, pytest.raises(grpc.RpcError) as info:
        c.model_info()
    assert info.value.code() == UNAVAILABLE
    with Client(
        target, tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / "client.pem"), tls_key=str(pki / "client.key")
    ) as c:
        out = c.complete("Hello", max_tokens=3, temperature=0.0, timeout=60)[0]
        assert out.finish_reason in ("length", "stop") and out.token_ids
