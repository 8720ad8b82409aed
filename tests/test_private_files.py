"""Private directories and files: the executor's installation secret and the
native-kernel cache are this user's alone, or refused.

The ownership cases chown to `nobody`, which needs root (the CI runs as root).
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys

import pytest
import structlog

from executor_svc import native_build
from shared.executor_secret import SECRET_FILE, default_secret_dir, installation_secret, read_secret_file
from shared.private_dir import NotPrivateError, ensure_private_dir
from tests.servers import REPO

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def nobody() -> tuple[int, int]:
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def mode(path) -> int:
    return os.stat(path).st_mode & 0o777


# ---- private directories -----------------------------------------------------------------


def test_a_missing_directory_is_created_private_with_its_parents(tmp_path):
    d = ensure_private_dir(str(tmp_path / "state" / "pagedserve"))
    assert mode(d) == 0o700 and mode(tmp_path / "state") == 0o700


@pytest.mark.parametrize("bits", [0o750, 0o705, 0o777])
def test_a_directory_open_to_group_or_others_is_refused(tmp_path, bits):
    d = tmp_path / "pagedserve"
    d.mkdir()
    d.chmod(bits)
    with pytest.raises(NotPrivateError, match=f"mode {bits:o}.*chmod 700"):
        ensure_private_dir(str(d))


@needs_root
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "pagedserve"
    d.mkdir(mode=0o700)
    os.chown(d, *nobody())
    with pytest.raises(NotPrivateError, match=f"owned by uid {nobody()[0]}"):
        ensure_private_dir(str(d))


def test_a_symbolic_link_is_refused_even_to_a_private_directory(tmp_path):
    real = ensure_private_dir(str(tmp_path / "real"))
    os.symlink(real, tmp_path / "link")
    with pytest.raises(NotPrivateError, match="not a directory"):
        ensure_private_dir(str(tmp_path / "link"))


# ---- the installation secret -------------------------------------------------------------


def test_the_secret_is_generated_once_private_and_then_reused(tmp_path):
    d = tmp_path / "pagedserve"
    first = installation_secret(str(d))
    assert len(first) >= 43 and installation_secret(str(d)) == first
    assert mode(d) == 0o700 and mode(d / SECRET_FILE) == 0o600
    assert os.listdir(d) == [SECRET_FILE]  # no candidate files left behind


def test_processes_starting_at_once_agree_on_one_secret(tmp_path):
    d = tmp_path / "pagedserve"
    code = (
        f"import sys; sys.path.insert(0, {REPO!r}); from shared.executor_secret import installation_secret; "
        f"print(installation_secret({str(d)!r}))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    secrets = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert secrets == {(d / SECRET_FILE).read_text().strip()}


def test_a_secret_file_readable_by_others_is_refused(tmp_path):
    d = tmp_path / "pagedserve"
    installation_secret(str(d))
    (d / SECRET_FILE).chmod(0o644)
    with pytest.raises(NotPrivateError, match="mode 644.*chmod 600"):
        installation_secret(str(d))


@needs_root
def test_a_secret_file_planted_by_another_user_is_refused(tmp_path):
    d = tmp_path / "pagedserve"
    ensure_private_dir(str(d))
    (d / SECRET_FILE).write_text("x" * 43 + "\n")
    (d / SECRET_FILE).chmod(0o600)
    os.chown(d / SECRET_FILE, *nobody())
    with pytest.raises(NotPrivateError, match="owned by uid"):
        installation_secret(str(d))


def test_a_symlinked_or_empty_secret_file_is_refused(tmp_path):
    d = tmp_path / "pagedserve"
    ensure_private_dir(str(d))
    target = tmp_path / "elsewhere"
    target.write_text("y" * 43)
    os.symlink(target, d / SECRET_FILE)
    with pytest.raises(NotPrivateError, match="cannot be opened"):
        installation_secret(str(d))
    os.unlink(d / SECRET_FILE)
    fd = os.open(d / SECRET_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    with pytest.raises(NotPrivateError, match="no usable secret"):
        installation_secret(str(d))


def test_the_default_directory_follows_xdg_state_home():
    assert default_secret_dir({"XDG_STATE_HOME": "/s", "HOME": "/h"}) == "/s/pagedserve"
    assert default_secret_dir({"HOME": "/h"}) == "/h/.local/state/pagedserve"


def test_an_operator_secret_file_that_is_empty_is_an_error_not_no_secret(tmp_path):
    (tmp_path / "blank").write_text("\n  \n")
    with pytest.raises(ValueError, match="blank.*empty"):
        read_secret_file(str(tmp_path / "blank"))
    (tmp_path / "ok").write_text("\n  s3cret  \n")
    assert read_secret_file(str(tmp_path / "ok")) == "s3cret"
    (tmp_path / "two").write_text("s3cret\nother\n")
    with pytest.raises(ValueError, match="exactly one token"):
        read_secret_file(str(tmp_path / "two"))


def test_executor_and_scheduler_read_a_shared_secret_file_alike(tmp_path):
    """A leading comment once gave the two services different secrets (the executor took it as the token)."""
    from scheduler_svc.config import read_executor_token

    path = tmp_path / "executor.token"
    path.write_text("# written by the deploy script\n\n  s3cret\n")
    assert read_secret_file(str(path)) == read_executor_token(str(path)) == "s3cret"


@pytest.mark.parametrize(
    "module,flag", [("executor_svc", "--auth-token-file"), ("scheduler_svc", "--executor-auth-token-file")]
)
def test_both_services_refuse_an_empty_secret_file_in_one_line(tmp_path, module, flag):
    (tmp_path / "empty.token").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", module, flag, str(tmp_path / "empty.token")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert str(tmp_path / "empty.token") in last and ("holds no secret" in last or "holds no token" in last), last


def test_both_services_resolve_the_same_installation_secret(tmp_path):
    from executor_svc.config import parse_config as executor_config
    from scheduler_svc.config import parse_config as scheduler_config

    env = {"XDG_STATE_HOME": str(tmp_path)}
    secret = executor_config([], env).auth_token
    assert secret and scheduler_config([], env).executor_auth_token == secret
    assert secret == installation_secret(str(tmp_path / "pagedserve"))
    assert scheduler_config(["--secret-dir", str(tmp_path / "other")], env).executor_auth_token != secret


# ---- the native-kernel cache -------------------------------------------------------------


@pytest.fixture
def tiny_source(tmp_path, monkeypatch):
    """A one-function C file, and a kernel cache under tmp_path/cache (XDG_CACHE_HOME)."""
    if native_build.shutil.which("cc") is None and native_build.shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    src = tmp_path / "src" / "answer.c"
    src.parent.mkdir()
    src.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return str(src)


def test_kernels_build_into_a_private_per_user_cache(tiny_source, tmp_path):
    lib = native_build.load_library(tiny_source)
    assert lib is not None and lib.answer() == 42
    cache = tmp_path / "cache" / "pagedserve" / "native"
    assert mode(cache) == 0o700 and any(n.endswith(".so") for n in os.listdir(cache))
    assert not os.path.exists(tmp_path / "src" / "build")  # nothing beside the source, nothing in /tmp


def plant(cache) -> None:
    """A directory someone else could have filled, holding a file that must never be loaded."""
    cache.mkdir(parents=True)
    (cache / "planted.so").write_bytes(b"not a library")


def refused(source: str, monkeypatch) -> list[dict]:
    """load_library over a refused cache: an error under PAGEDSERVE_NATIVE=require
    (CI), else None and a warning; returns the warning's log records."""
    monkeypatch.setattr(native_build, "REQUIRED", True)
    with pytest.raises(native_build.NativeBuildError, match="kernel cache refused"):
        native_build.load_library(source)
    monkeypatch.setattr(native_build, "REQUIRED", False)
    with structlog.testing.capture_logs() as logs:
        assert native_build.load_library(source) is None
    return logs


def test_a_kernel_cache_open_to_others_is_refused(tiny_source, tmp_path, monkeypatch):
    cache = tmp_path / "cache" / "pagedserve" / "native"
    plant(cache)
    cache.chmod(0o777)
    logs = refused(tiny_source, monkeypatch)
    assert [e["event"] for e in logs] == ["native_build_unavailable"]
    assert "mode 777" in logs[0]["reason"] and os.listdir(cache) == ["planted.so"]


@needs_root
def test_a_kernel_cache_owned_by_another_user_is_refused(tiny_source, tmp_path, monkeypatch):
    cache = tmp_path / "cache" / "pagedserve" / "native"
    plant(cache)
    cache.chmod(0o700)
    os.chown(cache, *nobody())
    logs = refused(tiny_source, monkeypatch)
    assert "owned by uid" in logs[0]["reason"] and os.listdir(cache) == ["planted.so"]
