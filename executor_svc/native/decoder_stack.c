/* The decoder stack of a decode step in one native call.
 *
 * Why: a decode step of a small model is mostly dispatch. At batch 1 the
 * embedded SmolLM2-135M's 30 layers make ~300 kernel calls from Python
 * (norms, four GEMMs, rope, the K/V write, attention, SiLU*mul a layer), and
 * each cost 15-30 us of Python, ctypes and torch allocation around a few
 * microseconds of work: about 7 ms of a 15 ms step (docs/optimization_log.md).
 * Here one call runs them all, in DecoderLayer.forward's order, through the
 * very kernels the Python path calls (their addresses in `ds_model`), on the
 * same inputs: the outputs are the Python path's bit for bit, which
 * tests/test_decoder_stack.py checks.
 *
 * Scope (decoder_stack.py decides, per step): float32 activations, a float32,
 * bfloat16 or int8 KV cache, every linear on a packed route (GGUF or BF16 blocks:
 * packed_gemm_quant; float32 panels: packed_gemm; the BF16 blocks' dot
 * kernel: packed_gemm_bf16_dot; the Q4_1 blocks' dot kernel:
 * packed_gemm_quant_bf16_dot; int8 activations: packed_gemm_quant_int8),
 * and every query token a
 * decode item of paged_decode_attention (decode-only steps, and every step of
 * --deterministic, whose prefill tokens are decode items too). Anything else
 * runs layer by layer in Python.
 *
 * The structs below are mirrored by ctypes Structures in decoder_stack.py;
 * decoder_stack_layout() reports each struct's size and each field's offset
 * by name, so the mirrors are checked when the library loads.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*gemm_panels_fn)(float *c, int64_t ldc, const float *a, int64_t lda, const float *packed,
                              const float *bias, int M, int N, int K, int num_threads);
typedef int (*gemm_blocks_fn)(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                              const float *bias, int M, int N, int K, int num_threads);
typedef int (*gemm_bf16_dot_fn)(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                                const float *bias, int M, int N, int K, int native, int num_threads,
                                const char *const *spans, int64_t num_spans, int64_t span_bytes);
typedef int (*swiglu_dot_fn)(uint16_t *out, int64_t ldo, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                             int M, int I, int K, int native, int num_threads, const char *const *spans,
                             int64_t num_spans, int64_t span_bytes);
typedef int (*gemm_blocks_dot_fn)(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                                  const float *bias, int M, int N, int K, int native, int num_threads);
typedef void (*rms_norm_fn)(float *out, int64_t ld_out, float *x, int64_t ld_x, const float *delta,
                            int64_t ld_delta, const float *w, int rows, int dim, float eps, int num_threads);
typedef void (*rope_fn)(float *x, int64_t ld_tok, int64_t ld_head, const float *cos, const float *sin_signed,
                        int64_t ld_cs, int tokens, int heads, int dim, int num_threads);
typedef int (*silu_mul_fn)(float *out, int64_t ld_out, const float *gu, int64_t ld_gu, int rows, int inter,
                           int num_threads);
typedef int (*kv_write_fn)(void *k_cache, void *v_cache, int64_t num_slots, const void *k, int64_t ld_k_tok,
                           int64_t ld_k_head, const void *v, int64_t ld_v_tok, int64_t ld_v_head, int src_f32,
                           const int64_t *slots, int tokens, int heads, int dim);
typedef int (*decode_attention_fn)(void *out, int64_t out_tok_stride, int64_t out_head_stride, const void *q,
                                   int64_t q_tok_stride, int64_t q_head_stride, const void *k_cache,
                                   const void *v_cache, int bf16, const int32_t *block_tables,
                                   int64_t block_table_stride, const int32_t *seq_lens, const int64_t *tokens,
                                   const int64_t *out_rows, const int32_t *seq_index, int num_decodes,
                                   int num_heads, int num_kv_heads, int head_dim, int block_size, int max_seq_len,
                                   float scale, int num_threads);

enum { DS_PANELS = 0, DS_BLOCKS = 1, DS_DOT = 2, DS_INT8 = 3, DS_GGUF_DOT = 4 };

typedef struct {
    const void *weights; /* float32 panels (DS_PANELS) or block panels (DS_BLOCKS, DS_INT8, DS_GGUF_DOT; DS_DOT: BF16) */
    const float *bias;   /* or NULL */
    int64_t route;       /* DS_PANELS, DS_BLOCKS, DS_DOT, DS_INT8 or DS_GGUF_DOT */
    int64_t fmt;         /* the block format (DS_BLOCKS, DS_INT8, DS_GGUF_DOT) */
} ds_linear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    void *k_cache, *v_cache;             /* [slots, kv_heads, head_dim], float32 or bfloat16; int8 [.., head_dim + 4] */
    ds_linear qkv, o, gate_up, down;
} ds_layer;

