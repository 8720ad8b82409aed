"""The executor's tensors: model weights, KV memory and the model runner.

The model loads once at start; KV memory is sized and allocated at the first
handshake and again only if a later one asks for a different block size (on
CUDA, also for different batch limits). On CPU the budget is --kv-cache-gib;
on CUDA it is what --gpu-memory-utilization of the card leaves once a
profiling step at the scheduler's largest batch has run (memory_profile.py).

With tensor parallelism (`tp` given) each rank's Worker holds its share of the
model and KV heads; rank 0's `configure` relays itself to the other ranks, and
all ranks agree on one block count (tensor_parallel.py; tp_launch.py starts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from executor_svc import decoder_stack, fused_ops, machine, native_build, packed_linear
from executor_svc.attention import get_backend, native_kernel, routes
from executor_svc.config import ExecutorConfig
from executor_svc.kv_cache import GIB, allocate_kv_caches, bytes_per_block, num_blocks_for_budget
from executor_svc.memory_profile import cuda_kv_budget
from executor_svc.model_config import ModelConfig
from executor_svc.model_loader import load_model
from executor_svc.model_runner import ModelRunner
from executor_svc.sampler import RowOps, Sampler
from executor_svc.tokenizer_info import TokenizerInfo

if TYPE_CHECKING:
    from executor_svc.tensor_parallel import TPGroup

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


def sampler_for(device: torch.device, deterministic: bool) -> Sampler:
    """torch's row reductions are per row on CPU; on CUDA --deterministic needs the Triton ones (sampler.py)."""
    return Sampler(RowOps.triton() if deterministic and device.type != "cpu" else None)


