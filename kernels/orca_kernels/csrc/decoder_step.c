/* A decode step of a model's layers on CPU in one call: the shared decoder's (Llama-style,
 * orca_backend/model/decoder.py; per layer the residual add + RMSNorm, the q/k/v GEMM, rotary, the
 * K/V write, attention, the o GEMM, the residual add + RMSNorm, the gate/up GEMM, SiLU-and-multiply
 * and the down GEMM) and GPT-2's (model/gpt2.py; LayerNorms, no rotary, bias + GeLU), float32 and
 * bfloat16.
 * The Python side is cpu_decoder_step.py.
 *
 * Why: at a few tokens each of these ops is a ctypes call wrapped in a few microseconds of Python
 * (argument checks, output tensors, the call itself), ~100 of them a step: ~2 ms of a ~9 ms batch-1
 * step of a 150M-parameter model. Here the same kernels run in the same order on the same inputs,
 * so the step's outputs are the per-op path's bit for bit; only the Python between them is gone.
 *
 * The kernels are this library's own copies of llama_ops.c, gpt2_ops.c, decode_gemm.c and decode_attention.c
 * (native.py compiles them into it), called through their entry points as their Python wrappers
 * call them. Every request of the step has at most `max_short` queries (the decode kernel's; the
 * caller checks), and every linear layer is one the C GEMM multiplies at this many tokens. */
#include <stdint.h>
#include <string.h>

/* The entry points called here (their own files document them). */
void orca_add_rmsnorm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                          const float *weight, float *out, float *summed, int64_t rows, int64_t hidden, float eps,
                          int64_t lanes, int num_threads);
void orca_add_rmsnorm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t res_stride,
                           const uint16_t *weight, uint16_t *out, uint16_t *summed, int64_t rows, int64_t hidden,
                           float eps, int64_t lanes, int num_threads, float *scratch);
#define ROTARY_ARGS(T)                                                                                       \
    const T *q, int64_t q_tok_stride, int64_t q_head_stride, const T *k, int64_t k_tok_stride,                \
        int64_t k_head_stride, const int64_t *positions, const float *cos_sin, int64_t cs_stride,             \
        int64_t max_positions, T *q_out, T *k_out, int64_t tokens, int64_t q_heads, int64_t k_heads,          \
        int64_t head_dim, int num_threads
int64_t orca_rotary_f32(ROTARY_ARGS(float));
int64_t orca_rotary_bf16(ROTARY_ARGS(uint16_t));
void orca_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t inner, int64_t lanes,
                           int num_threads);
void orca_silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t inner,
                            int64_t lanes, int num_threads);
void orca_add_layernorm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                            const float *weight, const float *bias, float *out, float *summed, int64_t rows,
                            int64_t hidden, float eps, int64_t lanes, int num_threads);
void orca_add_layernorm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t res_stride,
                             const uint16_t *weight, const uint16_t *bias, uint16_t *out, uint16_t *summed,
                             int64_t rows, int64_t hidden, float eps, int64_t lanes, int num_threads, float *scratch);
void orca_bias_gelu_f32(const float *x, int64_t x_stride, const float *bias, float *out, int64_t rows, int64_t inner,
                        int num_threads);
void orca_bias_gelu_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *bias, uint16_t *out, int64_t rows,
                         int64_t inner, int num_threads);
void orca_write_kv(const char *k, int64_t k_row_stride, const char *v, int64_t v_row_stride, char *k_cache,
                   char *v_cache, const int64_t *slots, int64_t tokens, int64_t row_bytes);
#define ATTENTION_ARGS(T)                                                                                    \
    const T *q, int64_t q_row_stride, int64_t q_head_stride, const T *k_cache, const T *v_cache, T *out,      \
        const int32_t *query_start, const int32_t *context_lens, const int32_t *block_tables,                 \
        int64_t block_table_stride, int64_t block_size, int64_t num_requests, int64_t q_heads,                \
        int64_t kv_heads, int64_t head_dim, int64_t max_context, float scale, int64_t window, float softcap,   \
        const float *k_lut, const float *v_lut, float *scratch, int num_threads, int64_t max_short
void orca_decode_attention_f32(ATTENTION_ARGS(float));
void orca_decode_attention_bf16(ATTENTION_ARGS(uint16_t));
void orca_decode_linear_f32(const float *x, int64_t x_stride, int64_t M, const float *W, int64_t N, int64_t K,
                            const float *bias, float *y, int num_threads, int isa);