typedef struct {
    gemm_panels_fn gemm_panels;
    gemm_blocks_fn gemm_blocks;
    gemm_bf16_dot_fn gemm_bf16_dot; /* packed_gemm_bf16_dot_warm */
    gemm_blocks_fn gemm_int8; /* packed_gemm_quant_int8: int8 activations over Q4_1/Q8_0 blocks */
    gemm_blocks_dot_fn gemm_gguf_dot; /* packed_gemm_quant_bf16_dot: bf16 activations over Q4_1 blocks */
    swiglu_dot_fn swiglu_dot; /* packed_gemm_bf16_dot_swiglu, or NULL where inter is not whole panels */
    rms_norm_fn rms_norm;
    rope_fn rope;
    silu_mul_fn silu_mul;
    kv_write_fn kv_write; /* kv_write_bf16 or kv_write_int8: needed with a bfloat16 or int8 cache only */
    decode_attention_fn attention;
    const float *final_norm;
    int64_t num_layers, hidden, inter, num_heads, num_kv_heads, head_dim, block_size;
    int64_t kv_narrow;  /* 1: a bfloat16 or int8 cache, written by kv_write; 0: float32, copied */
    int64_t attention_flags; /* paged_decode_attention's `bf16` bits: the cache's, and the decode route's */
    int64_t bf16_dot_native; /* the dot kernels' `native` (VDPBF16PS, else its emulation) */
    int64_t num_slots;  /* blocks x block_size */
    int64_t block_bytes; /* one block of one layer's K (or V) cache */
    int64_t warm_bytes;  /* K bytes a layer's dot GEMMs may warm for the next attention (0: none) */
    double eps, scale;
} ds_model;

typedef struct {
    float *h;             /* [tokens, hidden] the residual stream, updated in place */
    float *out;           /* [tokens, hidden] the final norm's output */
    float *scratch;       /* decoder_stack_scratch_floats(model, tokens) floats */
    const float *cos, *sin_signed; /* [tokens, head_dim] */
    const int64_t *slots;          /* [tokens] each token's K/V slot */
    const int32_t *block_tables;   /* [rows, table_stride] */
    const int32_t *seq_lens;       /* [rows] keys each item attends to */
    const int64_t *tokens;         /* [tokens] query row of item i (= i) */
    const int32_t *seq_index;      /* [tokens] item i's row in block_tables / seq_lens */
    int64_t num_tokens, table_stride, max_seq_len, num_threads;
} ds_step;

/* Scratch floats one step needs, each buffer padded to 16 floats (64 bytes). */
static int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

int64_t decoder_stack_scratch_floats(const ds_model *m, int64_t tokens)
{
    const int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    const int64_t q = m->num_heads * m->head_dim;
    int64_t widest = m->hidden; /* the widest linear input, for its bfloat16 copy */
    if (q > widest)
        widest = q;
    if (m->inter > widest)
        widest = m->inter;
    return pad16(tokens * m->hidden) * 3 + pad16(tokens * qkv) + pad16(tokens * q) + pad16(tokens * 2 * m->inter) +
           pad16(tokens * m->inter) + pad16((tokens * widest + 1) / 2);
}

/* float32 -> bfloat16 bits, as torch's .to(torch.bfloat16) rounds: to
 * nearest, ties to even; a NaN becomes 0x7FC0 (native/bf16.h's rule). */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if (f != f)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Spans of K cache for the dot GEMMs to warm (packed_gemm.c): the blocks
 * the next attention call will read, so that its key reads come from the L3
 * instead of DRAM. Why: 64 decodes at context 256 over a bfloat16 cache took
 * 12.6 ms a step in attention with K/V from DRAM, 5.2 ms with them in L2 and
 * 7.1 ms with them in L3: the kernel's DRAM latency was exposed, chiefly on
 * the scores' key reads, while the GEMMs before it are compute bound and
 * leave the bus idle. Keys only: warming the values as well saved little
 * more attention time and cost the GEMMs twice as much
 * (docs/optimization_log.md, thirty-first session). */
typedef struct {
    const char *const *spans;
    int64_t count;
} warm_spans;

/* xb = x [rows, k] rounded to bfloat16, the dot route's input. Shared out:
 * on one thread this loop left the other spinning in libgomp for ~3% of a
 * 64-decode step (perf, docs/optimization_log.md). */
