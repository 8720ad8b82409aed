"""`pagedserve serve`'s command line: which flag, and which PAGEDSERVE_* variable, reaches which service.

The launcher (launch.py) owns a few flags (MODEL, --host, --port, ...); every
other flag belongs to the executor, the scheduler or the gateway, whose own
parsers say which, and goes to each service that has it (`--log-level` to all
three). The flags that wire the tree together are the launcher's to set.

Environment: each service still reads its PAGEDSERVE_* variables. Three flags
exist in the executor and the scheduler with different meanings, so
`child_envs` routes their variables:

    PAGEDSERVE_METRICS_LISTEN           the scheduler's /metrics
    PAGEDSERVE_EXECUTOR_METRICS_LISTEN  the executor's /metrics
    PAGEDSERVE_AUTH_TOKEN               a client bearer token (the scheduler's)
    PAGEDSERVE_EXECUTOR_AUTH_TOKEN[_FILE]  the internal hop's secret: both get it
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

EXECUTOR, SCHEDULER, GATEWAY = "executor_svc", "scheduler_svc", "openai_gateway"
# Flags the launcher sets itself, per service (a user's value would break the tree's wiring).
OWNED = {
    EXECUTOR: {"--listen", "--model", "--auth-token", "--auth-token-file", "--metrics-listen"},
    SCHEDULER: {"--listen", "--executor", "--executor-auth-token", "--executor-auth-token-file"},
    GATEWAY: {"--listen", "--scheduler", "--metrics-upstream"},
}


def child_envs(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(executor's, scheduler's) environment, each variable reaching the process it means."""
    executor = {k: v for k, v in environ.items() if k not in ("PAGEDSERVE_METRICS_LISTEN", "PAGEDSERVE_AUTH_TOKEN")}
    for name in ("METRICS_LISTEN", "AUTH_TOKEN", "AUTH_TOKEN_FILE"):
        value = environ.get(f"PAGEDSERVE_EXECUTOR_{name}")
        if value is not None:
            executor[f"PAGEDSERVE_{name}"] = value
    return executor, dict(environ)


def service_parsers(environ: Mapping[str, str]) -> dict[str, argparse.ArgumentParser]:
    from executor_svc.config import build_parser as executor_parser  # torch-free: argparse only
    from openai_gateway.config import build_parser as gateway_parser
    from scheduler_svc.config import build_parser as scheduler_parser

    return {EXECUTOR: executor_parser(environ), SCHEDULER: scheduler_parser(environ), GATEWAY: gateway_parser(environ)}


def routes(extra: Sequence[str], parsers: Mapping[str, argparse.ArgumentParser]) -> dict[str, list[str]]:
    """Splits flags the launcher does not know among the services that have them.
    Raises ValueError for a flag no service has, or one the launcher sets itself."""
    out: dict[str, list[str]] = {name: [] for name in parsers}
    i = 0
    while i < len(extra):
        token = extra[i]
        flag, eq, value = token.partition("=")
        owners = [name for name, p in parsers.items() if flag in p._option_string_actions]
        if not flag.startswith("--") or not owners:
            raise ValueError(
                f"unknown flag {token!r} (see pagedserve serve --help, python -m executor_svc --help, "
                "python -m scheduler_svc --help, python -m openai_gateway --help)"
            )
        targets = [name for name in owners if flag not in OWNED[name]]
        if not targets:
            raise ValueError(f"{flag} is set by pagedserve serve itself; start the services one by one to choose it")
        takes_value = parsers[owners[0]]._option_string_actions[flag].nargs != 0
        args = [token]
        if takes_value and not eq:
            if i + 1 >= len(extra):
                raise ValueError(f"{flag} needs a value")
            args.append(extra[i + 1])
            i += 1
        for name in targets:
            out[name] += args
        i += 1
    return out


def split_args(
    argv: Sequence[str], own: argparse.ArgumentParser, parsers: Mapping[str, argparse.ArgumentParser]
) -> tuple[list[str], list[str]]:
    """(the launcher's arguments, the services' flags). A service flag's value is
    taken with it, so that `--dtype float32` is never mistaken for the MODEL argument."""
    mine, theirs = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, _ = token.partition("=")
        action = own._option_string_actions.get(flag)
        target = mine
        if action is None and token.startswith("--"):
            action = next(
                (p._option_string_actions[flag] for p in parsers.values() if flag in p._option_string_actions), None
            )
            target = theirs
        target.append(token)
        if token.startswith("-") and action is not None and action.nargs != 0 and not eq and i + 1 < len(argv):
            target.append(argv[i + 1])
            i += 1
        i += 1
    return mine, theirs


def flag_value(args: list[str], flag: str) -> str | None:
    for i, token in enumerate(args):
        if token == flag and i + 1 < len(args):
            return args[i + 1]
        if token.startswith(flag + "="):
            return token.partition("=")[2]
    return None