void orca_decode_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint16_t *W, int64_t N,
                             int64_t K, const uint16_t *bias, uint16_t *y, int num_threads, int isa);
void orca_packed_linear_f32(const float *x, int64_t xs, int64_t M, const float *P, int64_t N, int64_t K,
                            int64_t Kp, const float *bias, float *y, int num_threads, int isa);
void orca_packed_linear_bf16(const uint16_t *x, int64_t xs, int64_t M, const uint16_t *P, int64_t N, int64_t K,
                             int64_t Kp, const uint16_t *bias, uint16_t *y, int num_threads, int isa);

/* The structures below are mirrored field for field by ctypes in cpu_decoder_step.py. */

/* A linear layer as the C GEMM reads it: oneDNN's packed buffer (its panel tiles, `padded_in` set)
 * or the plain weight [out, in]; the bias (NULL: none). */
enum { LINEAR_PANELS = 1, LINEAR_ROWS = 2 };
typedef struct {
    int64_t kind;
    const void *weight;
    int64_t out_features, in_features, padded_in;
    const void *bias;
} step_linear;

/* One layer: its norms' weights, linear layers, K/V pools [slots, kv_heads, head_dim] (of the
 * model's dtype), rope table (float32 [max_positions, head_dim] at cos_sin_stride floats a row),
 * sliding window (0: none) and the K/V group whose batch layout it attends with. */
typedef struct {
    const void *input_norm, *mlp_norm;
    step_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    const float *cos_sin;
    int64_t cos_sin_stride, max_positions, window, group;
} step_layer;

/* The model: sizes, the norms' eps, the attention's scale and soft-cap (0: none), the vector widths
 * torch's RMSNorm sum and SiLU loop run in here, the GEMM's instruction set and the layers. */
typedef struct {
    int64_t num_layers, hidden, q_heads, kv_heads, head_dim, intermediate;
    double eps, scale, softcap;
    int64_t norm_lanes, silu_lanes, isa, max_short;
    const step_layer *layers;
} step_model;

/* One K/V group's batch layout this step (AttentionMetadata's tensors and sizes). */
typedef struct {
    const int32_t *query_start, *context_lens, *block_tables;
    const int64_t *slot_mapping;
    int64_t block_table_stride, block_size, num_requests, max_context;
} step_batch;

/* Elements of the model's dtype a step of `tokens` tokens works in: the norm's output, q/k/v, the
 * rotated q and k, attention's output, gate/up and the activation. */
int64_t orca_decoder_step_work(const step_model *m, int64_t tokens) {
    const int64_t d = m->head_dim, qkv = (m->q_heads + 2 * m->kv_heads) * d;
    return tokens * (m->hidden + qkv + 2 * m->q_heads * d + m->kv_heads * d + 3 * m->intermediate);
}

/* float32 scratch of the kernels: the bfloat16 norm's widened row per thread, then attention's per
 * thread (cpu_attention.attention_cpu sizes it the same way). */
int64_t orca_decoder_step_scratch(const step_model *m, int64_t max_context, int64_t bf16, int num_threads) {
    const int64_t attention = m->q_heads * (max_context + (bf16 ? 2 * m->head_dim : 0));
    return (int64_t)num_threads * ((bf16 ? m->hidden : 0) + attention);
}

#define NORM_f32(x, residual, weight, out, summed)                                                           \
    orca_add_rmsnorm_f32(x, H, residual, H, weight, out, summed, tokens, H, eps, m->norm_lanes, num_threads)
#define NORM_bf16(x, residual, weight, out, summed)                                                          \
    orca_add_rmsnorm_bf16(x, H, residual, H, weight, out, summed, tokens, H, eps, m->norm_lanes, num_threads,   \
                          scratch)

/* Runs the layers on x_in [tokens, hidden] (the embedding's output, not modified): on return x holds
 * the last layer's output and residual the residual stream (both [tokens, hidden]), as the per-op
 * path leaves its `x` and `residual`. `work` holds orca_decoder_step_work elements, `scratch`
 * orca_decoder_step_scratch floats for the largest max_context of `batches` (one per K/V group).
 * Returns -1, or the first token whose position lies outside a layer's rope table (nothing is
 * written from that layer on; the caller raises). */
