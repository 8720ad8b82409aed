"""Hugging Face ids in --model, resolved from a local Hugging Face cache (no network here).

The cache is built the way huggingface_hub lays it out:
`<cache>/models--org--tiny/refs/main` names a commit, and
`<cache>/models--org--tiny/snapshots/<commit>/` holds the files.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from executor_svc.hf_loader import folder_model_name
from executor_svc.model_source import ModelNotFound, is_repo_id, resolve_model
from tests.servers import REPO

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_cache(cache: str, repo_id: str = "org/tiny", files: dict[str, str] | None = None) -> str:
    """A Hugging Face cache holding one snapshot of `repo_id`; returns the snapshot folder."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", COMMIT)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for name, text in (files or {"config.json": "{}"}).items():
        with open(os.path.join(snapshot, name), "w") as f:
            f.write(text)
    return snapshot


def test_an_id_resolves_to_its_cached_snapshot(tmp_path):
    snapshot = make_cache(str(tmp_path))
    assert resolve_model("org/tiny", cache_dir=str(tmp_path), offline=True) == snapshot
    assert resolve_model("org/tiny", COMMIT, cache_dir=str(tmp_path), offline=True) == snapshot
    assert folder_model_name(snapshot) == "org/tiny"  # the model is named after its repo, not the commit
    assert folder_model_name(str(tmp_path)) == os.path.basename(str(tmp_path))


def test_paths_and_the_embedded_model_pass_through(tmp_path):
    assert resolve_model(None) is None
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelNotFound, match="--revision"):
        resolve_model(str(tmp_path), "main")


@pytest.mark.parametrize(
    "model, message",
    [
        ("org/missing", "not in the Hugging Face cache"),
        ("/no/such/model.gguf", "no such file or folder"),
    ],
)
def test_a_missing_model_is_one_clear_message(tmp_path, model, message):
    make_cache(str(tmp_path))
    with pytest.raises(ModelNotFound, match=message) as info:
        resolve_model(model, cache_dir=str(tmp_path), offline=True)
    assert "\n" not in str(info.value)


def test_repo_id_grammar():
    assert is_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and is_repo_id("gpt2")
    assert not is_repo_id("a/b/c") and not is_repo_id("org/x.gguf") and not is_repo_id("org--x/y")


def test_the_executor_reports_a_missing_model_in_one_line(tmp_path):
    """HF_HUB_CACHE and HF_HUB_OFFLINE as a user sets them; exit 1 and one log line, no traceback."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1", "PAGEDSERVE_LOG_JSON": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "executor_svc", "--model", "org/missing", "--listen", f"unix://{tmp_path}/x.sock"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if "org/missing" in line]
    assert len(lines) == 1 and "model_not_found" in lines[0] and str(tmp_path) in lines[0], out.stderr
