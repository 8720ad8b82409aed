"""The executor's configuration: parsed once in `main`, frozen, validated."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cli_config import EnvArgumentParser
from shared.config_fields import above, at_least, check_options, config_from, option, parser_for, rule
from shared.executor_secret import default_secret_dir, installation_secret, read_secret_file
from shared.logging import LOG_LEVELS
from shared.metrics_http import validate_metrics_prefix
from shared.net import is_loopback, validate_address

DTYPES = ("auto", "float32", "bfloat16")
CPU_GEMMS = ("auto", "native", "torch")
GGUF_BLOCKS = ("auto", "off")
GGUF_ACTIVATIONS = ("float", "int8")
OMP_WAIT_POLICIES = ("default", "passive", "active")


@dataclass(frozen=True)
class ExecutorConfig:
    listen: str = option(
        "127.0.0.1:50052",
        help="HOST:PORT or unix:///path to serve the internal Executor API on.",
        check=validate_address,
    )
    model: str | None = option(  # None: the embedded GGUF
        None,
        help="A .gguf file, a local Hugging Face folder (config.json + safetensors) "
        "or a Hugging Face id (org/name: from the Hugging Face cache, downloaded unless HF_HUB_OFFLINE=1). "
        "Default: embedded SmolLM2-135M-Instruct.",
    )
    revision: str | None = option(None, help="With a Hugging Face id: the branch, tag or commit to load.")
    # auto: bfloat16 where the hardware has fast bf16, else float32
    dtype: str = option("auto", choices=DTYPES, help="Weights and KV dtype.")
    device: str = option("auto", choices=("auto", "cpu", "cuda"))  # auto: cuda when available, else cpu
    kv_cache_gib: float = option(2.0, help="KV-cache memory budget in GiB (CPU).", check=above(0))
    kv_cache_dtype: str = option(
        "auto",
        choices=(*DTYPES, "int8"),
        help="KV cache storage dtype (auto = the model's). bfloat16 with float32 weights halves the bytes "
        "decode attention reads, at bf16 rounding of K/V. int8 (cpu and torch attention backends): one byte "
        "a value and a float32 scale per token and KV head, 1.88x the tokens of bfloat16 per GiB at head_dim 64 "
        "and that much less for decode attention to read; keys stored Walsh-Hadamard rotated, so that a few "
        "outlier channels do not set every row's scale. Errors: up to 1/254 of a row's largest |value|.",
    )
    gpu_memory_utilization: float = option(  # weights + activations + KV
        0.9,
        help="Fraction of GPU memory to use (CUDA).",
        check=rule(lambda v: 0 < v <= 1, "must be in (0, 1]"),
    )
    attention_backend: str = option(
        "auto",
        choices=("auto", "cpu", "torch", "triton"),
        help="cpu: native decode kernel + torch prefills; torch: plain PyTorch; triton: CUDA kernels.",
    )
    cpu_gemm: str = option(
        "auto",
        choices=CPU_GEMMS,
        help="Linear layers on CPU: native = weights packed once for the AVX-512 kernel "
        "(float32 arithmetic, also over bfloat16 weights; 1.3-1.5x faster at decode batch sizes); "
        "torch = MKL via F.linear (torch's own bf16 for bfloat16); auto = native where it can run, "
        "prefill chunks too where it measured faster than MKL at start-up, "
        "plus oneDNN's bf16 GEMM from a start-up-measured row count on CPUs with native bf16.",
    )
    gguf_blocks: str = option(
        "auto",
        choices=GGUF_BLOCKS,
        help="With the native GEMM and a GGUF file: auto = batches of up to 32 rows read Q4_1/Q8_0 weights "
        "in their blocks (5/8.5 bits per weight instead of 32; outputs identical to the float32 "
        "packed GEMM's, which off uses from 2 rows, MKL at 1; ~1.6x faster decode at batch 1-2); "
        "with --dtype bfloat16 (widened, float32 arithmetic) the same batches read them instead of the "
        "bf16 weights (the file's exact values, 5/8.5 bits instead of 16; 1.7x faster decode at batch 1, "
        "1.14x at 32 on an AVX-512 Xeon without AVX512-BF16), larger ones the bf16 weights (or oneDNN); "
        "off = float32 (or bfloat16) weights only.",
    )
    gguf_activations: str = option(
        "float",
        choices=GGUF_ACTIVATIONS,
        help="With GGUF blocks (--gguf-blocks auto): int8 = every GEMM over Q4_1/Q8_0 blocks (decode batches "
        "and prefill chunks) quantises its activations to int8 per 32 values (as llama.cpp does) and multiplies "
        "them with integer dot products (AVX512-VNNI; elsewhere float): ~1.4x the throughput, outputs no longer "
        "the float32 path's (quality: docs/optimization_log.md); float = float32 activations. "
        "Not with --deterministic.",
    )
    num_threads: int = option(0, help="torch CPU threads (0 = default).", check=at_least(0))
    enforce_eager: bool = option(
        False,
        help="CUDA: run every step eagerly instead of replaying the CUDA graphs captured at start-up "
        "(decode steps by padded batch size up to the scheduler's max_num_seqs, other steps by padded "
        "token count up to its max_num_batched_tokens or 2,048; executor_svc/cuda_graphs.py). "
        "Slower: a small model's step is bound by kernel launches.",
    )
    # Batch-invariant kernels (docs/determinism.md).
    deterministic: bool = option(
        False,
        help="Batch-invariant kernels: every token's logits, hence greedy and seeded outputs and "
        "logprobs, are bit-identical whatever else is in the batch, however its prefill is "
        "chunked, after preemption or executor recovery, at any --num-threads "
        "(docs/determinism.md). On CPU linear layers never use MKL, and prefill attention runs "
        "the decode kernel's reduction order; on CUDA (one GPU, triton attention) the linears, "
        "LM head, RMSNorm and the sampler's row sums run batch-invariant Triton kernels "
        "(tested in Triton's interpreter; checked on an H200 by bench/gpu_check.py).",
    )
    # Applied before torch loads: executor_svc/__main__.py.
    omp_wait_policy: str = option(
        "default",
        choices=OMP_WAIT_POLICIES,
        help="How idle CPU threads wait between parallel regions: default = the OpenMP runtime's "
        "(libgomp spins ~4 ms, then sleeps: fastest on cores of its own; beside another busy "
        "process its 64-decode steps ran 1.6-3.6x slower than passive's); passive = sleep at "
        "once (for shared cores; slower when the cores are free); active = always spin. "
        "Sets OMP_WAIT_POLICY for this process.",
    )
    prefill_attention: str = option(
        "auto",
        choices=("auto", "native", "sdpa", "dot"),  # cpu_backend.PREFILL_ROUTES
        help="Prefill attention over a bfloat16 KV cache on CPU: native = the FMA kernel (float32 "
        "arithmetic); sdpa = torch's SDPA in bfloat16 (oneDNN's bf16 or AMX GEMMs); dot = the kernel "
        "multiplying raw bf16 pairs with VDPBF16PS (emulated, slower, on CPUs without AVX512-BF16); "
        "auto = native, except for a bfloat16 model on CPUs with AVX512-BF16 or AMX, where the "
        "candidates are timed at the first start and the fastest kept (attention/routes.py). A "
        "float32 cache always takes the float32 kernel.",
    )
    decode_attention: str = option(
        "auto",
        choices=("auto", "widen", "dot"),  # cpu_backend.DECODE_ROUTES
        help="Decode attention over a bfloat16 KV cache on CPU: widen = K/V widened to float32 as read, "
        "float32 FMAs; dot = raw bf16 pairs through VDPBF16PS, queries and probabilities rounded to bf16 "
        "(emulated, slower, on CPUs without AVX512-BF16); auto = widen, except for a bfloat16 model on CPUs "
        "with AVX512-BF16, where both are timed at the first start and the faster kept (attention/routes.py).",
    )
    decoder_stack: str = option(
        "auto",
        choices=("auto", "off"),
        help="auto = on CPU, a decode step's layers (every step's under --deterministic) run in one "
        "native call through the same kernels as the Python layer loop, same results bit for bit "
        "(decoder_stack.py), where every linear takes the packed kernel: SmolLM2's batch-1 decode "
        "steps ~1.8x faster, 1.2-1.3x at 64; off = layer by layer from Python (A/B measurements).",
    )
    max_model_len: int = option(0, help="Cap the context length (0 = model's).", check=at_least(0))
    tensor_parallel_size: int = option(  # see tensor_parallel.py
        1,
        help="Split the model's heads and MLP across this many processes (one device each; "
        "--kv-cache-gib is per process).",
        check=at_least(1),
    )
    log_level: str = option("info", choices=LOG_LEVELS)
    log_json: bool | None = option(None, help="Force JSON logs even on a terminal.")  # None: JSON unless a terminal
    metrics_listen: str = option("", help="HOST:PORT for a Prometheus /metrics endpoint.")
    auth_token_file: str = option(
        "",
        help="File holding the secret the scheduler must present (needed on a public --listen). "
        "Without it, this installation's secret in --secret-dir is used.",
    )
    # The secret the scheduler must present on every call but health: from
    # --auth-token-file, else this flag, else this installation's
    # (shared/executor_secret.py). parse_config always sets it; only a public
    # --listen needs the operator's.
    auth_token: str = option("", help="The secret itself; prefer --auth-token-file.")
    secret_dir: str = option(
        "",
        help="Private directory (0700) of this installation's executor secret, generated on first "
        "start; the scheduler must use the same one. Default: $XDG_STATE_HOME/pagedserve "
        "(~/.local/state/pagedserve).",
    )
    metrics_prefix: str = option(
        "pagedserve", help="Metric name prefix (`vllm` for vLLM's dashboards).", check=validate_metrics_prefix
    )

    def __post_init__(self) -> None:
        check_options(self)
        # The worker refuses what depends on the resolved device (check_deterministic_cuda).
        if self.deterministic and self.attention_backend == "torch":
            raise ValueError("--deterministic: --attention-backend torch (SDPA) orders its sums by the batch shape")
        if self.deterministic and self.cpu_gemm == "torch" and self.device != "cuda":
            raise ValueError("--deterministic on CPU: --cpu-gemm torch (MKL) orders its sums by the batch shape")
        for flag, value in (
            ("--prefill-attention", self.prefill_attention),
            ("--decode-attention", self.decode_attention),
        ):
            if value != "auto" and (self.attention_backend in ("torch", "triton") or self.device == "cuda"):
                raise ValueError(
                    f"{flag} {value} chooses within the cpu attention backend (--attention-backend cpu or auto, on CPU)"
                )
        if self.deterministic and self.prefill_attention in ("sdpa", "dot"):
            raise ValueError(
                f"--deterministic: --prefill-attention {self.prefill_attention} is not the arithmetic "
                "docs/determinism.md pins"
            )
        if self.deterministic and self.decode_attention == "dot":
            raise ValueError("--deterministic: --decode-attention dot is not the arithmetic docs/determinism.md pins")
        if self.deterministic and self.gguf_activations == "int8":
            raise ValueError("--deterministic: --gguf-activations int8 rounds activations by the row count's route")
        if not is_loopback(self.listen) and not self.auth_token:
            raise ValueError(
                f"--listen {self.listen} is reachable from other hosts: set --auth-token-file "
                "(or PAGEDSERVE_AUTH_TOKEN) so only the scheduler can drive this executor"
            )


def build_parser(environ: Mapping[str, str]) -> EnvArgumentParser:
    """Every flag of this service (`pagedserve serve` routes flags by these parsers)."""
    return parser_for(
        ExecutorConfig,
        environ,
        prog="python -m executor_svc",
        description="PagedServe executor: model weights, paged KV cache, forward pass and sampling.",
    )


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ExecutorConfig:
    environ = os.environ if environ is None else environ
    p = build_parser(environ)
    a = p.parse_args(argv)
    try:
        token = read_secret_file(a.auth_token_file) if a.auth_token_file else a.auth_token
    except (OSError, ValueError) as e:
        p.error(f"--auth-token-file {e}")
    try:
        if not token and is_loopback(a.listen):
            # A public address needs a secret the operator hands to a remote scheduler (checked below).
            token = installation_secret(a.secret_dir or default_secret_dir(environ))
    except (OSError, ValueError) as e:
        p.error(str(e))
    return config_from(ExecutorConfig, p, a, auth_token=token)
