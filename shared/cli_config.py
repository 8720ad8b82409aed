"""Flags that also read `PAGEDSERVE_<FLAG>` environment variables.

Both services parse their command line once, in `main`, with this parser and
turn the result into a frozen config dataclass; nothing deeper reads the
environment. Precedence: command-line flag > environment variable > default.

    --max-num-seqs 64          beats   PAGEDSERVE_MAX_NUM_SEQS=32
    --no-prefix-caching        <->     PAGEDSERVE_NO_PREFIX_CACHING=1
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

ENV_PREFIX = "PAGEDSERVE_"
SECRET_FLAGS = frozenset({"--auth-token", "--executor-auth-token"})  # never shown in --help
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    """`--max-num-seqs` -> `PAGEDSERVE_MAX_NUM_SEQS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose long options default to their environment variable."""

    def __init__(self, *args, environ: Mapping[str, str], **kwargs):
        self._environ = environ
        self.env_names: list[str] = []
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is not None and flag != "--help":
            name = env_name(flag)
            self.env_names.append(name)
            if name in self._environ:
                kwargs["default"] = self._from_env(name, self._environ[name], kwargs)
            default = kwargs.get("default")
            # Secrets are never echoed, not even from the environment; % would be a format directive.
            secret = flag in SECRET_FLAGS
            shown = "" if secret or default is None or default is False or default == "" else f" [default {default}]"
            kwargs["help"] = ((kwargs.get("help") or "") + f"{shown} [env {name}]").replace("%", "%%")
        return super().add_argument(*names, **kwargs)

    def _from_env(self, name: str, raw: str, kwargs: dict):
        if kwargs.get("action") == "store_true":
            value = raw.strip().lower()
            if value in _TRUE:
                return True
            if value in _FALSE:
                return False
            self.error(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
        convert = kwargs.get("type", str)
        try:
            value = convert(raw)
        except (TypeError, ValueError):
            self.error(f"{name}={raw!r} is not a valid {getattr(convert, '__name__', 'value')}")
        choices = kwargs.get("choices")
        if choices is not None and value not in choices:
            self.error(f"{name}={raw!r}: expected one of {', '.join(map(str, choices))}")
        return value
