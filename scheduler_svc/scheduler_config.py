"""The scheduler's limits and switches, each declared once and validated at construction.

`SchedulerPolicy` is what the operator sets (its fields are flags of
`python -m scheduler_svc`, nested in `SchedulerServiceConfig`).
`SchedulerConfig` is that policy plus what the executor's handshake tells:
the KV blocks and the longest sequence (`for_executor`). The rule that one
sequence of `max_model_len` tokens can always finish lives in
`max_sequence_len`, used both to cap the model's length and to check it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from shared.config_fields import at_least, check_options, option, rule

HASH_ALGOS = ("sha256", "blake2b")


@dataclass(frozen=True)
class SchedulerPolicy:
    block_size: int = option(
        16,
        help="Tokens per KV block.",
        check=rule(lambda v: v in (1, 2, 4, 8, 16, 32, 64, 128), "must be a power of two 1..128"),
    )
    max_num_seqs: int = option(256, help="Most requests in one step.", check=at_least(1))
    max_num_batched_tokens: int = option(2048, help="Most tokens in one step.", check=at_least(1))
    watermark: float = option(
        0.01,
        help="Fraction of KV blocks kept free when admitting.",
        check=rule(lambda v: 0 <= v < 1, "must be in [0, 1)"),
    )
    enable_prefix_caching: bool = option(True, flag="--no-prefix-caching", help="Disable the prefix cache.")
    enable_chunked_prefill: bool = option(True, flag="--no-chunked-prefill", help="Never split a prompt across steps.")
    hash_algo: str = option("sha256", choices=HASH_ALGOS, help="Prefix-cache block hash.")
    long_prefill_token_threshold: int = 0  # 0 = off; else the most tokens one prefill gets per step (no flag)

    def __post_init__(self) -> None:
        check_options(self)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")

    def watermark_blocks(self, num_blocks: int) -> int:
        """Blocks admissions leave free, of num_blocks (block 0, the null block, never counts)."""
        return int(self.watermark * (num_blocks - 1))

    def max_sequence_len(self, num_blocks: int) -> int:
        """The longest sequence that can always finish on num_blocks: alone beside the
        watermark its KV must fit (else it could wait forever with nothing else
        running), and without chunked prefill its whole recompute must fit one step."""
        kv_len = (num_blocks - 1 - self.watermark_blocks(num_blocks)) * self.block_size
        return kv_len if self.enable_chunked_prefill else min(kv_len, self.max_num_batched_tokens)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulerPolicy):
    num_blocks: int  # from the executor handshake, null block 0 included
    max_model_len: int

    @classmethod
    def for_executor(cls, policy: SchedulerPolicy, num_blocks: int, model_max_len: int) -> SchedulerConfig:
        """The policy on this executor: the model's length, capped to what can always finish."""
        max_len = min(model_max_len, policy.max_sequence_len(num_blocks))
        return cls(
            **{f.name: getattr(policy, f.name) for f in fields(SchedulerPolicy)},
            num_blocks=num_blocks,
            max_model_len=max_len,
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_model_len <= self.max_sequence_len(self.num_blocks):
            return
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or long prompts could never run"
            )
        usable, reserve = self.num_blocks - 1, self.watermark_blocks(self.num_blocks)
        raise ValueError(
            f"KV cache too small: {usable} usable blocks minus a watermark of {reserve} cannot hold one "
            f"max_model_len={self.max_model_len} sequence ({-(-self.max_model_len // self.block_size)} blocks "
            f"of {self.block_size} tokens); lower max_model_len or give the executor more KV memory"
        )
