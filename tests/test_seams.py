"""The seams between parts are typing.Protocols: every implementation, real or
fake, takes the protocol's arguments under the protocol's names (extra ones
only with defaults), and is async exactly where the protocol is."""

from __future__ import annotations

import inspect

import pytest
from model_utils import DenseAttentionBackend
from test_step_failure import FakeClient

from executor_svc.attention.backend import AttentionBackend
from executor_svc.attention.cpu_backend import CpuAttentionBackend
from executor_svc.attention.torch_backend import TorchAttentionBackend
from scheduler_svc.executor_client import ExecutorClient
from scheduler_svc.executor_connection import ExecutorConnection


def protocol_methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


def signature_mismatches(impl, protocol: type) -> list[str]:
    """What about `impl`'s methods (a class or an instance) departs from `protocol`'s."""
    problems = []
    for name in protocol_methods(protocol):
        want = getattr(protocol, name)
        got = getattr(impl, name, None)
        if got is None:
            problems.append(f"{name}: missing")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
            problems.append(f"{name}: async differs")
        wanted = [p for p in inspect.signature(want).parameters.values() if p.name != "self"]
        params = [p for p in inspect.signature(got).parameters.values() if p.name != "self"]
        if [p.name for p in params[: len(wanted)]] != [p.name for p in wanted]:
            problems.append(f"{name}{inspect.signature(got)} does not take {[p.name for p in wanted]}")
        if any(p.default is inspect.Parameter.empty for p in params[len(wanted) :]):
            problems.append(f"{name}: extra arguments without defaults")
        if any(
            w.default is not inspect.Parameter.empty and p.default is inspect.Parameter.empty
            for w, p in zip(wanted, params)
        ):
            problems.append(f"{name}: an optional argument became required")
    return problems


def test_the_checker_catches_a_renamed_argument_and_a_lost_async():
    class Wrong:
        async def connect(self, block_size, max_tokens, max_num_seqs, timeout_s=5.0): ...
        def send(self, plan): ...

    problems = signature_mismatches(Wrong, ExecutorConnection)
    assert any(p.startswith("connect") for p in problems)
    assert "send: async differs" in problems
    assert "receive: missing" in problems


@pytest.mark.parametrize("impl", [ExecutorClient, FakeClient], ids=lambda c: c.__name__)
def test_executor_connections_match_the_protocol(impl):
    assert signature_mismatches(impl, ExecutorConnection) == []
    assert isinstance(impl.__new__(impl), ExecutorConnection)


def attention_backends():
    from executor_svc.attention.triton_backend import TritonAttentionBackend  # imports triton: only when run

    # The cpu backend's write_kv is its SDPA helper's, bound at construction: check an instance.
    return [
        CpuAttentionBackend(kernel=None),
        TorchAttentionBackend(),
        TritonAttentionBackend(),
        DenseAttentionBackend(),
    ]


def test_attention_backends_match_the_protocol():
    for backend in attention_backends():
        assert signature_mismatches(backend, AttentionBackend) == [], type(backend).__name__
        assert isinstance(backend, AttentionBackend)
        assert isinstance(backend.name, str)