#define DEFINE_DECODER_STEP(NAME, T, SUFFIX)                                                                 \
    static void linear_##SUFFIX(const step_linear *l, const T *x, int64_t tokens, T *y, int num_threads, int isa) { \
        if (l->kind == LINEAR_PANELS)                                                                        \
            orca_packed_linear_##SUFFIX(x, l->in_features, tokens, l->weight, l->out_features, l->in_features, \
                                        l->padded_in, l->bias, y, num_threads, isa);                         \
        else                                                                                                 \
            orca_decode_linear_##SUFFIX(x, l->in_features, tokens, l->weight, l->out_features, l->in_features, \
                                        l->bias, y, num_threads, isa);                                       \
    }                                                                                                        \
    int64_t NAME(const step_model *m, const step_batch *batches, int64_t tokens, const int64_t *positions,     \
                 const T *x_in, T *x, T *residual, T *work, float *scratch, int num_threads) {                \
        const int64_t H = m->hidden, d = m->head_dim, hq = m->q_heads, hkv = m->kv_heads;                    \
        const int64_t I = m->intermediate, qkv_row = (hq + 2 * hkv) * d;                                     \
        const float eps = (float)m->eps;                                                                     \
        const int isa = (int)m->isa;                                                                         \
        T *h = work, *qkv = h + tokens * H, *q_rot = qkv + tokens * qkv_row, *k_rot = q_rot + tokens * hq * d;  \
        T *attn = k_rot + tokens * hkv * d, *gate_up = attn + tokens * hq * d, *act = gate_up + tokens * 2 * I; \
        float *attn_scratch = scratch + (sizeof(T) == 2 ? (int64_t)num_threads * H : 0);                    \
        /* the first norm has no residual to add: the stream starts as x itself */                          \
        memcpy(residual, x_in, (size_t)(tokens * H) * sizeof(T));                                            \
        for (int64_t i = 0; i < m->num_layers; i++) {                                                        \
            const step_layer *L = m->layers + i;                                                             \
            const step_batch *b = batches + L->group;                                                        \
            if (i == 0)                                                                                      \
                NORM_##SUFFIX(x_in, NULL, L->input_norm, h, NULL);                                           \
            else /* the sum is written over the residual it reads, element by element */                    \
                NORM_##SUFFIX(x, residual, L->input_norm, h, residual);                                      \
            linear_##SUFFIX(&L->qkv, h, tokens, qkv, num_threads, isa);                                      \
            const int64_t bad = orca_rotary_##SUFFIX(qkv, qkv_row, d, qkv + hq * d, qkv_row, d, positions,   \
                                                     L->cos_sin, L->cos_sin_stride, L->max_positions, q_rot, \
                                                     k_rot, tokens, hq, hkv, d, num_threads);                \
            if (bad >= 0) return bad;                                                                        \
            orca_write_kv((const char *)k_rot, hkv * d * (int64_t)sizeof(T),                                 \
                          (const char *)(qkv + (hq + hkv) * d), qkv_row * (int64_t)sizeof(T), L->k_cache,    \
                          L->v_cache, b->slot_mapping, tokens, hkv * d * (int64_t)sizeof(T));                \
            orca_decode_attention_##SUFFIX(q_rot, hq * d, d, L->k_cache, L->v_cache, attn, b->query_start,   \
                                           b->context_lens, b->block_tables, b->block_table_stride,          \
                                           b->block_size, b->num_requests, hq, hkv, d, b->max_context,       \
                                           (float)m->scale, L->window, (float)m->softcap, NULL, NULL,        \
                                           attn_scratch, num_threads, m->max_short);                         \
            linear_##SUFFIX(&L->o, attn, tokens, x, num_threads, isa);                                       \
            NORM_##SUFFIX(x, residual, L->mlp_norm, h, residual);                                            \
            linear_##SUFFIX(&L->gate_up, h, tokens, gate_up, num_threads, isa);                              \
            orca_silu_and_mul_##SUFFIX(gate_up, 2 * I, act, tokens, I, m->silu_lanes, num_threads);          \
            linear_##SUFFIX(&L->down, act, tokens, x, num_threads, isa);                                     \
        }                                                                                                    \
        return -1;                                                                                           \
    }
DEFINE_DECODER_STEP(orca_decoder_step_f32, float, f32)
DEFINE_DECODER_STEP(orca_decoder_step_bf16, uint16_t, bf16)

/* GPT-2: a layer's LayerNorms (weight, bias), its linear layers (fc without its bias, which the
 * GeLU adds, as linear_bias_gelu does on CPU) and K/V pools; one K/V group. */
typedef struct {
    const void *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    step_linear qkv, o, fc, proj;
    const void *fc_bias;
    void *k_cache, *v_cache;
} gpt2_layer;

