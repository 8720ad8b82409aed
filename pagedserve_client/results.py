"""What a Generate call returns: one `Completion` type for a streamed delta and a whole sample.

`Client.generate` yields one Completion per message (the text and tokens since
the sample's previous message); `Client.complete` returns one per sample with
everything added up. `finish_reason` is a string in both ("stop", "length",
"abort"), None until the sample's last message; `usage` likewise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives asked for."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class Completion:
    index: int = 0  # which of the request's n samples
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked for
    finish_reason: str | None = None  # set on a sample's last message
    usage: Usage | None = None  # set on a sample's last message
    matched_stop: str = ""  # the stop string that ended the sample, if any
    matched_stop_token_id: int | None = None  # the stop token (EOS included) that ended it, if any
    request_id: str = ""

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> Completion:
        out = cls(
            index=msg.index,
            text=msg.text,
            token_ids=list(msg.token_ids),
            request_id=msg.request_id,
            logprobs=[
                TokenLogprob(lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top))
                for lp in msg.logprobs
            ],
        )
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            out.finish_reason = pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
            u = msg.usage
            out.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
            out.matched_stop = msg.matched_stop
            if msg.HasField("matched_stop_token_id"):
                out.matched_stop_token_id = msg.matched_stop_token_id
        return out

    def add(self, delta: Completion) -> None:
        """Appends one streamed message of this sample."""
        self.index, self.request_id = delta.index, delta.request_id
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.usage = delta.finish_reason, delta.usage
            self.matched_stop, self.matched_stop_token_id = delta.matched_stop, delta.matched_stop_token_id

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens if self.usage else 0

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage else 0

    @property
    def cached_prompt_tokens(self) -> int:
        return self.usage.cached_prompt_tokens if self.usage else 0
