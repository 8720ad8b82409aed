"""What can be tested of the Docker deployment without a Docker engine.

- docker-compose.yml validates against the Compose specification's JSON schema
  (the copy shipped in PyPI's docker-compose 1.29.2 wheel, fetched at test time);
- every PAGEDSERVE_* variable the compose files set is one its service reads;
- the healthcheck commands work when run by hand against live processes;
- the Dockerfile installs dependencies before the source, runs as a user, and
  .dockerignore keeps the venv and build outputs out;
- one image tag per variant; compose outlasts the services' drain.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
import yaml

from tests.servers import REPO, Servers

COMPOSE_FILES = ["docker-compose.yml", "docker-compose.gpu.yml"]
MODULE_OF_SERVICE = {"scheduler": "scheduler_svc", "executor": "executor_svc", "gateway": "openai_gateway"}


def load(name: str) -> dict:
    with open(os.path.join(REPO, name)) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose_schema(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("compose-schema")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "docker-compose==1.29.2", "-d", str(d)],
        check=True,
        timeout=300,
    )
    with zipfile.ZipFile(glob.glob(str(d / "*.whl"))[0]) as z:
        return json.loads(z.read("compose/config/compose_spec.json"))


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_validates_against_the_compose_spec(compose_schema, name):
    import jsonschema

    jsonschema.validate(load(name), compose_schema)


def test_schema_check_can_fail(compose_schema):
    import jsonschema

    broken = load("docker-compose.yml")
    broken["services"]["scheduler"]["healthcheck"]["interval"] = {"not": "a duration"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, compose_schema)


def env_vars_read_by(module: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return set(re.findall(r"PAGEDSERVE_[A-Z0-9_]+", out))


def test_every_compose_variable_is_read_by_its_service():
    read = {svc: env_vars_read_by(mod) for svc, mod in MODULE_OF_SERVICE.items()}
    assert "PAGEDSERVE_MAX_NUM_SEQS" in read["scheduler"] and "PAGEDSERVE_KV_CACHE_GIB" in read["executor"]
    for name in COMPOSE_FILES:
        for svc, spec in load(name)["services"].items():
            for var in spec.get("environment", {}):
                if var.startswith("PAGEDSERVE_"):
                    assert var in read[svc], (
                        f"{name}: {svc} sets {var}, which python -m {MODULE_OF_SERVICE[svc]} never reads"
                    )


def test_executor_is_never_published_and_the_scheduler_is():
    services = load("docker-compose.yml")["services"]
    assert "ports" not in services["executor"] and services["executor"].get("network_mode") == "none"
    assert any("50051" in str(p) for p in services["scheduler"]["ports"])


def test_executor_and_scheduler_share_the_executor_secret_and_nobody_else_mounts_it():
    services = load("docker-compose.yml")["services"]
    dirs = {svc: services[svc]["environment"].get("PAGEDSERVE_SECRET_DIR") for svc in ("executor", "scheduler")}
    assert len(set(dirs.values())) == 1 and None not in dirs.values()
    secret_dir = dirs["executor"]
    mounts = {
        svc: [v for v in spec.get("volumes", []) if secret_dir.startswith(v.split(":")[1] + "/")]
        for svc, spec in services.items()
    }
    assert mounts["executor"] == mounts["scheduler"] and len(mounts["executor"]) == 1 and not mounts["gateway"]
    assert mounts["executor"][0].split(":")[0] in load("docker-compose.yml")["volumes"]  # a named volume


def dockerfile() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    with open(os.path.join(REPO, "Dockerfile")) as f:
        text = re.sub(r"\\\n", " ", f.read())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_installs_dependencies_before_the_source_and_runs_as_a_user():
    lines = dockerfile()
    assert lines[0].startswith("ARG BASE_IMAGE=") and "FROM ${BASE_IMAGE} AS system" in lines
    deps = next(i for i, line in enumerate(lines) if line.startswith("RUN") and "[server]" in line)
    source = lines.index("COPY . .")
    assert deps < source, "every source edit would reinstall the dependencies"
    assert all(" . " not in line for line in lines[:deps] if line.startswith("COPY"))
    runtime = lines[lines.index("FROM system AS runtime") :]
    assert not any(
        line.startswith("COPY") and "--from=" not in line and "prebuild_kernels" not in line for line in runtime
    )
    user = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    assert not any("[test" in line or ",test" in line for line in lines)


def test_dockerignore_keeps_the_venv_git_and_build_outputs_out():
    with open(os.path.join(REPO, ".dockerignore")) as f:
        patterns = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    assert {
        ".git",
        ".venv",
        "build",
        "dist",
        "pagedserve",
        "executor_svc/**/native/build",
        "**/__pycache__",
    } <= patterns


def seconds(duration: str) -> float:
    return float(duration.rstrip("s"))


def test_one_image_tag_per_variant_and_stop_grace_beyond_the_drain():
    base, gpu = load("docker-compose.yml")["services"], load("docker-compose.gpu.yml")["services"]
    assert {svc["image"] for svc in base.values()} == {"pagedserve:cpu"}
    assert {gpu.get(name, {}).get("image") for name in base} == {"pagedserve:gpu"}
    for name in ("scheduler", "gateway"):
        drain = float(base[name]["environment"]["PAGEDSERVE_DRAIN_TIMEOUT"])
        assert seconds(base[name]["stop_grace_period"]) > drain, f"compose would kill the {name} mid-drain"


def test_compose_publishes_a_metrics_port():
    scheduler = load("docker-compose.yml")["services"]["scheduler"]
    port = scheduler["environment"]["PAGEDSERVE_METRICS_LISTEN"].rsplit(":", 1)[1]
    assert any(str(p).endswith(f":{port}") for p in scheduler["ports"])


def test_healthcheck_commands_work_against_live_processes():
    services = load("docker-compose.yml")["services"]
    with Servers(executor_args=["--dtype", "float32", "--kv-cache-gib", "0.25"]) as s:
        for svc, target in (("scheduler", s.public_addr), ("executor", s.executor_addr)):
            cmd = list(services[svc]["healthcheck"]["test"][1:])
            cmd[cmd.index("--target") + 1] = target  # the container's address -> this test's
            assert cmd[0] == "pagedserve"
            exe = os.path.join(os.path.dirname(sys.executable), "pagedserve")
            done = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=30)
            assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
        s.executor.kill()
        s.executor.wait()
        exe = os.path.join(os.path.dirname(sys.executable), "pagedserve")
        done = subprocess.run([exe, "--target", s.executor_addr, "health"], capture_output=True, text=True, timeout=30)
        assert done.returncode != 0
