"""The wheel as a user installs it, away from this checkout.

- `pip wheel .` holds the generated gRPC/protobuf modules and the native C
  sources, and no `bench` or `tests` packages;
- `pip install pagedserve` (the client) pulls in no torch, tokenizers or
  web server;
- `pagedserve[scheduler,gateway]` still has no torch (the scheduler never
  imports it); the venv's scheduler and OpenAI gateway serve requests, in
  front of an executor started from the checkout, to the venv's `pagedserve`
  CLI and to plain HTTP.
The executor from the wheel (`pagedserve[server]`, with torch) is run by
deploy/compose-smoke.sh, whose image installs this wheel (tests/test_compose.py).

The venv is a plain one (no system site-packages); pip finds the few small
dependencies through its usual configuration (the machine's local indexes,
then PyPI), and torch is never asked for.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
import urllib.request
import zipfile
from email.parser import Parser

import pytest

from tests.servers import REPO, Servers, free_port, wait_serving

pytestmark = pytest.mark.slow
TOP_LEVEL = {"pagedserve", "pagedserve_client", "scheduler_svc", "executor_svc", "shared", "openai_gateway"}
GENERATED = [
    f"pagedserve/{p}{s}"
    for p in ("v1/generation", "executor/v1/executor")
    for s in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), REPO],
        check=True,
        timeout=300,
        cwd=out,
    )
    return glob.glob(str(out / "pagedserve-*.whl"))[0]


def metadata(wheel: str):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


def test_wheel_holds_generated_code_and_native_sources_and_no_bench_or_tests(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == TOP_LEVEL
    assert set(GENERATED) <= names
    native = {
        os.path.relpath(p, REPO)
        for p in glob.glob(os.path.join(REPO, "executor_svc", "**", "native", "*.[ch]"), recursive=True)
    }
    assert native and native <= names, native - names
    assert not [n for n in names if n.endswith((".so", ".pyc"))]


def test_client_requirements_have_no_torch_and_server_has_every_role(wheel):
    requires = metadata(wheel).get_all("Requires-Dist")
    client = [r for r in requires if "extra ==" not in r]
    assert {r.split(">")[0].split("<")[0] for r in client} == {
        "grpcio",
        "grpcio-health-checking",
        "grpcio-status",
        "protobuf",
    }
    by_extra: dict[str, set[str]] = {}
    for r in requires:
        if "extra ==" in r:
            extra = r.rsplit("extra ==", 1)[1].strip().strip('"')
            by_extra.setdefault(extra, set()).add(r.split(";")[0].split(">")[0].split("[")[0].strip())
    assert "torch" in by_extra["executor"]
    assert not {"torch", "transformers", "triton"} & (by_extra["scheduler"] | by_extra["gateway"])
    assert any("server" in r and "scheduler" in r and "executor" in r and "gateway" in r for r in requires)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv holding the wheel (client only). Runs away from the checkout:
    nothing here can import it by accident."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return root / "venv", env, str(root)


def run(venv, *args, timeout=300):
    path, env, cwd = venv
    return subprocess.run(
        [str(path / "bin" / args[0]), *args[1:]], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def pip_install(venv, spec: str) -> None:
    done = run(venv, "python", "-m", "pip", "install", "-q", spec)
    assert done.returncode == 0, done.stderr[-3000:]


def importable(venv, module: str) -> bool:
    return (
        run(
            venv, "python", "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        ).returncode
        == 0
    )


def test_client_only_install_has_no_torch(venv, wheel):
    pip_install(venv, wheel)
    for heavy in ("torch", "triton", "transformers", "tokenizers", "starlette", "numpy"):
        assert not importable(venv, heavy), f"`pip install pagedserve` pulled in {heavy}"
    where = run(venv, "python", "-c", "import pagedserve_client, pagedserve.v1.generation_pb2 as m; print(m.__file__)")
    assert where.returncode == 0 and where.stdout.startswith(str(venv[0])), where
    assert run(venv, "pagedserve", "--help").returncode == 0


def test_cli_scheduler_and_gateway_run_from_the_wheel_without_torch(venv, wheel):
    """One live stack: executor from the checkout (it needs torch), scheduler,
    gateway and CLI from the venv."""
    pip_install(venv, f"{wheel}[scheduler,gateway]")
    assert not importable(venv, "torch")
    s = Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.25"])
    gateway = None
    try:
        s.start_executor()
        path, env, cwd = venv
        py = str(path / "bin" / "python")
        s.scheduler = subprocess.Popen(
            [py, "-m", "scheduler_svc", "--listen", s.public_addr, "--executor", s.executor_addr],
            env={**env, "PAGEDSERVE_SECRET_DIR": s.secret_dir},  # the executor's secret (tests/servers.py)
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        http = f"127.0.0.1:{free_port()}"
        gateway = subprocess.Popen(
            [py, "-m", "openai_gateway", "--listen", http, "--scheduler", s.public_addr],
            env=env,
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_serving(s.public_addr, [s.executor, s.scheduler])

        health = run(venv, "pagedserve", "--target", s.public_addr, "health")
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
        done = run(
            venv,
            "pagedserve",
            "--target",
            s.public_addr,
            "generate",
            "The capital of France is",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        )
        assert done.returncode == 0 and done.stdout.strip(), done.stderr

        models = _get_json(f"http://{http}/v1/models", gateway)
        body = json.dumps(
            {"model": models["data"][0]["id"], "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        ).encode()
        request = urllib.request.Request(f"http://{http}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            completion = json.load(r)
        assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] > 0
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=40)
        s.stop()


def _get_json(url: str, proc: subprocess.Popen, timeout: float = 60.0):
    """GET url as JSON once the server at it listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.load(r)
        except OSError:
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{url} not answering after {timeout}s"
            time.sleep(0.3)
