"""The scheduler's limits and switches, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    num_blocks: int  # from the executor handshake, null block 0 included
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = off; else the most tokens one prefill gets per step
    hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        for name in ("num_blocks", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.hash_algo not in ("sha256", "blake2b"):
            raise ValueError(f"hash_algo must be 'sha256' or 'blake2b', got {self.hash_algo!r}")
        if not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                    f">= max_model_len ({self.max_model_len}), or long prompts could never run"
                )
            if self.long_prefill_token_threshold:
                raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill")
        # One sequence of max_model_len tokens must fit next to the admission
        # watermark, or it could wait forever with nothing else running.
        usable = self.num_blocks - 1
        reserve = int(self.watermark * usable)
        needed = -(-self.max_model_len // self.block_size)
        if usable - reserve < needed:
            raise ValueError(
                f"KV cache too small: {usable} usable blocks minus a watermark of {reserve} cannot hold one "
                f"max_model_len={self.max_model_len} sequence ({needed} blocks of {self.block_size} tokens); "
                "lower max_model_len or give the executor more KV memory"
            )
