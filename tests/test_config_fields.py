"""shared/config_fields.py: one declaration per field gives its flag, env var, help and rule."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from executor_svc.config import ExecutorConfig
from openai_gateway.config import GatewayConfig
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.scheduler_config import SchedulerPolicy
from shared.config_fields import above, at_least, check_options, config_from, option, parser_for, rule


@dataclass(frozen=True)
class Inner:
    block_size: int = option(16, help="Tokens per block.", check=rule(lambda v: v in (8, 16), "must be 8 or 16"))

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class Toy:
    max_num_seqs: int = option(256, help="Most requests in one step.", check=at_least(1))
    drain_timeout_s: float = option(30.0, help="Seconds to drain.", check=above(0))
    hash_algo: str = option("sha256", choices=("sha256", "blake2b"))
    enable_cache: bool = option(True, flag="--no-cache", help="Disable the cache.")
    verbose: bool = option(False)
    log_json: bool | None = option(None)
    model: str | None = option(None)
    origins: tuple[str, ...] = option((), help="Comma-separated origins.")
    inner: Inner = field(default_factory=Inner)
    token: str = ""  # no option: resolved by main, never a flag

    def __post_init__(self) -> None:
        check_options(self)
        if self.verbose and self.log_json:
            raise ValueError("--verbose and --log-json exclude each other")


def parse(argv: list[str], environ: dict[str, str] | None = None, **resolved) -> Toy:
    p = parser_for(Toy, environ or {}, prog="toy", description="")
    return config_from(Toy, p, p.parse_args(argv), **resolved)


def test_a_flag_and_its_env_var_come_from_one_declaration():
    p = parser_for(Toy, {}, prog="toy", description="")
    flags = {flag for action in p._actions for flag in action.option_strings} - {"-h", "--help"}
    assert flags == {
        "--max-num-seqs",
        "--drain-timeout",  # a `_s` (seconds) suffix is not part of the flag
        "--hash-algo",
        "--no-cache",  # named by flag=
        "--verbose",
        "--log-json",
        "--model",
        "--origins",
        "--block-size",  # a nested config's options are flags of the same parser
    }
    assert "PAGEDSERVE_MAX_NUM_SEQS" in p.format_help() and "[default 256]" in p.format_help()
    assert parse([]) == Toy()
    assert parse([], {"PAGEDSERVE_MAX_NUM_SEQS": "32"}).max_num_seqs == 32
    assert parse(["--max-num-seqs", "64"], {"PAGEDSERVE_MAX_NUM_SEQS": "32"}).max_num_seqs == 64  # flag > env
    assert parse([], {"PAGEDSERVE_DRAIN_TIMEOUT": "2.5"}).drain_timeout_s == 2.5
    assert parse([], {"PAGEDSERVE_BLOCK_SIZE": "8"}).inner == Inner(block_size=8)
    assert parse([], token="s3cret").token == "s3cret"  # a resolved field joins the parsed ones


def test_bool_switches_flip_the_default_from_flag_or_env():
    assert parse(["--no-cache"]).enable_cache is False
    assert parse([], {"PAGEDSERVE_NO_CACHE": "yes"}).enable_cache is False
    assert parse([], {"PAGEDSERVE_NO_CACHE": "0"}).enable_cache is True
    assert parse(["--verbose"]).verbose is True and parse([]).verbose is False
    assert parse([]).log_json is None and parse(["--log-json"]).log_json is True


def test_tuples_are_comma_separated_and_empty_strings_are_none():
    assert parse(["--origins", "a, b,,c"]).origins == ("a", "b", "c")
    assert parse([], {"PAGEDSERVE_ORIGINS": "*"}).origins == ("*",)
    assert parse([]).origins == ()
    assert parse(["--model", "m.gguf"]).model == "m.gguf"
    assert parse([], {"PAGEDSERVE_MODEL": ""}).model is None


def test_rules_hold_for_configs_built_in_code_and_name_the_flag():
    for kwargs, message in (
        ({"max_num_seqs": 0}, "--max-num-seqs must be >= 1, got 0"),
        ({"drain_timeout_s": 0.0}, "--drain-timeout must be > 0, got 0.0"),
        ({"hash_algo": "md5"}, "--hash-algo 'md5': expected one of sha256, blake2b"),
        ({"verbose": True, "log_json": True}, "exclude each other"),
    ):
        with pytest.raises(ValueError, match=message):
            Toy(**kwargs)
    with pytest.raises(ValueError, match="--block-size must be 8 or 16, got 4"):
        Inner(block_size=4)


@pytest.mark.parametrize(
    "argv, environ, message",
    [
        (["--max-num-seqs", "0"], {}, "toy: error: --max-num-seqs must be >= 1, got 0"),
        (["--block-size", "4"], {}, "toy: error: --block-size must be 8 or 16, got 4"),
        ([], {"PAGEDSERVE_MAX_NUM_SEQS": "many"}, "toy: error: PAGEDSERVE_MAX_NUM_SEQS='many' is not a valid int"),
        ([], {"PAGEDSERVE_NO_CACHE": "maybe"}, "toy: error: PAGEDSERVE_NO_CACHE='maybe': expected one of 1/0"),
        ([], {"PAGEDSERVE_HASH_ALGO": "md5"}, "toy: error: PAGEDSERVE_HASH_ALGO='md5': expected one of sha256"),
    ],
)
def test_bad_input_exits_2_with_one_clear_last_line(argv, environ, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv, environ)
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(message)


@pytest.mark.parametrize(
    "config, bad",
    [
        (SchedulerServiceConfig, {"max_n": 0}),
        (SchedulerPolicy, {"watermark": 1.0}),
        (ExecutorConfig, {"dtype": "float16"}),
        (GatewayConfig, {"drain_timeout_s": -1.0}),
    ],
)
def test_every_service_config_checks_its_options(config, bad):
    """Each config's __post_init__ runs check_options (a declared rule that nothing checks would pass silently)."""
    config()
    with pytest.raises(ValueError, match="--" + next(iter(bad)).removesuffix("_s").replace("_", "-")):
        config(**bad)
