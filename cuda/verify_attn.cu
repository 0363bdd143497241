// verify_attn.cu: MLA-absorb attention for tree verification (and AR decode, N = 1, and chains).
//
// Golden twin: kdtree/golden.py  mla_tree_attention (float64).
//
// verify_attn_partial   grid (n_splits, ceil(N*H / 64), batch), block 256 (8 warps), dynamic smem Q + 2 KV tiles + P tile + 1 KB (kernels.VERIFY_SMEM)
//   q          bf16 [batch, N, H, 576]   (512 latent dims = q_nope @ W_uk, then 64 rotated rope dims)
//   cache      bf16 [rows, 576]          one layer's latent cache, paged: page_size rows per page
//   page_table int32 [batch, max_pages]  row r of request b is at page_table[b, r / page_size] * page_size + r % page_size
//   seq_len    int32 [batch]             rows in the cache for b, the N appended rows last (prefix = seq_len - N)
//   mask       uint32 [batch, N, W]      W = ceil(N / 32); bit j of row i: appended row j visible to node i;
//                                        every prefix row is visible to every node
//   scale_log2 float                     softmax scale (YaRN mscale included) times log2(e)
//   Each block: 64 query rows (flattened node*H + head) x one split of the key range, 32 keys a step,
//   K/V tiles double-buffered with cp.async; S = Q K^T and O += P V on mma.sync m16n8k16 (bf16 in,
//   fp32 accumulate); online softmax in base 2. Keys of a step are split between two warp halves
//   for S; each half then owns 256 of the 512 output columns.
//   ws_o float [n_splits, batch, N*H, 512], ws_ml float2 [n_splits, batch, N*H] (running max, sum).
// verify_attn_combine   grid (N*H, batch), block 128
//   out bf16 [batch, N, H, 512] = sum_s O_s 2^(m_s - M) / sum_s l_s 2^(m_s - M); lse float [batch, N, H]
//   (natural log of the softmax denominator, in units of scaled scores).
#include <cuda_bf16.h>
#include "common.cuh"

#define D_QK 576
#define D_V 512
#define ROWS 64
#define KEYS 32
#define STRIDE 584          // smem row stride (bf16): 1168 bytes, rows shift 4 banks
#define P_STRIDE 40         // P tile row stride (bf16)
#define NEG_INF __int_as_float(0xff800000)

constexpr int SMEM_Q = ROWS * STRIDE * 2;
constexpr int SMEM_KV = KEYS * STRIDE * 2;
constexpr int SMEM_P = ROWS * P_STRIDE * 2;

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* s, const void* g, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s)), "l"(g), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ const __nv_bfloat16* cache_row(const __nv_bfloat16* cache, const int32_t* pt, int page_size,
                                                           int r) {
    return cache + ((size_t)pt[r / page_size] * page_size + r % page_size) * D_QK;
}