static void round_rows(uint16_t *xb, const float *x, int rows, int k, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16 && threads > 1)
    for (int r = 0; r < rows; r++)
        for (int64_t i = (int64_t)r * k; i < (int64_t)(r + 1) * k; i++)
            xb[i] = to_bf16(x[i]);
}

/* out = x @ W^T (+ bias) through the route packed_linear.linear takes for
 * these rows; `xb` is room for x rounded to bfloat16 (the dot route's input,
 * as packed_linear._bf16_dot rounds it). The dot route also warms `warm`. */
static int linear(const ds_model *m, const ds_linear *w, float *out, const float *x, uint16_t *xb, int rows, int n,
                  int k, int threads, warm_spans warm)
{
    if (w->route == DS_DOT) {
        round_rows(xb, x, rows, k, threads);
        return m->gemm_bf16_dot(out, n, xb, k, w->weights, w->bias, rows, n, k, (int)m->bf16_dot_native, threads,
                                warm.spans, warm.count, m->block_bytes);
    }
    if (w->route == DS_INT8)
        return m->gemm_int8(out, n, x, k, w->weights, (int)w->fmt, w->bias, rows, n, k, threads);
    if (w->route == DS_GGUF_DOT) /* rounds x to bfloat16 itself, as packed_linear._gguf_dot has it do */
        return m->gemm_gguf_dot(out, n, x, k, w->weights, (int)w->fmt, w->bias, rows, n, k, (int)m->bf16_dot_native,
                                threads);
    if (w->route == DS_BLOCKS)
        return m->gemm_blocks(out, n, x, k, w->weights, (int)w->fmt, w->bias, rows, n, k, threads);
    return m->gemm_panels(out, n, x, k, w->weights, w->bias, rows, n, k, threads);
}

/* K/V rows of every token into a float32 cache, as index_copy_ copies them. */
static void write_kv_f32(float *k_cache, float *v_cache, const float *qkv, int64_t ld_tok, int64_t k_off,
                         int64_t v_off, const int64_t *slots, int tokens, int64_t row)
{
    for (int t = 0; t < tokens; t++) {
        memcpy(k_cache + slots[t] * row, qkv + t * ld_tok + k_off, (size_t)row * sizeof(float));
        memcpy(v_cache + slots[t] * row, qkv + t * ld_tok + v_off, (size_t)row * sizeof(float));
    }
}

/* The blocks of the first m->warm_bytes of K the step's attention reads,
 * into ids: each request's blocks in table order, requests in the
 * order of their first token (the order attention claims its items).
 * Returns how many. */
static int64_t warm_block_ids(const ds_model *m, const ds_step *s, int32_t *ids)
{
    int64_t n = 0, bytes = 0;
    for (int64_t t = 0; t < s->num_tokens && bytes < m->warm_bytes; t++) {
        const int32_t r = s->seq_index[t];
        if (t > 0 && s->seq_index[t - 1] == r)
            continue; /* a request's later tokens (prefill-as-decode) read the same blocks */
        const int64_t blocks = (s->seq_lens[r] + m->block_size - 1) / m->block_size;
        for (int64_t b = 0; b < blocks && b < s->table_stride && bytes < m->warm_bytes; b++) {
            ids[n++] = s->block_tables[r * s->table_stride + b];
            bytes += m->block_bytes;
        }
    }
    return n;
}

/* Layer l's K spans of those blocks. */
static void list_spans(const ds_model *m, const ds_layer *layers, int64_t l, const int32_t *ids, int64_t n,
                       const char **spans)
{
    const char *k = (const char *)layers[l].k_cache;
    for (int64_t i = 0; i < n; i++)
        spans[i] = k + (int64_t)ids[i] * m->block_bytes;
}

/* Runs every layer and the final norm. Returns 0; -2 (nothing run) for a slot
 * outside the cache; -3 if the attention kernel could not allocate; -4 if a
 * GEMM, SiLU*mul or K/V-write kernel refused (no vector path: decoder_stack.py
 * never lets that happen); -5 if the attention kernel has no path for the
 * bf16 dot arithmetic asked for (attention/routes.py never asks then). */
