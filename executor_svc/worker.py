"""The executor's tensors: model weights, KV memory and the model runner.

The model loads once at start; KV memory is sized and allocated at the first
handshake (it depends on the block size the scheduler asks for) and again only
if a later handshake asks for a different block size.
"""
from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from executor_svc.attention import get_backend
from executor_svc.config import ExecutorConfig
from executor_svc.kv_cache import GIB, allocate_kv_caches, bytes_per_block, num_blocks_for_budget
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import load_model
from executor_svc.model_runner import ModelRunner
from executor_svc.tokenizer_info import TokenizerInfo

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class HandshakeInfo:
    model: ModelConfig
    tokenizer: TokenizerInfo
    max_model_len: int
    num_kv_blocks: int
    kv_cache_bytes: int
    dtype_name: str
    device: str
    attention_backend: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 matmuls run ~3x slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        fast_bf16 = device.type == "cuda" or cpu_has_fast_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class Worker:
    def __init__(self, config: ExecutorConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "cpu"
        self.attn_backend = get_backend(backend)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, self.dtype, self.device, self.attn_backend)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        cap = self.model_config.max_position_embeddings
        self.max_model_len = min(cap, config.max_model_len) if config.max_model_len else cap
        self.runner: ModelRunner | None = None
        self._block_size = 0
        self._info: HandshakeInfo | None = None

    @property
    def configured(self) -> bool:
        return self.runner is not None

    def _kv_budget_bytes(self, block_size: int) -> int:
        if self.device.type == "cpu":
            return int(self.config.kv_cache_gib * GIB)
        # CUDA: what the card has left under the utilisation cap once weights
        # and a profiled peak of activations are accounted for.
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        budget = int(total * self.config.gpu_memory_utilization) - used - self._activation_reserve_bytes()
        if budget <= 0:
            raise ValueError("no GPU memory left for the KV cache: raise --gpu-memory-utilization")
        return budget

    def _activation_reserve_bytes(self) -> int:
        # The peak of a forward at the scheduler's token budget is dominated by
        # the logits-free MLP activations: tokens x intermediate x a few buffers.
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 8 * self._max_tokens * max(cfg.intermediate_size, 3 * cfg.hidden_size) * elem

    def configure(self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> HandshakeInfo:
        """Sizes and allocates KV memory for `block_size`; drops all request state."""
        self._max_tokens = max(max_num_batched_tokens, 1)
        if self.runner is not None and block_size == self._block_size:
            self.runner.reset()
            return self._info
        self.runner = None
        num_blocks = num_blocks_for_budget(self._kv_budget_bytes(block_size), self.model_config, block_size, self.dtype)
        kv_caches = allocate_kv_caches(self.model_config, num_blocks, block_size, self.dtype, self.device)
        self.runner = ModelRunner(self.model, kv_caches, block_size, self.model_config.vocab_size, self.device, self.attn_backend)
        self._block_size = block_size
        self._info = HandshakeInfo(
            model=self.model_config,
            tokenizer=self.tokenizer,
            max_model_len=self.max_model_len,
            num_kv_blocks=num_blocks,
            kv_cache_bytes=num_blocks * bytes_per_block(self.model_config, block_size, self.dtype),
            dtype_name=str(self.dtype).removeprefix("torch."),
            device=self.device.type,
            attention_backend=self.attn_backend.name,
        )
        log.info("kv_cache_allocated", num_blocks=num_blocks, block_size=block_size, gib=round(self._info.kv_cache_bytes / GIB, 3))
        return self._info
