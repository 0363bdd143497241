// draft_attn.cu: the DFlash drafter's GQA attention over the engine's preallocated context, split-KV.
//
// Golden twin: kdtree/ops/draft_attn_golden.py  draft_attention (float64).
// Wrapper: kdtree/ops/draft_attn.py  draft_attn.
//
// Request b's visible keys are the columns [0, ctx_len[b]) and [C, C + T) of its K/V rows, taken in that order
// as its L = ctx_len[b] + T live keys: live key j is column j for j < ctx_len[b], else C + j - ctx_len[b]. No
// other column is read.
//
// draft_attn_partial    grid (n_splits, Hk, batch), block 128 (4 warps), dynamic smem DRAFT_SMEM
//                       (ops.draft_attn.DRAFT_SMEM): Q + 2 stages of (K tile, V tile)
//   q          bf16 [batch, Hk, R, 128]      KV head h's query rows (the G query heads of h x the T block rows),
//                                            1 <= R <= 64
//   kbuf, vbuf bf16 [batch, Hk, C + T, 128]  keys and values, contiguous
//   ctx_len    int32 [batch]                 0 <= ctx_len[b] <= C, read on the device
//   C, T, R    ints                          capacity (context columns), block columns (T >= 1), query rows
//   scale_log2 float                         softmax scale times log2(e)
//   Splits: the L live keys in tiles of 64, ceil(tiles / n_splits) tiles a split, split s from tile s times
//   that; a split past the live tiles writes only ws_ml = (-inf, 0) (the grid is fixed, the work follows
//   ctx_len). Each block: Q [64 rows, zero past R] through shared memory into registers; warp w owns rows
//   16w .. 16w + 15 (a warp whose rows are all past R only loads); K/V tiles of 64 keys gathered row by row
//   (rows past L zero-filled, not read) and double-buffered with cp.async; S = Q K^T and O += P V on mma.sync
//   m16n8k16 (bf16 in, fp32 accumulate), P taken from S's accumulator registers; online softmax in base 2;
//   each thread keeps its part of the row sums until the end.
//   ws_o float [n_splits, batch, Hk, R, 128], ws_ml float2 [n_splits, batch, Hk, R] (running max in scaled
//   base-2 units, sum).
// draft_attn_combine    grid (ceil(R / 4), Hk, batch), block 128 (a warp a query row), n_splits <= DRAFT_MAX_SPLITS
//   out bf16 [batch, Hk, R, 128] = sum_s O_s 2^(m_s - M) / sum_s l_s 2^(m_s - M) over the splits that saw a key
//   (M: their largest m_s).
#include <cuda_bf16.h>
#include "common.cuh"

#define HD 128              // head dim
#define ROWS 64             // query rows a block (4 warps x 16)
#define KEYS 64             // keys a tile
#define STRIDE 136          // smem row stride (bf16): 272 bytes, consecutive rows 4 banks apart
#define DRAFT_MAX_SPLITS 128  // splits draft_attn_combine reads (ops.draft_attn.MAX_SPLITS)

constexpr int SMEM_Q = ROWS * STRIDE * 2;
constexpr int SMEM_TILE = KEYS * STRIDE * 2;                 // one K or one V tile
constexpr int DRAFT_SMEM = SMEM_Q + 4 * SMEM_TILE;           // Q, 2 stages x (K, V)
static_assert(DRAFT_SMEM <= 232448, "draft_attn_partial: over the 227 KB of shared memory a block may have");