int decoder_stack_forward(const ds_model *m, const ds_layer *layers, const ds_step *s)
{
    const int T = (int)s->num_tokens, H = (int)m->hidden, I = (int)m->inter, D = (int)m->head_dim;
    const int NH = (int)m->num_heads, NKV = (int)m->num_kv_heads, threads = (int)s->num_threads;
    const int QKV = (NH + 2 * NKV) * D, Q = NH * D;
    for (int t = 0; t < T; t++)
        if (s->slots[t] < 0 || s->slots[t] >= m->num_slots)
            return -2;
    float *x = s->scratch, *attn_out = x + pad16((int64_t)T * H), *delta = attn_out + pad16((int64_t)T * H);
    float *qkv = delta + pad16((int64_t)T * H), *attn = qkv + pad16((int64_t)T * QKV);
    float *gate_up = attn + pad16((int64_t)T * Q), *act = gate_up + pad16((int64_t)T * 2 * I);
    uint16_t *xb = (uint16_t *)(act + pad16((int64_t)T * I));
    const float eps = (float)m->eps;
    /* The blocks to warm (the first warm_bytes of the attention's key reads,
     * in the order its items are claimed) and their spans, for the current
     * layer and the next; none if there is no room to list them. */
    int64_t num_ids = 0, max_ids = (int64_t)T * s->table_stride;
    if (m->warm_bytes > 0 && m->block_bytes > 0 && m->warm_bytes / m->block_bytes + 1 < max_ids)
        max_ids = m->warm_bytes / m->block_bytes + 1;
    int32_t *ids = m->warm_bytes > 0 && m->block_bytes > 0 ? malloc(sizeof(int32_t) * (size_t)(max_ids + 1)) : NULL;
    const char **spans = ids ? malloc(sizeof(char *) * (size_t)(2 * max_ids + 2)) : NULL;
    if (spans)
        num_ids = warm_block_ids(m, s, ids);
    const char **cur = spans, **nxt = spans ? spans + num_ids : NULL;
    if (spans)
        list_spans(m, layers, 0, ids, num_ids, cur);
    /* Each layer's dot GEMMs warm the next attention's spans in proportion
     * to their work: O, gate/up and down the next layer's first shares,
     * the next layer's QKV the last (layer 0's QKV: its own, no earlier GEMM). */
    const int64_t w_o = (int64_t)H * Q, w_gu = (int64_t)2 * I * H, w_down = (int64_t)H * I, w_qkv = (int64_t)QKV * H;
    const int64_t w_all = w_o + w_gu + w_down + w_qkv, n_sp = num_ids;
    const int64_t cut_o = n_sp * w_o / w_all, cut_gu = n_sp * (w_o + w_gu) / w_all,
                  cut_down = n_sp * (w_o + w_gu + w_down) / w_all;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const ds_layer *L = layers + l;
        /* DecoderLayer.forward: layer 0 has no previous delta to add. */
        m->rms_norm(x, H, s->h, H, l ? delta : NULL, l ? H : 0, L->input_norm, T, H, eps, threads);
        const warm_spans own = {cur ? cur + cut_down : NULL, cur ? n_sp - cut_down : 0};
        if (linear(m, &L->qkv, qkv, x, xb, T, QKV, H, threads, own))
            goto refused;
        m->rope(qkv, QKV, D, s->cos, s->sin_signed, D, T, NH + NKV, D, threads);
        if (m->kv_narrow) {
            if (m->kv_write(L->k_cache, L->v_cache, m->num_slots, qkv + Q, QKV, D, qkv + Q + NKV * D, QKV, D,
                                 1, s->slots, T, NKV, D))
                goto refused; /* slots were checked above: only a build without AVX-512 refuses */
        } else {
            write_kv_f32(L->k_cache, L->v_cache, qkv, QKV, Q, Q + NKV * D, s->slots, T, (int64_t)NKV * D);
        }
        const int attended = m->attention(attn, Q, D, qkv, QKV, D, L->k_cache, L->v_cache, (int)m->attention_flags,
                                          s->block_tables, s->table_stride, s->seq_lens, s->tokens, s->tokens,
                                          s->seq_index, T, NH, NKV, D, (int)m->block_size, (int)s->max_seq_len,
                                          (float)m->scale, threads);
        if (attended) {
            free(ids);
            free(spans);
            return attended == -2 ? -5 : -3;
        }
        const int next = cur && l + 1 < m->num_layers;
        if (next)
            list_spans(m, layers, l + 1, ids, num_ids, nxt);
        const warm_spans o = {next ? nxt : NULL, next ? cut_o : 0};
        const warm_spans gu = {next ? nxt + cut_o : NULL, next ? cut_gu - cut_o : 0};
        const warm_spans down = {next ? nxt + cut_gu : NULL, next ? cut_down - cut_gu : 0};
        if (linear(m, &L->o, attn_out, attn, xb, T, H, Q, threads, o))
            goto refused;
        m->rms_norm(x, H, s->h, H, attn_out, H, L->post_norm, T, H, eps, threads);
        /* Both MLP GEMMs on the dot route: SwiGLU on the gate/up GEMM's tiles,
         * its bfloat16 rows the down GEMM's input, as layer_ops.mlp runs them
         * (the three ops' numbers; -1: no such pass in this build, run the three). */
        int fused = 0;
        if (m->swiglu_dot && L->gate_up.route == DS_DOT && L->down.route == DS_DOT && !L->gate_up.bias) {
            uint16_t *act_bf16 = (uint16_t *)act;
            round_rows(xb, x, T, H, threads);
            const int status = m->swiglu_dot(act_bf16, I, xb, H, L->gate_up.weights, T, I, H,
                                             (int)m->bf16_dot_native, threads, gu.spans, gu.count, m->block_bytes);
            if (status != 0 && status != -1)
                goto refused;
            if ((fused = status == 0) &&
                m->gemm_bf16_dot(delta, H, act_bf16, I, L->down.weights, L->down.bias, T, H, I,
                                 (int)m->bf16_dot_native, threads, down.spans, down.count, m->block_bytes))
                goto refused;
        }
        if (!fused) {
            if (linear(m, &L->gate_up, gate_up, x, xb, T, 2 * I, H, threads, gu))
                goto refused;
            if (m->silu_mul(act, I, gate_up, 2 * I, T, I, threads))
                goto refused;
            if (linear(m, &L->down, delta, act, xb, T, H, I, threads, down))
                goto refused;
        }
        if (next) {
            const char **swap = cur;
            cur = nxt;
            nxt = swap;
        }
    }
    free(ids);
    free(spans);
    m->rms_norm(s->out, H, s->h, H, m->num_layers ? delta : NULL, m->num_layers ? H : 0, m->final_norm, T, H,
                eps, threads);
    return 0;