typedef struct {
    int64_t num_layers, hidden, heads, head_dim, inner;
    double eps, scale;
    int64_t norm_lanes, isa, max_short;
    const gpt2_layer *layers;
} gpt2_model;

/* Elements of the model's dtype a step works in: the norm's output, q/k/v, attention's output, fc
 * and the GeLU's output. */
int64_t orca_gpt2_step_work(const gpt2_model *m, int64_t tokens) {
    return tokens * (5 * m->hidden + 2 * m->inner);
}

/* float32 scratch: the bfloat16 norm's widened row per thread, then attention's per thread. */
int64_t orca_gpt2_step_scratch(const gpt2_model *m, int64_t max_context, int64_t bf16, int num_threads) {
    const int64_t attention = m->heads * (max_context + (bf16 ? 2 * m->head_dim : 0));
    return (int64_t)num_threads * ((bf16 ? m->hidden : 0) + attention);
}

#define LAYERNORM_f32(x, residual, w, b, out, summed)                                                        \
    orca_add_layernorm_f32(x, H, residual, H, w, b, out, summed, tokens, H, eps, m->norm_lanes, num_threads)
#define LAYERNORM_bf16(x, residual, w, b, out, summed)                                                       \
    orca_add_layernorm_bf16(x, H, residual, H, w, b, out, summed, tokens, H, eps, m->norm_lanes, num_threads, scratch)

/* As orca_decoder_step_*, for GPT-2: x_in is the token and position embeddings' sum. */
#define DEFINE_GPT2_STEP(NAME, T, SUFFIX)                                                                    \
    int64_t NAME(const gpt2_model *m, const step_batch *b, int64_t tokens, const T *x_in, T *x, T *residual, \
                 T *work, float *scratch, int num_threads) {                                                 \
        const int64_t H = m->hidden, d = m->head_dim, heads = m->heads, I = m->inner;                        \
        const float eps = (float)m->eps;                                                                     \
        const int isa = (int)m->isa;                                                                         \
        T *h = work, *qkv = h + tokens * H, *attn = qkv + tokens * 3 * H, *fc = attn + tokens * H;            \
        T *gelu = fc + tokens * I;                                                                           \
        float *attn_scratch = scratch + (sizeof(T) == 2 ? (int64_t)num_threads * H : 0);                    \
        memcpy(residual, x_in, (size_t)(tokens * H) * sizeof(T));                                            \
        for (int64_t i = 0; i < m->num_layers; i++) {                                                        \
            const gpt2_layer *L = m->layers + i;                                                             \
            if (i == 0)                                                                                      \
                LAYERNORM_##SUFFIX(x_in, NULL, L->ln1_w, L->ln1_b, h, NULL);                                 \
            else                                                                                             \
                LAYERNORM_##SUFFIX(x, residual, L->ln1_w, L->ln1_b, h, residual);                            \
            linear_##SUFFIX(&L->qkv, h, tokens, qkv, num_threads, isa);                                      \
            /* q, k and v: [tokens, 3, heads, head_dim] */                                                   \
            orca_write_kv((const char *)(qkv + H), 3 * H * (int64_t)sizeof(T), (const char *)(qkv + 2 * H),   \
                          3 * H * (int64_t)sizeof(T), L->k_cache, L->v_cache, b->slot_mapping, tokens,       \
                          H * (int64_t)sizeof(T));                                                           \
            orca_decode_attention_##SUFFIX(qkv, 3 * H, d, L->k_cache, L->v_cache, attn, b->query_start,      \
                                           b->context_lens, b->block_tables, b->block_table_stride,          \
                                           b->block_size, b->num_requests, heads, heads, d, b->max_context,  \
                                           (float)m->scale, 0, 0.0f, NULL, NULL, attn_scratch, num_threads,  \
                                           m->max_short);                                                    \
            linear_##SUFFIX(&L->o, attn, tokens, x, num_threads, isa);                                       \
            LAYERNORM_##SUFFIX(x, residual, L->ln2_w, L->ln2_b, h, residual);                                \
            linear_##SUFFIX(&L->fc, h, tokens, fc, num_threads, isa);                                        \
            orca_bias_gelu_##SUFFIX(fc, I, L->fc_bias, gelu, tokens, I, num_threads);                        \
            linear_##SUFFIX(&L->proj, gelu, tokens, x, num_threads, isa);                                    \
        }                                                                                                    \
        return -1;                                                                                           \
    }
DEFINE_GPT2_STEP(orca_gpt2_step_f32, float, f32)
DEFINE_GPT2_STEP(orca_gpt2_step_bf16, uint16_t, bf16)