__device__ __forceinline__ uint32_t da_smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void da_cp_async16(void* s, const void* g, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(da_smem_addr(s)), "l"(g), "r"(src_bytes));
}
__device__ __forceinline__ void da_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void da_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void da_ldsm_x4(uint32_t* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(da_smem_addr(p)));
}
__device__ __forceinline__ void da_ldsm_x4_t(uint32_t* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(da_smem_addr(p)));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Live keys key0 .. key0 + 63 of one (request, KV head) into a K tile and a V tile: row r is live key key0 + r
// (column key0 + r below ctx, else C + key0 + r - ctx); rows at or past L are zero-filled (nothing is read).
__device__ __forceinline__ void load_tile(__nv_bfloat16* Ks, __nv_bfloat16* Vs, const __nv_bfloat16* kb,
                                          const __nv_bfloat16* vb, int key0, int L, int ctx, int C) {
    for (int t = threadIdx.x; t < KEYS * (HD / 8); t += blockDim.x) {
        const int r = t >> 4, c = (t & 15) * 8, j = key0 + r;
        const bool live = j < L;
        const int col = !live ? 0 : (j < ctx ? j : C + (j - ctx));
        const size_t off = (size_t)col * HD + c;
        da_cp_async16(Ks + r * STRIDE + c, kb + off, live ? 16 : 0);
        da_cp_async16(Vs + r * STRIDE + c, vb + off, live ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(128) draft_attn_partial(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kbuf,
    const __nv_bfloat16* __restrict__ vbuf, const int32_t* __restrict__ ctx_len, int C, int T, int R,
    float scale_log2, float* __restrict__ ws_o, float2* __restrict__ ws_ml) {
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Qs = (__nv_bfloat16*)smem;
    __nv_bfloat16* KVs = (__nv_bfloat16*)(smem + SMEM_Q);  // stage s: K at s * 2 * KEYS rows, V KEYS rows on

    const int split = blockIdx.x, n_splits = gridDim.x, h = blockIdx.y, Hk = gridDim.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ctx = ctx_len[b], L = ctx + T;
    const int n_tiles = (L + KEYS - 1) / KEYS;
    const int tps = (n_tiles + n_splits - 1) / n_splits;
    const int t_begin = split * tps, t_end = min(n_tiles, t_begin + tps);
    const size_t head = (size_t)b * Hk + h;                              // (request, KV head)
    const size_t row0 = ((size_t)split * gridDim.z * Hk + head) * R;     // this block's first workspace row
    if (t_begin >= t_end) {  // an empty split: no O, a statistic that draft_attn_combine skips
        for (int r = threadIdx.x; r < R; r += blockDim.x) ws_ml[row0 + r] = make_float2(NEG_INF, 0.f);
        return;
    }
    const size_t S = (size_t)C + T;
    const __nv_bfloat16* kb = kbuf + head * S * HD;
    const __nv_bfloat16* vb = vbuf + head * S * HD;
    const __nv_bfloat16* qb = q + head * R * HD;

    // Q (rows past R zero-filled), then the first K/V tile, in two commit groups
    for (int t = threadIdx.x; t < ROWS * (HD / 8); t += blockDim.x) {
        const int r = t >> 4, c = (t & 15) * 8;
        da_cp_async16(Qs + r * STRIDE + c, qb + (size_t)(r < R ? r : 0) * HD + c, r < R ? 16 : 0);
    }
    da_cp_commit();
    load_tile(KVs, KVs + KEYS * STRIDE, kb, vb, t_begin * KEYS, L, ctx, C);
    da_cp_commit();
    da_cp_wait<1>();
    __syncthreads();

    const bool active = warp * 16 < R;  // warp-uniform: this warp has query rows
    uint32_t qa[HD / 16][4];            // Q rows 16w .. 16w + 15 as A fragments, k-step kk: dims 16kk ..
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
        da_ldsm_x4(qa[kk], Qs + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + kk * 16 + (lane >> 4) * 8);

    float o[HD / 8][4];  // O [16 rows x 128]: n-tile nt = dims 8nt .. 8nt + 7
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // rows 16w + lane / 4 and that + 8

    for (int t = t_begin; t < t_end; ++t) {
        const int buf = (t - t_begin) & 1;
        if (t + 1 < t_end) {
            __nv_bfloat16* nx = KVs + (buf ^ 1) * 2 * KEYS * STRIDE;
            load_tile(nx, nx + KEYS * STRIDE, kb, vb, (t + 1) * KEYS, L, ctx, C);
        }
        da_cp_commit();
        da_cp_wait<1>();
        __syncthreads();
        const __nv_bfloat16* Ks = KVs + buf * 2 * KEYS * STRIDE;
        const __nv_bfloat16* Vs = Ks + KEYS * STRIDE;
        if (active) {
            // S [16 rows x 64 keys] = Q K^T: n-tile nt = keys 8nt .. 8nt + 7 of the tile
            float s[KEYS / 8][4];
#pragma unroll
            for (int i = 0; i < KEYS / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
                for (int np = 0; np < KEYS / 16; ++np) {
                    uint32_t bk[4];
                    da_ldsm_x4(bk, Ks + (np * 16 + (lane & 7) + (lane >> 4) * 8) * STRIDE + kk * 16 +
                                       ((lane >> 3) & 1) * 8);
                    mma16816(s[2 * np], qa[kk], bk[0], bk[1]);
                    mma16816(s[2 * np + 1], qa[kk], bk[2], bk[3]);
                }
            }
            // scale to base 2, hide keys past L (the last tile only), row maxima over the quad
            const int key_base = t * KEYS;
            const bool full = key_base + KEYS <= L;
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int nt = 0; nt < KEYS / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float v = s[nt][e] * scale_log2;
                    if (!full && key_base + nt * 8 + (lane & 3) * 2 + (e & 1) >= L) v = NEG_INF;
                    s[nt][e] = v;
                    mx[e >> 1] = fmaxf(mx[e >> 1], v);
                }
            float alpha[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
                const float m_new = fmaxf(m_run[i], mx[i]);  // finite: every tile holds a live key
                alpha[i] = (m_run[i] == NEG_INF) ? 0.f : exp2f(m_run[i] - m_new);
                m_run[i] = m_new;
                l_run[i] *= alpha[i];
            }
#pragma unroll
            for (int nt = 0; nt < HD / 8; ++nt) {
                o[nt][0] *= alpha[0]; o[nt][1] *= alpha[0];
                o[nt][2] *= alpha[1]; o[nt][3] *= alpha[1];
            }
            // P = 2^(s - m) as the A fragments of O += P V: k-step kk (keys 16kk ..) is S's n-tiles 2kk, 2kk + 1
            uint32_t pa[KEYS / 16][4];
#pragma unroll
            for (int nt = 0; nt < KEYS / 8; ++nt) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    p[e] = exp2f(s[nt][e] - m_run[e >> 1]);  // 0 for a hidden key
                    l_run[e >> 1] += p[e];
                }
                pa[nt >> 1][2 * (nt & 1)] = pack_bf16(p[0], p[1]);
                pa[nt >> 1][2 * (nt & 1) + 1] = pack_bf16(p[2], p[3]);
            }
            // O [16 x 128] += P [16 x 64] V [64 x 128]
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; ++kk) {
#pragma unroll
                for (int np = 0; np < HD / 16; ++np) {
                    uint32_t bv[4];
                    da_ldsm_x4_t(bv, Vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + np * 16 +
                                         (lane >> 4) * 8);
                    mma16816(o[2 * np], pa[kk], bv[0], bv[1]);
                    mma16816(o[2 * np + 1], pa[kk], bv[2], bv[3]);
                }
            }
        }
        __syncthreads();  // this stage is refilled next step
    }
    da_cp_wait<0>();

    if (!active) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = warp * 16 + (lane >> 2) + i * 8;
        if (r >= R) continue;
        float* dst = ws_o + (row0 + r) * HD + (lane & 3) * 2;
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt) *(float2*)(dst + nt * 8) = make_float2(o[nt][2 * i], o[nt][2 * i + 1]);
        if ((lane & 3) == 0) ws_ml[row0 + r] = make_float2(m_run[i], l_run[i]);
    }
}