class Worker:
    def __init__(self, config: ExecutorConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp
        self.tp_size = 1 if tp is None else tp.size
        self.device = machine.resolve_device(config.device) if tp is None else tp.device
        self.dtype = machine.resolve_dtype(config.dtype, self.device)
        if config.kv_cache_dtype == "auto":
            self.kv_dtype = self.dtype
        elif config.kv_cache_dtype == "int8":
            self.kv_dtype = torch.int8
        else:
            self.kv_dtype = machine.resolve_dtype(config.kv_cache_dtype, self.device)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "cpu"
        if backend == "triton" and self.kv_dtype != self.dtype:
            raise ValueError("--kv-cache-dtype different from --dtype is supported by the cpu and torch backends only")
        if config.deterministic and self.device.type == "cuda":
            machine.check_deterministic_cuda(backend, self.tp_size)
        if self.device.type == "cpu":
            # A first start compiles the kernels side by side, the slowest first
            # (the decode kernel ~25 s, ~50 s with its dot instances).
            sources = (
                native_kernel.SOURCE,
                native_kernel.PREFILL_SOURCE,
                packed_linear.SOURCE,
                fused_ops.SOURCE,
                fused_ops.BF16_SOURCE,
                decoder_stack.SOURCE,
            )
            dot = routes.decode_dot_build_needed(
                config.decode_attention, backend, self.kv_dtype, self.dtype, config.deterministic
            )
            dot_build = [(native_kernel.SOURCE, native_kernel.DOT_FLAGS)] if dot else []
            native_build.prebuild(dot_build + [(source, ()) for source in sources])
        self.attn_backend = get_backend(backend, config.deterministic)
        if self.device.type == "cpu" and (config.num_threads or tp is not None):
            # Ranks on one host share its cores: by default each takes an equal
            # share, since oversubscribed OpenMP threads spin against each other.
            torch.set_num_threads(config.num_threads or max(1, torch.get_num_threads() // self.tp_size))
        self.packed_gemm = machine.use_packed_gemm(config.cpu_gemm, self.device, self.dtype, config.deterministic)
        loaded = load_model(
            config.model,
            self.dtype,
            self.device,
            self.attn_backend,
            tp_rank=tp.rank if tp else 0,
            tp_size=self.tp_size,
            with_tokenizer=tp is None or tp.is_driver,
            packed_gemm=self.packed_gemm,
            gguf_blocks=config.gguf_blocks == "auto",
            bf16_routes=machine.measure_bf16_routes(
                config.cpu_gemm, self.packed_gemm, self.dtype, config.deterministic
            ),
            native_rows=machine.measure_native_rows(config.cpu_gemm, self.packed_gemm, config.deterministic),
            batch_invariant=config.deterministic,
            int8_rows=machine.gguf_int8_rows(
                config.gguf_activations, self.packed_gemm, config.gguf_blocks, config.deterministic
            ),
        )
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        mc = self.model_config
        routes.apply(
            config.prefill_attention,
            config.decode_attention,
            self.attn_backend,
            self.kv_dtype,
            self.dtype,
            self.device.type == "cpu" and machine.cpu_has_fast_bf16(),
            mc.num_attention_heads // self.tp_size,
            mc.num_key_value_heads // self.tp_size,
            mc.head_dim,
        )
        self._log_elementwise_paths()
        if self.packed_gemm:
            self._log_gguf_route()
        cap = self.model_config.max_position_embeddings
        self.max_model_len = min(cap, config.max_model_len) if config.max_model_len else cap
        self.runner: ModelRunner | None = None
        self._sized_for: tuple[int, ...] = ()  # what the KV cache was sized for
        self._info: HandshakeInfo | None = None

    def _log_elementwise_paths(self) -> None:
        """Says at start-up whether the fused ops (norms, rope, gate; the float32
        gate also needs AVX-512) run natively for this model's activations
        (float32, or bfloat16 where not widened) and whether new K/V rows reach
        a bf16 cache through the native write."""
        activations = self.model.compute_dtype
        native = self.device.type == "cpu" and fused_ops.available(torch.empty(0, dtype=activations))
        narrow_kv = self.kv_dtype in (torch.bfloat16, torch.int8)
        kv_native = (
            native
            and self.attn_backend.name == "cpu"
            and narrow_kv
            and fused_ops.available(torch.empty(0, dtype=torch.bfloat16))
        )
        log.info(
            "elementwise_ops",
            activations=str(activations).removeprefix("torch."),
            fused_ops="native" if native else "torch",
            kv_write="native" if kv_native else "torch" if narrow_kv else "n/a",
        )

    def _log_gguf_route(self) -> None:
        """Says at start-up how the weights kept in GGUF blocks multiply their
        activations: float32, or int8 at every row count (and why not where
        --gguf-activations int8 was asked for but cannot run)."""
        packed = [p for layer in self.model.layers for p in layer.packed.values()] + [self.model._head_packed]
        in_blocks = [p for p in packed if p is not None and p.gguf_blocks is not None]
        int8 = [p for p in in_blocks if p.int8_rows]
        asked = self.config.gguf_activations == "int8"
        why_not = (
            ""
            if int8 or not asked
            else "no GGUF blocks"
            if not in_blocks
            else "no AVX512-VNNI"
            if not packed_linear.kernel().int8_native
            else "not Q4_1/Q8_0"
        )
        log.info(
            "gguf_linear_route",
            weights_in_blocks=len(in_blocks),
            activations="int8" if int8 else "float32",
            **({"int8_unavailable": why_not} if why_not else {}),
        )

    @property
    def configured(self) -> bool:
        return self.runner is not None

    def _kv_budget_bytes(self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """This process's KV budget; <= 0 when a GPU has nothing left."""
        if self.device.type == "cpu":
            return int(self.config.kv_cache_gib * GIB)
        # CUDA: what the card has left under the utilisation cap once the
        # largest step the scheduler may send has run (memory_profile.py).
        return cuda_kv_budget(
            self.model,
            block_size,
            self.kv_dtype,
            max_num_batched_tokens,
            max_num_seqs,
            self.max_model_len,
            self.config.gpu_memory_utilization,
            self.tp,
        )

    def _capture_graphs(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """CUDA graphs for steps, where they can replay this runner's forward."""
        why_not = None
        if self.config.enforce_eager:
            why_not = "--enforce-eager"
        elif self.tp is not None:
            why_not = "tensor parallel"
        elif self.attn_backend.name != "triton":
            why_not = f"{self.attn_backend.name} attention plans on the host"
        if why_not:
            log.info("cuda_graphs_off", why=why_not)
            return
        self.runner.capture_graphs(max_num_seqs, max_num_batched_tokens, self.max_model_len)

    def configure(self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> HandshakeInfo:
        """Sizes and allocates KV memory for `block_size`; drops all request state.

        KV memory is either new (zeros) or reused and zeroed (ModelRunner.reset):
        after a handshake nothing computed before it can be read back.
        """
        if self.tp is not None and self.tp.is_driver:
            self.tp.send(("configure", block_size, max_num_batched_tokens, max_num_seqs))
        # On CUDA the size also depends on the largest step the scheduler may send.
        sized_for = (block_size,) if self.device.type == "cpu" else (block_size, max_num_batched_tokens, max_num_seqs)
        if self.runner is not None and sized_for == self._sized_for:
            self.runner.reset()
            return self._info
        self.runner = None  # frees the old KV cache before the new one is sized
        budget = self._kv_budget_bytes(block_size, max_num_batched_tokens, max_num_seqs)
        if self.tp is not None:
            # Block ids are global: every rank holds the same number of blocks, so the tightest rank decides.
            budget = self.tp.min_over_ranks(budget)
        if budget <= 0:
            raise ValueError("no GPU memory left for the KV cache: raise --gpu-memory-utilization")
        cfg, tp_size = self.model_config, self.tp_size
        num_blocks = num_blocks_for_budget(budget, cfg, block_size, self.kv_dtype, tp_size)
        kv_caches = allocate_kv_caches(cfg, num_blocks, block_size, self.kv_dtype, self.device, tp_size)
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            block_size,
            cfg.vocab_size,
            self.device,
            self.attn_backend,
            self.tp,
            sampler_for(self.device, self.config.deterministic),
            decoder_stack=self.config.decoder_stack == "auto",
        )
        if self.device.type == "cuda":
            self._capture_graphs(max_num_seqs, max_num_batched_tokens)
        self._sized_for = sized_for
        self._info = HandshakeInfo(
            model=self.model_config,
            tokenizer=self.tokenizer,
            max_model_len=self.max_model_len,
            num_kv_blocks=num_blocks,
            # All ranks together.
            kv_cache_bytes=num_blocks * bytes_per_block(cfg, block_size, self.kv_dtype, tp_size) * tp_size,
            dtype_name=str(self.dtype).removeprefix("torch."),
            device=self.device.type,
            attention_backend=self.attn_backend.name,
        )
        log.info(
            "kv_cache_allocated",
            num_blocks=num_blocks,
            block_size=block_size,
            gib=round(self._info.kv_cache_bytes / GIB, 3),
        )
        return self._info