refused:
    free(ids);
    free(spans);
    return -4;
}

/* The structs' layout by name, for decoder_stack.py to check its mirrors. */
#define SIZE(s) {#s, sizeof(s)}
#define FIELD(s, f) {#s "." #f, offsetof(s, f)}
static const struct {
    const char *name;
    int64_t value;
} LAYOUT[] = {
    SIZE(ds_linear), FIELD(ds_linear, weights), FIELD(ds_linear, bias), FIELD(ds_linear, route),
    FIELD(ds_linear, fmt),
    SIZE(ds_layer), FIELD(ds_layer, input_norm), FIELD(ds_layer, post_norm), FIELD(ds_layer, k_cache),
    FIELD(ds_layer, v_cache), FIELD(ds_layer, qkv), FIELD(ds_layer, o), FIELD(ds_layer, gate_up),
    FIELD(ds_layer, down),
    SIZE(ds_model), FIELD(ds_model, gemm_panels), FIELD(ds_model, gemm_blocks), FIELD(ds_model, gemm_bf16_dot), FIELD(ds_model, gemm_int8),
    FIELD(ds_model, gemm_gguf_dot), FIELD(ds_model, swiglu_dot),
    FIELD(ds_model, rms_norm),
    FIELD(ds_model, rope), FIELD(ds_model, silu_mul), FIELD(ds_model, kv_write), FIELD(ds_model, attention),
    FIELD(ds_model, final_norm), FIELD(ds_model, num_layers), FIELD(ds_model, hidden), FIELD(ds_model, inter),
    FIELD(ds_model, num_heads), FIELD(ds_model, num_kv_heads), FIELD(ds_model, head_dim),
    FIELD(ds_model, block_size), FIELD(ds_model, kv_narrow), FIELD(ds_model, attention_flags), FIELD(ds_model, bf16_dot_native), FIELD(ds_model, num_slots), FIELD(ds_model, block_bytes),
    FIELD(ds_model, warm_bytes), FIELD(ds_model, eps),
    FIELD(ds_model, scale),
    SIZE(ds_step), FIELD(ds_step, h), FIELD(ds_step, out), FIELD(ds_step, scratch), FIELD(ds_step, cos),
    FIELD(ds_step, sin_signed), FIELD(ds_step, slots), FIELD(ds_step, block_tables), FIELD(ds_step, seq_lens),
    FIELD(ds_step, tokens), FIELD(ds_step, seq_index), FIELD(ds_step, num_tokens), FIELD(ds_step, table_stride),
    FIELD(ds_step, max_seq_len), FIELD(ds_step, num_threads),
};

/* The offset of "struct.field" or the size of "struct"; -1 for a name it
 * does not know; with NULL, how many names it knows. */
int64_t decoder_stack_layout(const char *name)
{
    const int n = (int)(sizeof(LAYOUT) / sizeof(LAYOUT[0]));
    if (!name)
        return n;
    for (int i = 0; i < n; i++)
        if (!strcmp(LAYOUT[i].name, name))
            return LAYOUT[i].value;
    return -1;
}
