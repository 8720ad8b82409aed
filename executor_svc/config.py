"""The executor's configuration: parsed once in `main`, frozen, validated."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cli_config import EnvArgumentParser
from shared.executor_secret import default_secret_dir, installation_secret, read_secret_file
from shared.metrics_http import validate_metrics_prefix
from shared.net import is_loopback, validate_address

DTYPES = ("auto", "float32", "bfloat16")
CPU_GEMMS = ("auto", "native", "torch")
GGUF_BLOCKS = ("auto", "off")
OMP_WAIT_POLICIES = ("default", "passive", "active")


@dataclass(frozen=True)
class ExecutorConfig:
    listen: str = "127.0.0.1:50052"
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF; else a path or a Hugging Face id
    revision: str | None = None  # Hugging Face ids: a branch, tag or commit (None: the default branch)
    dtype: str = "auto"  # auto: bfloat16 where the hardware has fast bf16, else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    kv_cache_gib: float = 2.0  # KV budget on CPU
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; bfloat16 halves KV bytes for float32 models
    gpu_memory_utilization: float = 0.9  # fraction of the card for weights+activations+KV
    attention_backend: str = "auto"  # auto: triton on cuda, cpu (native decode kernel) on cpu
    cpu_gemm: str = (
        "auto"  # auto: the native packed GEMM on AVX-512 CPUs (+ oneDNN bf16 where native bf16), else torch's
    )
    gguf_blocks: str = "auto"  # auto: that GEMM also reads Q4_1/Q8_0 GGUF weights in their blocks (small batches; float32 or widened bf16)
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default
    # Batch-invariant kernels: a token's logits do not depend on the rest of the
    # batch, on prefill chunking or on the thread count (docs/determinism.md).
    deterministic: bool = False
    # How idle OpenMP threads wait between parallel regions: default = the
    # runtime's (libgomp: spin ~4 ms, then sleep), passive = sleep at once (for
    # cores shared with other busy processes), active = spin. Applied before
    # torch loads: executor_svc/__main__.py.
    omp_wait_policy: str = "default"
    max_model_len: int = 0  # 0 = the model's own limit
    tensor_parallel_size: int = 1  # processes (devices) one model is split across; see tensor_parallel.py
    log_level: str = "info"
    log_json: bool | None = None  # None: JSON unless stderr is a terminal
    metrics_listen: str = ""  # HOST:PORT for Prometheus /metrics; "" = off
    metrics_prefix: str = "pagedserve"  # metric names' namespace; "vllm" for vLLM's dashboards
    auth_token_file: str = ""  # the operator's secret file; "" = this installation's secret (secret_dir)
    # The secret the scheduler must present on every call but health: from
    # --auth-token[-file], else this installation's (shared/executor_secret.py).
    # parse_config always sets it; only a public --listen needs the operator's.
    auth_token: str = ""
    secret_dir: str = ""  # where this installation's secret lives; "" = $XDG_STATE_HOME/pagedserve

    def __post_init__(self) -> None:
        validate_address(self.listen)
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: expected auto, cpu or cuda")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"--attention-backend {self.attention_backend!r}: expected auto, cpu, torch or triton")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"--cpu-gemm {self.cpu_gemm!r}: expected one of {', '.join(CPU_GEMMS)}")
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ValueError(
                f"--omp-wait-policy {self.omp_wait_policy!r}: expected one of {', '.join(OMP_WAIT_POLICIES)}"
            )
        if self.deterministic and (self.cpu_gemm == "torch" or self.attention_backend == "torch"):
            raise ValueError(
                "--deterministic needs the native CPU kernels: drop --cpu-gemm torch and "
                "--attention-backend torch (MKL's and SDPA's sums are ordered by the batch shape)"
            )
        if self.gguf_blocks not in GGUF_BLOCKS:
            raise ValueError(f"--gguf-blocks {self.gguf_blocks!r}: expected one of {', '.join(GGUF_BLOCKS)}")
        if not self.kv_cache_gib > 0:
            raise ValueError(f"--kv-cache-gib must be > 0, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_threads < 0 or self.max_model_len < 0:
            raise ValueError("--num-threads and --max-model-len must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        validate_metrics_prefix(self.metrics_prefix)
        if not is_loopback(self.listen) and not self.auth_token:
            raise ValueError(
                f"--listen {self.listen} is reachable from other hosts: set --auth-token-file "
                "(or PAGEDSERVE_AUTH_TOKEN) so only the scheduler can drive this executor"
            )


def build_parser(environ: Mapping[str, str]) -> EnvArgumentParser:
    """Every flag of this service (`pagedserve serve` routes flags by these parsers)."""
    p = EnvArgumentParser(
        prog="python -m executor_svc",
        description="PagedServe executor: model weights, paged KV cache, forward pass and sampling.",
        environ=environ,
    )
    d = ExecutorConfig
    p.add_argument(
        "--listen", default=d.listen, help="HOST:PORT or unix:///path to serve the internal Executor API on."
    )
    p.add_argument(
        "--model",
        default=d.model,
        help="A .gguf file, a local Hugging Face folder (config.json + safetensors) "
        "or a Hugging Face id (org/name: from the Hugging Face cache, downloaded unless HF_HUB_OFFLINE=1). "
        "Default: embedded SmolLM2-135M-Instruct.",
    )
    p.add_argument("--revision", default=d.revision, help="With a Hugging Face id: the branch, tag or commit to load.")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="Weights and KV dtype.")
    p.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=DTYPES,
        help="KV cache storage dtype (auto = the model's). bfloat16 with float32 weights halves the bytes "
        "decode attention reads, at bf16 rounding of K/V.",
    )
    p.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib, help="KV-cache memory budget in GiB (CPU).")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="Fraction of GPU memory to use (CUDA).",
    )
    p.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=("auto", "cpu", "torch", "triton"),
        help="cpu: native decode kernel + torch prefills; torch: plain PyTorch; triton: CUDA kernels.",
    )
    p.add_argument(
        "--cpu-gemm",
        default=d.cpu_gemm,
        choices=CPU_GEMMS,
        help="Linear layers on CPU: native = weights packed once for the AVX-512 kernel "
        "(float32 arithmetic, also over bfloat16 weights; 1.3-1.5x faster at decode batch sizes); "
        "torch = MKL via F.linear (torch's own bf16 for bfloat16); auto = native where it can run, "
        "plus oneDNN's bf16 GEMM from a start-up-measured row count on CPUs with native bf16.",
    )
    p.add_argument(
        "--gguf-blocks",
        default=d.gguf_blocks,
        choices=GGUF_BLOCKS,
        help="With the native GEMM and a GGUF file: auto = batches of up to 32 rows read Q4_1/Q8_0 weights "
        "in their blocks (5/8.5 bits per weight instead of 32; outputs identical to the float32 "
        "packed GEMM's, which off uses from 2 rows, MKL at 1; ~1.6x faster decode at batch 1-2); "
        "with --dtype bfloat16 (widened, float32 arithmetic) the same batches read them instead of the "
        "bf16 weights (the file's exact values, 5/8.5 bits instead of 16; 1.7x faster decode at batch 1, "
        "1.14x at 32 on an AVX-512 Xeon without AVX512-BF16), larger ones the bf16 weights (or oneDNN); "
        "off = float32 (or bfloat16) weights only.",
    )
    p.add_argument("--num-threads", type=int, default=d.num_threads, help="torch CPU threads (0 = default).")
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=d.deterministic,
        help="Batch-invariant CPU kernels: every token's logits, hence greedy and seeded outputs and "
        "logprobs, are bit-identical whatever else is in the batch, however its prefill is "
        "chunked, after preemption or executor recovery, at any --num-threads "
        "(docs/determinism.md). On CPU linear layers never use MKL, and prefill attention runs "
        "the decode kernel's reduction order; on CUDA (one GPU, triton attention) the linears, "
        "LM head, RMSNorm and the sampler's row sums run batch-invariant Triton kernels "
        "(tested in Triton's interpreter, not yet on GPU hardware).",
    )
    p.add_argument(
        "--omp-wait-policy",
        default=d.omp_wait_policy,
        choices=OMP_WAIT_POLICIES,
        help="How idle CPU threads wait between parallel regions: default = the OpenMP runtime's "
        "(libgomp spins ~4 ms, then sleeps: fastest on cores of its own; beside another busy "
        "process its 64-decode steps ran 1.6-3.6x slower than passive's); passive = sleep at "
        "once (for shared cores; slower when the cores are free); active = always spin. "
        "Sets OMP_WAIT_POLICY for this process.",
    )
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="Cap the context length (0 = model's).")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="Split the model's heads and MLP across this many processes (one device each; "
        "--kv-cache-gib is per process).",
    )
    p.add_argument("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-json", action="store_true", default=False, help="Force JSON logs even on a terminal.")
    p.add_argument("--metrics-listen", default=d.metrics_listen, help="HOST:PORT for a Prometheus /metrics endpoint.")
    p.add_argument(
        "--auth-token-file",
        default=d.auth_token_file,
        help="File holding the secret the scheduler must present (needed on a public --listen). "
        "Without it, this installation's secret in --secret-dir is used.",
    )
    p.add_argument("--auth-token", default="", help="The secret itself; prefer --auth-token-file.")
    p.add_argument(
        "--secret-dir",
        default=d.secret_dir,
        help="Private directory (0700) of this installation's executor secret, generated on first "
        "start; the scheduler must use the same one. Default: $XDG_STATE_HOME/pagedserve "
        "(~/.local/state/pagedserve).",
    )
    p.add_argument(
        "--metrics-prefix", default=d.metrics_prefix, help="Metric name prefix (`vllm` for vLLM's dashboards)."
    )
    return p


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ExecutorConfig:
    environ = os.environ if environ is None else environ
    p = build_parser(environ)
    a = p.parse_args(argv)
    try:
        token = read_secret_file(a.auth_token_file) if a.auth_token_file else a.auth_token
        if not token and is_loopback(a.listen):
            # A public address needs a secret the operator hands to a remote scheduler (checked below).
            token = installation_secret(a.secret_dir or default_secret_dir(environ))
    except (OSError, ValueError) as e:
        p.error(str(e))
    try:
        return ExecutorConfig(
            listen=a.listen,
            model=a.model or None,
            revision=a.revision or None,
            dtype=a.dtype,
            device=a.device,
            kv_cache_gib=a.kv_cache_gib,
            kv_cache_dtype=a.kv_cache_dtype,
            gpu_memory_utilization=a.gpu_memory_utilization,
            attention_backend=a.attention_backend,
            cpu_gemm=a.cpu_gemm,
            gguf_blocks=a.gguf_blocks,
            num_threads=a.num_threads,
            deterministic=a.deterministic,
            omp_wait_policy=a.omp_wait_policy,
            max_model_len=a.max_model_len,
            tensor_parallel_size=a.tensor_parallel_size,
            log_level=a.log_level,
            log_json=True if a.log_json else None,
            metrics_listen=a.metrics_listen,
            metrics_prefix=a.metrics_prefix,
            auth_token_file=a.auth_token_file,
            auth_token=token,
            secret_dir=a.secret_dir,
        )
    except ValueError as e:
        p.error(str(e))
