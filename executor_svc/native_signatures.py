"""The one declaration of every function the native kernels export to Python.

Each entry is the C prototype, as the source spells it, of a non-static
function in one of the native sources (keyed by its path under executor_svc/).
native_build.load_library binds every loaded library's functions from this
table (ctypes argtypes and restype), so no call site writes an argument list
by hand; tests/test_native_signatures.py parses the C definitions and fails on
any difference in a name, a parameter's type or name, or a function present on
one side only. A C signature change is then an edit here too, never a silent
memory corruption.

Types: pointers of any kind cross as c_void_p (callers pass data_ptr() or None);
int, int64_t, float and void map to their ctypes; `const` does not matter to ctypes.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

SIGNATURES: dict[str, tuple[str, ...]] = {
    "native/fused_ops.c": (
        "void rms_norm_f32(float *out, int64_t ld_out, float *x, int64_t ld_x, const float *delta, int64_t ld_delta,"
        " const float *w, int rows, int dim, float eps, int num_threads)",
        "int rms_norm_f32_bf16_out(uint16_t *out, int64_t ld_out, float *x, int64_t ld_x, const float *delta,"
        " int64_t ld_delta, const float *w, int rows, int dim, float eps, int num_threads)",
        "void rope_f32(float *x, int64_t ld_tok, int64_t ld_head, const float *cos, const float *sin_signed,"
        " int64_t ld_cs, int tokens, int heads, int dim, int num_threads)",
        "int silu_mul_f32(float *out, int64_t ld_out, const float *gu, int64_t ld_gu, int rows, int inter,"
        " int num_threads)",
        "int argmax_rows_f32(int64_t *out, const float *x, int64_t ld_x, int rows, int cols, int num_threads)",
        "int race_rows_f32(int64_t *out, const float *x, int64_t ld_x, const int64_t *keys, int rows, int cols,"
        " int num_threads)",
        "int logsumexp_rows_f32(float *out, const float *x, int64_t ld_x, int rows, int cols, int num_threads)",
        "int topk_rows_f32(float *values, int64_t ld_v, int64_t *ids, int64_t ld_i, const float *x, int64_t ld_x,"
        " int rows, int cols, int k, int num_threads)",
        "int temper_rows_f32(float *out, int64_t ld_out, const float *x, int64_t ld_x, const float *t, int rows,"
        " int cols, int num_threads)",
        "int seeded_uniform_rows_f32(float *out, int64_t ld_out, const int64_t *keys, const int64_t *vkeys,"
        " int64_t ld_vk, int rows, int cols, int num_threads)",
    ),
    "native/fused_ops_bf16.c": (
        "int rms_norm_bf16(uint16_t *out, int64_t ld_out, uint16_t *x, int64_t ld_x, const uint16_t *delta,"
        " int64_t ld_delta, const uint16_t *w, int rows, int dim, float eps, int num_threads)",
        "int rope_bf16(uint16_t *x, int64_t ld_tok, int64_t ld_head, const uint16_t *cos, const uint16_t *sin_signed,"
        " int64_t ld_cs, int tokens, int heads, int dim, int num_threads)",
        "int silu_mul_bf16(uint16_t *out, int64_t ld_out, const uint16_t *gu, int64_t ld_gu, int rows, int inter,"
        " int num_threads)",
        "int silu_mul_f32_bf16_io(uint16_t *out, int64_t ld_out, const uint16_t *gu, int64_t ld_gu, int rows,"
        " int inter, int num_threads)",
        "int kv_write_bf16(uint16_t *k_cache, uint16_t *v_cache, int64_t num_slots, const void *k,"
        " int64_t ld_k_tok, int64_t ld_k_head, const void *v, int64_t ld_v_tok, int64_t ld_v_head, int src_f32,"
        " const int64_t *slots, int tokens, int heads, int dim)",
        "int kv_write_int8(int8_t *k_cache, int8_t *v_cache, int64_t num_slots, const void *k,"
        " int64_t ld_k_tok, int64_t ld_k_head, const void *v, int64_t ld_v_tok, int64_t ld_v_head, int src_f32,"
        " const int64_t *slots, int tokens, int heads, int dim)",
    ),
    "native/packed_gemm.c": (
        "int packed_gemm_panel_width(void)",
        "int packed_gemm(float *c, int64_t ldc, const float *a, int64_t lda, const float *packed, const float *bias,"
        " int M, int N, int K, int num_threads)",
        "int packed_gemm_quant(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,"
        " const float *bias, int M, int N, int K, int num_threads)",
        "int packed_gemm_bf16_dot_native(void)",
        "int packed_gemm_bf16_dot(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *blocks,"
        " const float *bias, int M, int N, int K, int native, int num_threads)",
        "int packed_gemm_bf16_dot_warm(float *c, int64_t ldc, const uint16_t *a, int64_t lda,"
        " const uint8_t *blocks, const float *bias, int M, int N, int K, int native, int num_threads,"
        " const char *const *spans, int64_t num_spans, int64_t span_bytes)",
        "int packed_gemm_int8_native(void)",
        "int quantize_rows_int8(int8_t *q, float *scale, float *sum, const float *a, int64_t lda, int M, int K)",
        "int packed_gemm_quant_int8(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks,"
        " int fmt, const float *bias, int M, int N, int K, int num_threads)",
        "int packed_gemm_quant_bf16_dot(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks,"
        " int fmt, const float *bias, int M, int N, int K, int native, int num_threads)",
        "int packed_gemm_bf16_dot_swiglu(uint16_t *out, int64_t ldo, const uint16_t *a, int64_t lda,"
        " const uint8_t *blocks, int M, int I, int K, int native, int num_threads, const char *const *spans,"
        " int64_t num_spans, int64_t span_bytes)",
        "int packed_gemm_bf16_dot_argmax(int64_t *out, const uint16_t *a, int64_t lda, const uint8_t *blocks,"
        " const float *bias, int M, int N, int K, int native, int num_threads)",
    ),
    "native/decoder_stack.c": (
        "int64_t decoder_stack_scratch_floats(const ds_model *m, int64_t tokens)",
        "int decoder_stack_forward(const ds_model *m, const ds_layer *layers, const ds_step *s)",
        "int64_t decoder_stack_layout(const char *name)",
    ),
    "attention/native/paged_decode.c": (
        "int paged_decode_dot_built(void)",
        "int paged_decode_dot_native(void)",
        "int paged_decode_attention(void *out, int64_t out_tok_stride, int64_t out_head_stride,"
        " const void *q, int64_t q_tok_stride, int64_t q_head_stride,"
        " const void *k_cache, const void *v_cache, int bf16,"
        " const int32_t *block_tables, int64_t block_table_stride,"
        " const int32_t *seq_lens, const int64_t *tokens, const int64_t *out_rows, const int32_t *seq_index,"
        " int num_decodes, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_seq_len,"
        " float scale, int num_threads)",
    ),
    "attention/native/paged_prefill.c": (
        "int paged_prefill_tokens_per_item(void)",
        "int paged_prefill_dot_built(void)",
        "int paged_prefill_dot_native(void)",
        "int paged_prefill_attention(float *out, int64_t out_tok_stride, int64_t out_head_stride,"
        " const float *q, int64_t q_tok_stride, int64_t q_head_stride,"
        " const void *k_cache, const void *v_cache, int cache_bf16,"
        " const int32_t *block_tables, int64_t block_table_stride,"
        " const int64_t *item_token, const int32_t *item_count, const int32_t *item_pos, const int32_t *item_seq,"
        " int num_items, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int num_threads)",
    ),
}

# Scalar C types that may cross; any pointer is a c_void_p.
_CTYPES = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"^\s*(?P<ret>[\w\s\*]+?)\s*\b(?P<name>\w+)\s*\((?P<params>[^)]*)\)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Signature:
    name: str
    result: str  # a C type, normalised (see `normalise`)
    params: tuple[tuple[str, str], ...]  # (normalised C type, parameter name)


def normalise(c_type: str) -> str:
    """'const float *' -> 'float*': what ctypes and the ABI see."""
    words = [w for w in c_type.replace("*", " * ").split() if w != "const"]
    return "".join(w if w == "*" else (" " + w if i else w) for i, w in enumerate(words)).strip()


def parse(prototype: str) -> Signature:
    """A C prototype ('int f(const float *x, int n)') as a Signature."""
    m = _PROTOTYPE.match(" ".join(prototype.split()))
    assert m, f"not a C prototype: {prototype!r}"
    params = []
    text = m["params"].strip()
    if text != "void":
        for param in text.split(","):
            pm = re.fullmatch(r"\s*(?P<type>[\w\s\*]+?)\s*\b(?P<name>\w+)\s*", param)
            assert pm, f"{m['name']}: cannot read parameter {param!r}"
            params.append((normalise(pm["type"]), pm["name"]))
    return Signature(m["name"], normalise(m["ret"]), tuple(params))


def ctype(c_type: str):
    if c_type.endswith("*"):
        return ctypes.c_void_p
    assert c_type in _CTYPES, f"no ctypes mapping for C type {c_type!r}"
    return _CTYPES[c_type]


def bind(lib: ctypes.CDLL, source: str, names: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Sets argtypes and restype on every function `source` (a SIGNATURES key)
    declares, or on `names` only (an older build, which may lack the newer ones)."""
    for prototype in SIGNATURES[source]:
        sig = parse(prototype)
        if names is not None and sig.name not in names:
            continue
        fn = getattr(lib, sig.name)
        fn.argtypes = [ctype(t) for t, _ in sig.params]
        fn.restype = ctype(sig.result)
    return lib