extern "C" __global__ void __launch_bounds__(128) draft_attn_combine(
    const float* __restrict__ ws_o, const float2* __restrict__ ws_ml, int n_splits, int R,
    __nv_bfloat16* __restrict__ out) {
    __shared__ float wts[4][DRAFT_MAX_SPLITS];  // per warp: 2^(m_s - M), 0 for a split that saw no key
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * 4 + warp, h = blockIdx.y, Hk = gridDim.y, b = blockIdx.z;
    if (r >= R) return;
    const size_t row = ((size_t)b * Hk + h) * R + r;
    const size_t split_rows = (size_t)gridDim.z * Hk * R;  // workspace rows a split
    float M = NEG_INF;
    for (int s = lane; s < n_splits; s += 32) M = fmaxf(M, ws_ml[s * split_rows + row].x);
    for (int d = 16; d > 0; d >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, d));
    float L = 0.f;
    for (int s = lane; s < n_splits; s += 32) {
        const float2 ml = ws_ml[s * split_rows + row];
        const float w = (ml.x == NEG_INF) ? 0.f : exp2f(ml.x - M);
        wts[warp][s] = w;
        L += ml.y * w;
    }
    for (int d = 16; d > 0; d >>= 1) L += __shfl_xor_sync(0xffffffffu, L, d);
    __syncwarp();
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < n_splits; ++s) {
        const float w = wts[warp][s];
        if (w == 0.f) continue;  // an empty split (its O is not written) or one whose terms underflow
        const float4 v = *(const float4*)(ws_o + (s * split_rows + row) * HD + lane * 4);
        acc.x += v.x * w; acc.y += v.y * w; acc.z += v.z * w; acc.w += v.w * w;
    }
    const float inv = 1.f / L;
    __nv_bfloat16* dst = out + row * HD + lane * 4;
    *(__nv_bfloat162*)dst = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    *(__nv_bfloat162*)(dst + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
}
