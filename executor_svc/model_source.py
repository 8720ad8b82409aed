"""Where `--model` points: a local path, or a Hugging Face id resolved through `huggingface_hub`.

    None                        -> None (the embedded model; model_loader.py finds it)
    /path/model.gguf, /folder   -> unchanged
    Qwen/Qwen2.5-0.5B-Instruct  -> the snapshot folder in the Hugging Face cache
                                   (HF_HUB_CACHE / HF_HOME), downloaded first unless
                                   HF_HUB_OFFLINE=1; `--revision` picks a branch, tag or commit

Only what the loader reads is fetched: config and tokenizer files and
safetensors (never pickled *.bin). Every failure is a `ModelNotFound` with a
one-line message that says what to do; the executor prints it and exits 1.
"""

from __future__ import annotations

import os
import re

# Hugging Face's repo-id grammar: an optional namespace and a name of [\w.-], no "--" or "..".
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


class ModelNotFound(ValueError):
    """--model names nothing that can be loaded; the message is one line for the operator."""


def is_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and "--" not in model and ".." not in model and not model.endswith(".gguf")


def resolve_model(
    model: str | None, revision: str | None = None, *, cache_dir: str | None = None, offline: bool | None = None
) -> str | None:
    """A local path for `model`. `cache_dir` and `offline` default to huggingface_hub's own
    settings (HF_HUB_CACHE, HF_HUB_OFFLINE)."""
    if model is None or os.path.exists(model):
        if revision is not None:
            raise ModelNotFound(
                f"--revision {revision!r} applies to Hugging Face ids, not to {model or 'the embedded model'}"
            )
        return model
    if not is_repo_id(model):
        raise ModelNotFound(f"--model {model!r}: no such file or folder (and not a Hugging Face id such as org/name)")
    import huggingface_hub
    from huggingface_hub import constants, errors

    if offline is None:
        offline = constants.HF_HUB_OFFLINE
    where = cache_dir or constants.HF_HUB_CACHE
    try:
        return huggingface_hub.snapshot_download(
            model, revision=revision, cache_dir=cache_dir, local_files_only=offline, allow_patterns=ALLOW_PATTERNS
        )
    except errors.LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE=1 forbids downloading it" if offline else "and the Hugging Face Hub could not be reached"
        raise ModelNotFound(
            f"--model {model!r}{_at(revision)} is not in the Hugging Face cache ({where}), {how}"
        ) from None
    except errors.GatedRepoError:
        raise ModelNotFound(
            f"--model {model!r} is gated: accept its licence on huggingface.co and set HF_TOKEN"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(
            f"--model {model!r}: no such Hugging Face repository (or it is private: set HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"--model {model!r} has no revision {revision!r}") from None
    except (errors.HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFound(f"--model {model!r}{_at(revision)}: download failed: {first}") from None


def _at(revision: str | None) -> str:
    return f" (revision {revision!r})" if revision else ""
