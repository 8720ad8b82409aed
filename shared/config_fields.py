"""Configuration fields declared once; the command line and environment are derived from them.

A service's config is a frozen dataclass. Each field that the operator sets is
declared with `option()`: its type and default are the field's, the rest is
metadata. From that one declaration come the flag, its PAGEDSERVE_* variable
(shared/cli_config.py: flag > variable > default), its --help line and its rule:

    max_num_seqs: int = option(256, help="Most requests in one step.", check=at_least(1))

    --max-num-seqs 64   <->   PAGEDSERVE_MAX_NUM_SEQS=64

- The flag is the field's name with `-` for `_` and without a `_s` (seconds)
  suffix (`drain_timeout_s` -> `--drain-timeout`), unless `flag=` names it.
- `bool` is a switch that flips the default (`enable_prefix_caching`, default
  True, is `--no-prefix-caching`); `bool | None` with default None is a switch
  that sets True. `tuple[str, ...]` is one comma-separated value. `str | None`
  reads "" as None.
- A field whose type is a dataclass nests: its options are flags of the same
  parser, and the nested config is built (and validates itself) first.
- `choices` and `check` are the field's own rule, checked by `check_options`
  at the top of the config's `__post_init__`, so a config built in code is
  held to it as well as a parsed one; rules across fields follow it there.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from shared.cli_config import EnvArgumentParser

_KEY = "pagedserve_option"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Option:
    flag: str | None
    help: str
    choices: Sequence[Any] | None
    check: Callable[[Any], None] | None  # raises ValueError(why), without the flag


def option(
    default: Any,
    *,
    help: str = "",
    flag: str | None = None,
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], None] | None = None,
) -> Any:
    """A config field the operator sets by flag or PAGEDSERVE_* variable."""
    return dataclasses.field(default=default, metadata={_KEY: _Option(flag, help, choices, check)})


def rule(holds: Callable[[Any], bool], must: str) -> Callable[[Any], None]:
    """A check from a predicate: rule(lambda v: v > 0, "must be > 0")."""

    def check(value: Any) -> None:
        if not holds(value):
            raise ValueError(f"{must}, got {value!r}")

    return check


def at_least(low: float) -> Callable[[Any], None]:
    return rule(lambda v: v >= low, f"must be >= {low}")


def above(low: float) -> Callable[[Any], None]:
    return rule(lambda v: v > low, f"must be > {low}")


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata[_KEY].flag or "--" + f.name.removesuffix("_s").replace("_", "-")


def check_options(config: Any) -> None:
    """Each option's own rule (choices, check); the error names the flag."""
    for f in dataclasses.fields(config):
        opt = f.metadata.get(_KEY)
        if opt is None:
            continue
        value = getattr(config, f.name)
        if opt.choices is not None and value not in opt.choices:
            raise ValueError(f"{flag_of(f)} {value!r}: expected one of {', '.join(map(str, opt.choices))}")
        if opt.check is not None:
            try:
                opt.check(value)
            except ValueError as e:
                raise ValueError(f"{flag_of(f)} {e}") from None


def _base(kind: Any) -> Any:
    """int for int, str for `str | None`, tuple for `tuple[str, ...]`."""
    if isinstance(kind, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not types.NoneType)
    return typing.get_origin(kind) or kind


def _options(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, base type) of cls's options and of the options of the dataclasses it nests, in order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _options(hints[f.name])
        elif _KEY in f.metadata:
            kind = _base(hints[f.name])
            assert kind in (bool, int, float, str, tuple), f"{cls.__name__}.{f.name}: an option's type is {kind}"
            out.append((f, kind))
    return out


def parser_for(cls: type, environ: Mapping[str, str], *, prog: str, description: str) -> EnvArgumentParser:
    """A parser with one flag per option of cls (nested ones included), in declaration order."""
    parser = EnvArgumentParser(prog=prog, description=description, environ=environ)
    for f, kind in _options(cls):
        opt = f.metadata[_KEY]
        if kind is bool:
            parser.add_argument(flag_of(f), dest=f.name, action="store_true", default=False, help=opt.help)
            continue
        typed = {"type": kind} if kind in (int, float) else {}
        default = ",".join(f.default) if kind is tuple else f.default
        if opt.choices is None:  # the flag's name, not the field's (--step-timeout STEP_TIMEOUT, not ..._S)
            typed["metavar"] = flag_of(f).lstrip("-").replace("-", "_").upper()
        parser.add_argument(flag_of(f), dest=f.name, default=default, choices=opt.choices, help=opt.help, **typed)
    return parser


def _value(f: dataclasses.Field, kind: Any, raw: Any) -> Any:
    if kind is bool:
        return (not f.default if isinstance(f.default, bool) else True) if raw else f.default
    if kind is tuple:
        return tuple(v.strip() for v in raw.split(",") if v.strip())
    return None if f.default is None and raw == "" else raw  # `str | None`: "" means unset


def _values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            values[f.name] = kind(**_values(kind, args))
        elif _KEY in f.metadata:
            values[f.name] = _value(f, _base(kind), getattr(args, f.name))
    return values


def config_from(cls: type[T], parser: argparse.ArgumentParser, args: argparse.Namespace, **resolved: Any) -> T:
    """cls from parsed flags (plus fields main resolved itself, such as secrets);
    a broken rule exits 2 with argparse's usage and one error line."""
    try:
        return cls(**{**_values(cls, args), **resolved})
    except ValueError as e:
        parser.error(str(e))