__device__ __forceinline__ void load_kv_tile(__nv_bfloat16* dst, const __nv_bfloat16* cache, const int32_t* pt,
                                             int page_size, int key0, int S) {
    // 32 rows x 72 chunks of 16 bytes; rows past S are zero-filled
    for (int t = threadIdx.x; t < KEYS * 72; t += blockDim.x) {
        int r = t / 72, c = t - r * 72, key = key0 + r;
        const __nv_bfloat16* src = cache_row(cache, pt, page_size, key < S ? key : 0) + c * 8;
        cp_async16(dst + r * STRIDE + c * 8, src, key < S ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) verify_attn_partial(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ cache, const int32_t* __restrict__ page_table,
    int max_pages, int page_size, const int32_t* __restrict__ seq_len, const uint32_t* __restrict__ mask, int N, int H,
    float scale_log2, float* __restrict__ ws_o, float2* __restrict__ ws_ml) {
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Qs = (__nv_bfloat16*)smem;
    __nv_bfloat16* KVs = (__nv_bfloat16*)(smem + SMEM_Q);
    __nv_bfloat16* Ps = (__nv_bfloat16*)(smem + SMEM_Q + 2 * SMEM_KV);
    float* red = (float*)(smem + SMEM_Q + 2 * SMEM_KV + SMEM_P);  // [2 halves][ROWS] max, then [2][ROWS] sum

    const int split = blockIdx.x, n_splits = gridDim.x, qt = blockIdx.y, b = blockIdx.z;
    const int NH = N * H, W = (N + 31) >> 5;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rg = warp & 3, hf = warp >> 2;
    const int S = seq_len[b], prefix = S - N;
    const int32_t* pt = page_table + (size_t)b * max_pages;
    const int n_tiles = (S + KEYS - 1) / KEYS;
    const int tps = (n_tiles + n_splits - 1) / n_splits;
    const int t_begin = split * tps, t_end = min(n_tiles, t_begin + tps);
    const int q0 = qt * ROWS;

    // Q tile (rows past NH zero-filled)
    const __nv_bfloat16* qb = q + (size_t)b * NH * D_QK;
    for (int t = threadIdx.x; t < ROWS * 72; t += blockDim.x) {
        int r = t / 72, c = t - r * 72, qr = q0 + r;
        cp_async16(Qs + r * STRIDE + c * 8, qb + (size_t)(qr < NH ? qr : 0) * D_QK + c * 8, qr < NH ? 16 : 0);
    }
    if (t_begin < t_end) load_kv_tile(KVs, cache, pt, page_size, t_begin * KEYS, S);
    cp_commit();

    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
    const int row_a = rg * 16 + (lane >> 2);  // this thread's rows: row_a, row_a + 8

    for (int t = t_begin; t < t_end; ++t) {
        const int buf = (t - t_begin) & 1;
        if (t + 1 < t_end) load_kv_tile(KVs + (buf ^ 1) * KEYS * STRIDE, cache, pt, page_size, (t + 1) * KEYS, S);
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const __nv_bfloat16* Ks = KVs + buf * KEYS * STRIDE;

        // S = Q K^T for 16 rows x 16 keys (this half's keys hf*16 .. hf*16+15)
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll 4
        for (int k0 = 0; k0 < D_QK; k0 += 16) {
            uint32_t a[4], bk[4];
            ldsm_x4(a, Qs + (rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + k0 + (lane >> 4) * 8);
            ldsm_x4(bk, Ks + (hf * 16 + (lane & 7) + (lane >> 4) * 8) * STRIDE + k0 + ((lane >> 3) & 1) * 8);
            mma16816(s[0], a, bk[0], bk[1]);
            mma16816(s[1], a, bk[2], bk[3]);
        }
        // mask, scale, row max of this half
        const int key_base = t * KEYS + hf * 16;
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key_base + nt * 8 + (lane & 3) * 2 + (e & 1);
                const int row = row_a + (e >> 1) * 8;
                bool vis = key < S;
                if (vis && key >= prefix) {
                    const int qr = min(q0 + row, NH - 1), node = qr / H, j = key - prefix;
                    vis = (mask[((size_t)b * N + node) * W + (j >> 5)] >> (j & 31)) & 1u;
                }
                float v = vis ? s[nt][e] * scale_log2 : NEG_INF;
                s[nt][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        }
        if ((lane & 3) == 0) { red[hf * ROWS + row_a] = mx[0]; red[hf * ROWS + row_a + 8] = mx[1]; }
        __syncthreads();
        float m_new[2], alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = row_a + i * 8;
            m_new[i] = fmaxf(m_run[i], fmaxf(red[row], red[ROWS + row]));
            alpha[i] = (m_new[i] == NEG_INF) ? 1.f : exp2f(m_run[i] - m_new[i]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float mm = m_new[e >> 1];
                p[e] = (mm == NEG_INF) ? 0.f : exp2f(s[nt][e] - mm);
                sum[e >> 1] += p[e];
            }
            const int col = hf * 16 + nt * 8 + (lane & 3) * 2;
            *(__nv_bfloat162*)(Ps + row_a * P_STRIDE + col) = __floats2bfloat162_rn(p[0], p[1]);
            *(__nv_bfloat162*)(Ps + (row_a + 8) * P_STRIDE + col) = __floats2bfloat162_rn(p[2], p[3]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 1);
            sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 2);
        }
        if ((lane & 3) == 0) { red[2 * ROWS + hf * ROWS + row_a] = sum[0]; red[2 * ROWS + hf * ROWS + row_a + 8] = sum[1]; }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = row_a + i * 8;
            l_run[i] = l_run[i] * alpha[i] + red[2 * ROWS + row] + red[3 * ROWS + row];
            m_run[i] = m_new[i];
        }
#pragma unroll
        for (int nt = 0; nt < 32; ++nt) {
            o[nt][0] *= alpha[0]; o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1]; o[nt][3] *= alpha[1];
        }
        // O[16 x 256] += P[16 x 32] V[32 x 256]   (this half's columns hf*256 ..)
#pragma unroll
        for (int ks = 0; ks < KEYS; ks += 16) {
            uint32_t a[4];
            ldsm_x4(a, Ps + (rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * P_STRIDE + ks + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < 16; ++np) {
                uint32_t bv[4];
                const int n0 = hf * 256 + np * 16;
                ldsm_x4_t(bv, Ks + (ks + (lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE + n0 + (lane >> 4) * 8);
                mma16816(o[2 * np], a, bv[0], bv[1]);
                mma16816(o[2 * np + 1], a, bv[2], bv[3]);
            }
        }
        __syncthreads();  // this buffer is refilled next step; P and red are rewritten
    }
    cp_wait<0>();

    // partial results
    const size_t row_base = ((size_t)split * gridDim.z + b) * NH;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int qr = q0 + row_a + i * 8;
        if (qr >= NH) continue;
        float* dst = ws_o + (row_base + qr) * D_V + hf * 256 + (lane & 3) * 2;
#pragma unroll
        for (int nt = 0; nt < 32; ++nt) *(float2*)(dst + nt * 8) = make_float2(o[nt][2 * i], o[nt][2 * i + 1]);
        if (hf == 0 && (lane & 3) == 0) ws_ml[row_base + qr] = make_float2(m_run[i], l_run[i]);
    }
}

extern "C" __global__ void __launch_bounds__(128) verify_attn_combine(
    const float* __restrict__ ws_o, const float2* __restrict__ ws_ml, int n_splits, int NH,
    __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
    const int qr = blockIdx.x, b = blockIdx.y, B = gridDim.y;
    float M = NEG_INF;
    for (int s = 0; s < n_splits; ++s) M = fmaxf(M, ws_ml[((size_t)s * B + b) * NH + qr].x);
    float L = 0.f;
    for (int s = 0; s < n_splits; ++s) {
        float2 ml = ws_ml[((size_t)s * B + b) * NH + qr];
        if (ml.x != NEG_INF) L += ml.y * exp2f(ml.x - M);
    }
    const float inv = 1.f / L;
    for (int c = threadIdx.x * 4; c < D_V; c += blockDim.x * 4) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < n_splits; ++s) {
            float2 ml = ws_ml[((size_t)s * B + b) * NH + qr];
            if (ml.x == NEG_INF) continue;
            const float w = exp2f(ml.x - M);
            float4 v = *(const float4*)(ws_o + (((size_t)s * B + b) * NH + qr) * D_V + c);
            acc.x += v.x * w; acc.y += v.y * w; acc.z += v.z * w; acc.w += v.w * w;
        }
        __nv_bfloat16* dst = out + ((size_t)b * NH + qr) * D_V + c;
        *(__nv_bfloat162*)dst = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
        *(__nv_bfloat162*)(dst + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
    }
    if (threadIdx.x == 0) lse[(size_t)b * NH + qr] = (M + log2f(L)) * 0.6931471805599453f;
}
