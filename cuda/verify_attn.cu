// verify_attn.cu: MLA-absorb attention for tree verification (and AR decode, N = 1, and chains).
//
// Golden twin: kdtree/ops/verify_attn_golden.py  mla_tree_attention (float64).
// Wrappers: kdtree/ops/verify_attn.py.
//
// verify_attn_partial   grid (n_splits, ceil(N*H / 64), batch), block 256 (8 warps), dynamic smem
//                       Q + 2 KV tiles + P tile + 1 KB (ops.verify_attn.VERIFY_SMEM)
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
//   ws_o float [n_splits, batch, N*H, 512], ws_ml float2 [n_splits, batch, N*H] (running max, sum); a split with
//   no key (the context shorter than the splits were sized for) writes only ws_ml = (-inf, 0).
// verify_attn_wg        the same contract on Hopper's warpgroup MMA (sm_90a builds only; below), and
// verify_attn_ws        the same again with warp-specialized warpgroups over a 4-stage ring of 32-key tiles.
// verify_attn_combine   grid (N*H, batch), block 128, n_splits <= MAX_SPLITS
//   out bf16 [batch, N, H, 512] = sum_s O_s 2^(m_s - M) / sum_s l_s 2^(m_s - M); lse float [batch, N, H]
//   (natural log of the softmax denominator, in units of scaled scores).
#include <cuda_bf16.h>
#include "common.cuh"

// Ablations, for timing only (the outputs are wrong by design): each switch removes one part of a
// tile's work, set by -D options (kdtree.ops.loader.compile_defines; bench.VERIFY_ABLATIONS); unset, the
// kernels are built as they are.
//   KDTREE_ABLATE_S_STEPS=k   S = Q K^T of the wgmma kernels over k of its 36 k-steps (0 <= k <= 36)
//   KDTREE_ABLATE_NO_PV=1     no O += P V steps in the wgmma kernels
//   KDTREE_ABLATE_NO_EXP=1    P = s - m instead of 2^(s - m)
//   KDTREE_ABLATE_NO_LOADS=1  no cp.async of the K/V and Q tiles (the asm keeps its operands, empty)
#ifndef KDTREE_ABLATE_S_STEPS
#define KDTREE_ABLATE_S_STEPS 36
#endif
#if defined(KDTREE_ABLATE_NO_LOADS) && KDTREE_ABLATE_NO_LOADS
#define CP_ASYNC_16 ""
#else
#define CP_ASYNC_16 "cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
#endif

#define D_QK 576
#define D_V 512
#define ROWS 64
#define KEYS 32
#define STRIDE 584          // smem row stride (bf16): 1168 bytes, rows shift 4 banks
#define P_STRIDE 40         // P tile row stride (bf16)
#define MAX_SPLITS 128      // context splits verify_attn_combine reads (ops.verify_attn.MAX_SPLITS)

constexpr int SMEM_Q = ROWS * STRIDE * 2;
constexpr int SMEM_KV = KEYS * STRIDE * 2;
constexpr int SMEM_P = ROWS * P_STRIDE * 2;

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* s, const void* g, int src_bytes) {
    asm volatile(CP_ASYNC_16 ::"r"(smem_addr(s)), "l"(g), "r"(src_bytes));
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

// Online softmax, base 2: a row's new running maximum from the old one and two key halves' maxima, and the
// factor alpha = 2^(old - new) that rescales the old sums (1 while the row has seen no visible key).
__device__ __forceinline__ void running_max(float m_run, float a, float b, float& m_new, float& alpha) {
    m_new = fmaxf(m_run, fmaxf(a, b));
    alpha = (m_new == NEG_INF) ? 1.f : exp2f(m_run - m_new);
}
// 2^(s - m) for a masked-or-visible score s under the row's running maximum m (0 while m is -inf).
__device__ __forceinline__ float exp2_below(float s, float m) {
#if defined(KDTREE_ABLATE_NO_EXP) && KDTREE_ABLATE_NO_EXP
    return (m == NEG_INF) ? 0.f : (s - m);
#else
    return (m == NEG_INF) ? 0.f : exp2f(s - m);
#endif
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

// The parameters of the three partial kernels (verify_attn_partial, verify_attn_wg, verify_attn_ws), in
// ops.verify_attn.verify_attn's order.
#define VERIFY_PARTIAL_PARAMS                                                                                       \
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ cache, const int32_t* __restrict__ page_table, \
    int max_pages, int page_size, const int32_t* __restrict__ seq_len, const uint32_t* __restrict__ mask, int N, int H, \
    float scale_log2, float* __restrict__ ws_o, float2* __restrict__ ws_ml

extern "C" __global__ void __launch_bounds__(256, 1) verify_attn_partial(
    VERIFY_PARTIAL_PARAMS) {
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
    if (t_begin >= t_end) {  // an empty split: no O, a statistic that verify_attn_combine weighs 0
        const size_t row_base = ((size_t)split * gridDim.z + b) * NH;
        if (threadIdx.x < ROWS && q0 + (int)threadIdx.x < NH) ws_ml[row_base + q0 + threadIdx.x] = make_float2(NEG_INF, 0.f);
        return;
    }

    // Q tile (rows past NH zero-filled)
    const __nv_bfloat16* qb = q + (size_t)b * NH * D_QK;
    for (int t = threadIdx.x; t < ROWS * 72; t += blockDim.x) {
        int r = t / 72, c = t - r * 72, qr = q0 + r;
        cp_async16(Qs + r * STRIDE + c * 8, qb + (size_t)(qr < NH ? qr : 0) * D_QK + c * 8, qr < NH ? 16 : 0);
    }
    load_kv_tile(KVs, cache, pt, page_size, t_begin * KEYS, S);
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
        for (int i = 0; i < 2; ++i) running_max(m_run[i], red[row_a + i * 8], red[ROWS + row_a + i * 8], m_new[i], alpha[i]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                p[e] = exp2_below(s[nt][e], m_new[e >> 1]);
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
    // the splits with a nonzero weight 2^(m_s - M), ascending (an empty split's O is not written; a split whose
    // terms underflow adds nothing): their ids and weights
    __shared__ int ids[MAX_SPLITS];
    __shared__ float wts[MAX_SPLITS];
    __shared__ float s_inv;
    __shared__ int s_cnt;
    const int qr = blockIdx.x, b = blockIdx.y, B = gridDim.y, lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        float M = NEG_INF;
        for (int s = lane; s < n_splits; s += 32) M = fmaxf(M, ws_ml[((size_t)s * B + b) * NH + qr].x);
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float L = 0.f;
        int cnt = 0;
        for (int s0 = 0; s0 < n_splits; s0 += 32) {  // the whole warp in every pass (the ballot)
            const int s = s0 + lane;
            float w = 0.f;
            if (s < n_splits) {
                const float2 ml = ws_ml[((size_t)s * B + b) * NH + qr];
                w = (ml.x == NEG_INF) ? 0.f : exp2f(ml.x - M);
                L += ml.y * w;
            }
            const unsigned live = __ballot_sync(0xffffffffu, w != 0.f);
            if (w != 0.f) {
                const int at = cnt + __popc(live & ((1u << lane) - 1u));
                ids[at] = s;
                wts[at] = w;
            }
            cnt += __popc(live);
        }
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        if (lane == 0) {
            s_inv = 1.f / L;
            s_cnt = cnt;
            lse[(size_t)b * NH + qr] = (M + log2f(L)) * 0.6931471805599453f;
        }
    }
    __syncthreads();
    const float inv = s_inv;
    const int cnt = s_cnt;
    const size_t col0 = ((size_t)b * NH + qr) * D_V, stride = (size_t)B * NH * D_V;  // split s: + s stride
    for (int c = threadIdx.x * 4; c < D_V; c += blockDim.x * 4) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        int j = 0;
        for (; j + 4 <= cnt; j += 4) {  // four loads in flight, then the sums in split order
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = *(const float4*)(ws_o + ids[j + u] * stride + col0 + c);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const float w = wts[j + u];
                acc.x += v[u].x * w; acc.y += v[u].y * w; acc.z += v[u].z * w; acc.w += v[u].w * w;
            }
        }
        for (; j < cnt; j++) {
            const float w = wts[j];
            const float4 v = *(const float4*)(ws_o + ids[j] * stride + col0 + c);
            acc.x += v.x * w; acc.y += v.y * w; acc.z += v.z * w; acc.w += v.w * w;
        }
        __nv_bfloat16* dst = out + ((size_t)b * NH + qr) * D_V + c;
        *(__nv_bfloat162*)dst = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
        *(__nv_bfloat162*)(dst + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
    }
}

// ------------------------------------------------------------------------------------- wgmma path (sm_90a)
// verify_attn_wg: verify_attn_partial's contract (arguments, ws_o / ws_ml, then verify_attn_combine) on Hopper's
// warpgroup MMA; compiled where the loader defines KDTREE_WGMMA (an sm_90a build), else absent.
//   grid (n_splits, ceil(N*H / 64), batch), block 256 (two warpgroups), dynamic smem WG_SMEM
//   (ops.verify_attn.VERIFY_WG_SMEM), split over tiles of 64 keys.
//   Shared memory: Q [64 rows x 576] and two K/V tiles [64 keys x 576], each as nine 128-byte-swizzled K-major
//   atoms [64 rows x 64 dims] (16-byte chunk c of row r stored at chunk c ^ (r & 7)), filled by cp.async; P
//   [64 x 64] bf16 in one such atom.
//   Per tile: warpgroup g computes S [64 x 32] for keys 32g..32g+31 (wgmma m64n32k16, 36 k-steps, Q and K read
//   from shared memory); masked, scaled row maxima meet in shared memory; P goes to shared memory as bf16; then
//   warpgroup g accumulates O [64 rows x 256 columns 256g..] += P V (wgmma m64n256k16, 4 k-steps, V = the tile's
//   first 512 dims read MN-major). fp32 accumulation, online softmax in base 2; each thread keeps its own part of
//   the row sums until the end. The next tile's cp.async loads are issued behind S's wgmmas (2% faster than
//   before them). Measured on the H200 and not kept: O(t) left running while S(t + 1) is issued (12% slower at
//   32K x 64 nodes: its extra barrier and later loads cost more than the overlap); skipping O's rescale where no
//   row maximum moved (neutral); page-table entries read a tile ahead (neutral).
#ifdef KDTREE_WGMMA
#define WG_KEYS 64
#define ATOM 8192
constexpr int WG_TILE = 9 * ATOM;
constexpr int WG_SMEM = 1024 + 3 * WG_TILE + ATOM + 3 * 64 * 4;  // alignment slack, Q, 2 K/V tiles, P, red
static_assert(WG_SMEM <= 232448, "verify_attn_wg: over the 227 KB of shared memory a block may have on sm_90");

__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {  // 128-byte swizzle
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pins accumulator registers at this point of the program: the compiler may not move their other reads and
// writes across it (PTX leaves registers that an in-flight wgmma uses undefined to any other instruction, and
// NVVM otherwise sinks O's rescale and S's zeroing past wgmma.fence, leaving ptxas to insert a warpgroup.arrive).
template <int N> __device__ __forceinline__ void wg_pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Masks and scales (base 2) a [64 x 32] S fragment of keys key_base.. : s[4j + e] is row row0 + 8 (e >> 1) of the
// block (row0 = q0 + this thread's first row), key key_base + 8j + 2c + (e & 1); keys past S are hidden, appended
// keys (>= prefix) follow the request's mask words (rows past N*H use the last row's). mx: the rows' maxima here.
__device__ __forceinline__ void mask_scale_32(float (&s)[16], float (&mx)[2], int key_base, int S, int prefix,
                                              int row0, int c, int NH, int H, int N, int W, const uint32_t* mask_b,
                                              float scale_log2) {
    const bool plain = key_base + 32 <= prefix;  // all 32 keys are prefix rows, visible to every node
    mx[0] = mx[1] = NEG_INF;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            bool vis = true;
            if (!plain) {
                const int key = key_base + 8 * j + 2 * c + (e & 1);
                vis = key < S;
                if (vis && key >= prefix) {
                    const int qr = min(row0 + (e >> 1) * 8, NH - 1), node = qr / H, jj = key - prefix;
                    vis = (mask_b[(size_t)node * W + (jj >> 5)] >> (jj & 31)) & 1u;
                }
            }
            const float v = vis ? s[4 * j + e] * scale_log2 : NEG_INF;
            s[4 * j + e] = v;
            mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
}

// P = 2^(s - m) of a [64 x 32] S fragment as bf16 into a 128-byte-swizzled [64 x 128 B] atom: keys 8j + 2c, +1 of
// rows r0 and r0 + 8 go to logical chunk chunk0 + j (stored at chunk (chunk0 + j) ^ (r & 7); the two rows share
// r & 7); ps gets the rows' sums of the (unrounded) terms.
__device__ __forceinline__ void store_p(const float (&s)[16], const float (&mn)[2], float (&ps)[2], unsigned char* Ps,
                                        int r0, int c, int chunk0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[e] = exp2_below(s[4 * j + e], mn[e >> 1]);
            ps[e >> 1] += p[e];
        }
        const int off = (((chunk0 + j) ^ (r0 & 7)) << 4) + c * 4;
        *(__nv_bfloat162*)(Ps + r0 * 128 + off) = __floats2bfloat162_rn(p[0], p[1]);
        *(__nv_bfloat162*)(Ps + (r0 + 8) * 128 + off) = __floats2bfloat162_rn(p[2], p[3]);
    }
}

// The [64 x 256] O fragment's rows r0 and r0 + 8 times a0 and a1 (o[4j], o[4j + 1]: row r0; o[4j + 2], o[4j + 3]).
__device__ __forceinline__ void rescale_rows(float (&o)[128], float a0, float a1) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        o[4 * j] *= a0; o[4 * j + 1] *= a0;
        o[4 * j + 2] *= a1; o[4 * j + 3] *= a1;
    }
}

// d [64 x 32] (+)= A B^T, A and B K-major in shared memory (accum = 0: d = A B^T)
__device__ __forceinline__ void wg_m64n32(float (&d)[16], uint64_t da, uint64_t db, int accum) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]), "+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15])
                 : "l"(da), "l"(db), "r"(accum));
}

// d [64 x 256] += A B, A K-major, B MN-major (transposed) in shared memory
__device__ __forceinline__ void wg_m64n256_tb(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
                 : "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]),"+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15]),"+f"(d[16]),"+f"(d[17]),"+f"(d[18]),"+f"(d[19]),"+f"(d[20]),"+f"(d[21]),"+f"(d[22]),"+f"(d[23]),"+f"(d[24]),"+f"(d[25]),"+f"(d[26]),"+f"(d[27]),"+f"(d[28]),"+f"(d[29]),"+f"(d[30]),"+f"(d[31]),"+f"(d[32]),"+f"(d[33]),"+f"(d[34]),"+f"(d[35]),"+f"(d[36]),"+f"(d[37]),"+f"(d[38]),"+f"(d[39]),"+f"(d[40]),"+f"(d[41]),"+f"(d[42]),"+f"(d[43]),"+f"(d[44]),"+f"(d[45]),"+f"(d[46]),"+f"(d[47]),"+f"(d[48]),"+f"(d[49]),"+f"(d[50]),"+f"(d[51]),"+f"(d[52]),"+f"(d[53]),"+f"(d[54]),"+f"(d[55]),"+f"(d[56]),"+f"(d[57]),"+f"(d[58]),"+f"(d[59]),"+f"(d[60]),"+f"(d[61]),"+f"(d[62]),"+f"(d[63]),"+f"(d[64]),"+f"(d[65]),"+f"(d[66]),"+f"(d[67]),"+f"(d[68]),"+f"(d[69]),"+f"(d[70]),"+f"(d[71]),"+f"(d[72]),"+f"(d[73]),"+f"(d[74]),"+f"(d[75]),"+f"(d[76]),"+f"(d[77]),"+f"(d[78]),"+f"(d[79]),"+f"(d[80]),"+f"(d[81]),"+f"(d[82]),"+f"(d[83]),"+f"(d[84]),"+f"(d[85]),"+f"(d[86]),"+f"(d[87]),"+f"(d[88]),"+f"(d[89]),"+f"(d[90]),"+f"(d[91]),"+f"(d[92]),"+f"(d[93]),"+f"(d[94]),"+f"(d[95]),"+f"(d[96]),"+f"(d[97]),"+f"(d[98]),"+f"(d[99]),"+f"(d[100]),"+f"(d[101]),"+f"(d[102]),"+f"(d[103]),"+f"(d[104]),"+f"(d[105]),"+f"(d[106]),"+f"(d[107]),"+f"(d[108]),"+f"(d[109]),"+f"(d[110]),"+f"(d[111]),"+f"(d[112]),"+f"(d[113]),"+f"(d[114]),"+f"(d[115]),"+f"(d[116]),"+f"(d[117]),"+f"(d[118]),"+f"(d[119]),"+f"(d[120]),"+f"(d[121]),"+f"(d[122]),"+f"(d[123]),"+f"(d[124]),"+f"(d[125]),"+f"(d[126]),"+f"(d[127])
                 : "l"(da), "l"(db));
}

// Issues (commits, does not wait for) S [64 x 32] = Q K^T over the 576 dims: Q's nine [64 x 64-dim] atoms
// (ATOM apart) at q_addr, K's 32 keys in nine atoms k_atom apart at k_addr, both K-major and 128-byte swizzled.
__device__ __forceinline__ void issue_s(float (&s)[16], uint32_t q_addr, uint32_t k_addr, uint32_t k_atom) {
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    wg_pin(s);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < KDTREE_ABLATE_S_STEPS; ++ks)
        wg_m64n32(s, wg_desc(q_addr + (ks >> 2) * ATOM + (ks & 3) * 32, 16, 1024),
                  wg_desc(k_addr + (ks >> 2) * k_atom + (ks & 3) * 32, 16, 1024), ks > 0);
    wg_commit();
}

// Issues (commits, does not wait for) O [64 x 256] += P [64 x 16 KS keys] V [16 KS keys x 256 columns]: P K-major
// from a swizzled [64 x 128 B] atom, V MN-major from four atoms of 64 columns, atom_bytes apart, starting at v_addr.
template <int KS>
__device__ __forceinline__ void issue_pv(float (&o)[128], uint32_t p_addr, uint32_t v_addr, uint32_t atom_bytes) {
    wg_pin(o);
    wg_fence();
#if !(defined(KDTREE_ABLATE_NO_PV) && KDTREE_ABLATE_NO_PV)
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
        wg_m64n256_tb(o, wg_desc(p_addr + ks * 32, 16, 1024), wg_desc(v_addr + ks * 2048, atom_bytes, 1024));
#endif
    wg_commit();
}

// cp.async a [64 x 576] tile into swizzled atoms: thread t copies 16-byte chunk t % 8 of each 64-dim atom of
// rows t / 8 (h = 0) and t / 8 + 32 (h = 1); row(h, r, bytes) gives row r's source (bytes = 16, or 0: zero-fill)
template <typename Row>
__device__ __forceinline__ void wg_load_tile(unsigned char* dst, Row row) {
    const int qc = threadIdx.x & 7;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = (threadIdx.x >> 3) + 32 * h;
        int bytes;
        const __nv_bfloat16* src = row(h, r, bytes) + qc * 8;
        const uint32_t d0 = smem_addr(dst) + r * 128 + ((qc ^ (r & 7)) << 4);
#pragma unroll
        for (int a = 0; a < 9; ++a)
            asm volatile(CP_ASYNC_16 ::"r"(d0 + a * ATOM), "l"(src + a * 64),
                         "r"(bytes));
    }
}

__device__ __forceinline__ void wg_load_kv(unsigned char* dst, const __nv_bfloat16* cache, const int32_t* pt,
                                           int page_size, int key0, int S) {
    wg_load_tile(dst, [&](int, int r, int& bytes) {
        const int key = key0 + r;
        bytes = key < S ? 16 : 0;
        return cache_row(cache, pt, page_size, key < S ? key : 0);
    });
}

__device__ __forceinline__ unsigned char* align_1k(unsigned char* p) {
    return p + ((1024u - (smem_addr(p) & 1023u)) & 1023u);
}

// A verify_attn block's place in the work (grid (n_splits, ceil(N*H / 64), batch), 256 threads), shared by the
// two wgmma kernels: its request, its 64 query rows, its range of key tiles of `keys` keys, this thread's rows.
struct WgBlock {
    int split, b, NH, W, wg, w, lane, c, S, prefix, t_begin, t_end, q0, r0;
    const int32_t* pt;
    size_t row_base;  // row of (split, b, 0) in ws_o / ws_ml
    __device__ WgBlock(int keys, const int32_t* seq_len, const int32_t* page_table, int max_pages, int N, int H) {
        split = blockIdx.x; b = blockIdx.z;
        NH = N * H; W = (N + 31) >> 5;
        wg = threadIdx.x >> 7; w = (threadIdx.x >> 5) & 3; lane = threadIdx.x & 31; c = lane & 3;
        S = seq_len[b]; prefix = S - N;
        pt = page_table + (size_t)b * max_pages;
        const int n_tiles = (S + keys - 1) / keys, tps = (n_tiles + gridDim.x - 1) / gridDim.x;
        t_begin = split * tps; t_end = min(n_tiles, t_begin + tps);
        q0 = blockIdx.y * 64;
        r0 = 16 * w + (lane >> 2);  // this thread's rows: r0, r0 + 8
        row_base = ((size_t)split * gridDim.z + b) * NH;
    }
    // An empty split (a context shorter than the splits were sized for) writes only its statistic, which
    // verify_attn_combine weighs 0; true: the block is done.
    __device__ bool empty(float2* ws_ml) const {
        if (t_begin < t_end) return false;
        if (threadIdx.x < 64 && q0 + (int)threadIdx.x < NH) ws_ml[row_base + q0 + threadIdx.x] = make_float2(NEG_INF, 0.f);
        return true;
    }
    // this warpgroup's [64 x 256] O fragment (columns 256 wg..) to the split's rows of ws_o (rows < N*H)
    __device__ void store_o(const float (&o)[128], float* ws_o) const {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int qr = q0 + r0 + 8 * i;
            if (qr >= NH) continue;
            float* dst = ws_o + (row_base + qr) * D_V + wg * 256 + c * 2;
#pragma unroll
            for (int j = 0; j < 32; ++j) *(float2*)(dst + 8 * j) = make_float2(o[4 * j + 2 * i], o[4 * j + 2 * i + 1]);
        }
    }
    // cp.async of the block's [64 x 576] queries into swizzled atoms (rows past N*H zero-filled); not committed
    __device__ void load_q(unsigned char* Qs, const __nv_bfloat16* q) const {
        const __nv_bfloat16* qb = q + (size_t)b * NH * D_QK;
        const int n = NH, base = q0;
        wg_load_tile(Qs, [&](int, int r, int& bytes) {
            const int qr = base + r;
            bytes = qr < n ? 16 : 0;
            return qb + (size_t)(qr < n ? qr : 0) * D_QK;
        });
    }
};

extern "C" __global__ void __launch_bounds__(256, 1) verify_attn_wg(
    VERIFY_PARTIAL_PARAMS) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* Qs = align_1k(smem_raw);  // swizzle atoms: 1 KB aligned
    unsigned char* KV = Qs + WG_TILE;
    unsigned char* Ps = Qs + 3 * WG_TILE;
    float* red = (float*)(Ps + ATOM);  // [2][64] row maxima of the two key halves, then [64] row sums

    const WgBlock blk(WG_KEYS, seq_len, page_table, max_pages, N, H);
    if (blk.empty(ws_ml)) return;
    const int b = blk.b, NH = blk.NH, W = blk.W, wg = blk.wg, c = blk.c, S = blk.S, prefix = blk.prefix;
    const int t_begin = blk.t_begin, t_end = blk.t_end, q0 = blk.q0, r0 = blk.r0;
    const int32_t* pt = blk.pt;
    const size_t row_base = blk.row_base;

    blk.load_q(Qs, q);
    wg_load_kv(KV, cache, pt, page_size, t_begin * WG_KEYS, S);
    cp_commit();

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
    const uint32_t q_addr = smem_addr(Qs), p_addr = smem_addr(Ps);

    for (int t = t_begin; t < t_end; ++t) {
        const unsigned char* Ks = KV + ((t - t_begin) & 1) * WG_TILE;
        cp_wait<0>();
        fence_async_smem();  // the cp.async writes, before the async proxy (wgmma) reads them
        __syncthreads();     // tile t is in; every warpgroup is done with tile t - 1
        const uint32_t k_addr = smem_addr(Ks);

        // S = Q K^T for this warpgroup's 32 keys
        float s[16];
        issue_s(s, q_addr, k_addr + wg * 4096, ATOM);
        if (t + 1 < t_end)  // issued behind S, into the buffer tile t - 1 used (every warpgroup is past it)
            wg_load_kv(KV + ((t + 1 - t_begin) & 1) * WG_TILE, cache, pt, page_size, (t + 1) * WG_KEYS, S);
        cp_commit();
        wg_wait<0>();
        wg_pin(s);

        float mx[2];
        mask_scale_32(s, mx, t * WG_KEYS + wg * 32, S, prefix, q0 + r0, c, NH, H, N, W, mask + (size_t)b * N * W,
                      scale_log2);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        }
        if (c == 0) { red[wg * 64 + r0] = mx[0]; red[wg * 64 + r0 + 8] = mx[1]; }
        __syncthreads();
        float mn[2], al[2], ps[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 2; ++i) running_max(m_run[i], red[r0 + 8 * i], red[64 + r0 + 8 * i], mn[i], al[i]);
        // P = 2^(s - m) as bf16 into the swizzled P atom (row r, keys 32 wg + 8j + 2c, +1)
        store_p(s, mn, ps, Ps, r0, c, wg * 4);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l_run[i] = l_run[i] * al[i] + ps[i];
            m_run[i] = mn[i];
        }
        rescale_rows(o, al[0], al[1]);
        fence_async_smem();  // P's generic-proxy stores, before wgmma reads them
        __syncthreads();

        // O [64 x 256] += P [64 x 64] V [64 keys x this warpgroup's 256 columns]
        issue_pv<4>(o, p_addr, k_addr + 4 * wg * ATOM, ATOM);
        wg_wait<0>();
        wg_pin(o);
    }
    cp_wait<0>();

    // row sums: the quad's lanes, then the two warpgroups (same maxima: both saw the same red rows)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
        l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    }
    if (wg == 1 && c == 0) { red[128 + r0] = l_run[0]; red[128 + r0 + 8] = l_run[1]; }
    __syncthreads();
    blk.store_o(o, ws_o);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int qr = q0 + r0 + 8 * i;
        if (wg == 0 && c == 0 && qr < NH) ws_ml[row_base + qr] = make_float2(m_run[i], l_run[i] + red[128 + r0 + 8 * i]);
    }
}
// ------------------------------------------------------------------------ warp-specialized wgmma path (sm_90a)
// verify_attn_ws: verify_attn_partial's contract on warpgroup MMA with the two warpgroups in different roles and a
// 4-stage ring of 32-key K/V tiles, so that the tensor cores run S(t + 1) and P V(t) while the softmax of t runs.
//   grid (n_splits, ceil(N*H / 64), batch), block 256, dynamic smem WS_SMEM
//   (ops.verify_attn.VERIFY_WS_SMEM), split over tiles of 32 keys.
//   Shared memory: Q [64 x 576] (nine 128-byte-swizzled K-major atoms [64 rows x 64 dims], as verify_attn_wg), four
//   stages of K/V [32 keys x 576] (nine atoms [32 rows x 64 dims] each), P [64 x 32] bf16 in one [64 x 64] atom,
//   alpha [64] (the rows' rescale factors of the last tile), mbarriers.
//   Warpgroup 0 owns the softmax: per tile it waits for the stage (full), computes S [64 x 32] (wgmma m64n32k16,
//   36 k-steps), frees the stage's previous use (empty), masks, takes the rows' running maxima, writes P and alpha
//   once warpgroup 1 is done with the last ones (pempty), signals them (pfull), rescales its O half and issues
//   O [64 x 256 columns 0..255] += P V (m64n256k16, 2 k-steps) without waiting for it.
//   Warpgroup 1 loads (cp.async, each stage one commit group, three stages ahead; a stage is signalled full once
//   its group has landed and been fenced for the async proxy) and, once P and alpha are signalled, rescales its O
//   half (columns 256..511) and accumulates P V into it, then frees P (pempty) and its use of the stage (empty
//   counts both warpgroups' 256 threads: a wgmma wait covers the calling warp only).
//   Row maxima and sums live in warpgroup 0 only; the epilogue needs no exchange.
#define WS_KEYS 32
#define WS_STAGES 4
#define WS_ATOM 4096                       // [32 rows x 128 B]
constexpr int WS_STAGE = 9 * WS_ATOM;      // one K/V stage
constexpr int WS_SMEM = 1024 + 9 * ATOM + WS_STAGES * WS_STAGE + ATOM + 64 * 4 + 16 * 8;
static_assert(WS_SMEM <= 232448, "verify_attn_ws: over the 227 KB of shared memory a block may have on sm_90");

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {  // release: this thread's earlier writes go with it
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {  // until the phase of this parity completes
    asm volatile("{\n.reg .pred done;\n"
                 "WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n"
                 "}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// cp.async one [32 x 576] stage (warpgroup 1's 128 threads: chunk t % 8 of every atom of rows t / 8 and t / 8 + 16)
__device__ __forceinline__ void ws_load_stage(unsigned char* dst, const __nv_bfloat16* cache, const int32_t* pt,
                                              int page_size, int key0, int S, int t128) {
    const int qc = t128 & 7;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = (t128 >> 3) + 16 * h, key = key0 + r;
        const __nv_bfloat16* src = cache_row(cache, pt, page_size, key < S ? key : 0) + qc * 8;
        const uint32_t d0 = smem_addr(dst) + r * 128 + ((qc ^ (r & 7)) << 4);
#pragma unroll
        for (int a = 0; a < 9; ++a)
            asm volatile(CP_ASYNC_16 ::"r"(d0 + a * WS_ATOM), "l"(src + a * 64),
                         "r"(key < S ? 16 : 0));
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) verify_attn_ws(
    VERIFY_PARTIAL_PARAMS) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* Qs = align_1k(smem_raw);  // swizzle atoms: 1 KB aligned
    unsigned char* stages = Qs + 9 * ATOM;
    unsigned char* Ps = stages + WS_STAGES * WS_STAGE;
    float* alpha_s = (float*)(Ps + ATOM);
    uint64_t* bars = (uint64_t*)(alpha_s + 64);  // full[4], empty[4], pfull, pempty
    uint64_t *full = bars, *empty = bars + WS_STAGES, *pfull = bars + 2 * WS_STAGES, *pempty = pfull + 1;

    const WgBlock blk(WS_KEYS, seq_len, page_table, max_pages, N, H);
    const int b = blk.b, NH = blk.NH, W = blk.W, wg = blk.wg, c = blk.c, S = blk.S, prefix = blk.prefix;
    const int t_begin = blk.t_begin, n = blk.t_end - blk.t_begin, q0 = blk.q0, r0 = blk.r0;
    const int32_t* pt = blk.pt;
    const size_t row_base = blk.row_base;
    if (n <= 0) {  // (blk.empty's work; tested on n here, ptxas keeps the wgmma pipeline: C7515 otherwise)
        blk.empty(ws_ml);
        return;
    }

    if (threadIdx.x == 0) {
        for (int i = 0; i < WS_STAGES; ++i) { mbar_init(&full[i], 128); mbar_init(&empty[i], 256); }
        mbar_init(pfull, 128);
        mbar_init(pempty, 128);
    }
    blk.load_q(Qs, q);
    cp_commit();
    cp_wait<0>();
    fence_async_smem();
    __syncthreads();  // Q in, barriers initialised

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const uint32_t q_addr = smem_addr(Qs), p_addr = smem_addr(Ps);

    if (wg == 0) {  // ------------------------------------------------------------- S, softmax, O columns 0..255
        float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
        for (int tt = 0; tt < n; ++tt) {
            const int t = t_begin + tt, st = tt % WS_STAGES;
            const uint32_t k_addr = smem_addr(stages + st * WS_STAGE);
            mbar_wait(&full[st], (tt / WS_STAGES) & 1);
            float s[16];
            issue_s(s, q_addr, k_addr, WS_ATOM);
            wg_wait<0>();  // S(t), and O(t - 1)
            wg_pin(s);
            wg_pin(o);
            if (tt > 0) mbar_arrive(&empty[(tt - 1) % WS_STAGES]);  // done with tile t - 1's stage

            float mx[2];  // the tile's 32 keys
            mask_scale_32(s, mx, t * WS_KEYS, S, prefix, q0 + r0, c, NH, H, N, W, mask + (size_t)b * N * W, scale_log2);
            float mn[2], al[2], ps[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
                running_max(m_run[i], mx[i], NEG_INF, mn[i], al[i]);
            }
            if (tt > 0) mbar_wait(pempty, (tt - 1) & 1);  // warpgroup 1 is done with P(t - 1) and alpha
            store_p(s, mn, ps, Ps, r0, c, 0);
            if (c == 0) { alpha_s[r0] = al[0]; alpha_s[r0 + 8] = al[1]; }
            fence_async_smem();  // P's generic-proxy stores, before either warpgroup's wgmma reads them
            __syncwarp();        // the warp's lanes' rows, before its own wgmma reads them
            mbar_arrive(pfull);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                l_run[i] = l_run[i] * al[i] + ps[i];
                m_run[i] = mn[i];
            }
            rescale_rows(o, al[0], al[1]);
            issue_pv<2>(o, p_addr, k_addr, WS_ATOM);  // V: the stage's atoms 0..3
        }
        wg_wait<0>();
        wg_pin(o);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
            l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
            const int qr = q0 + r0 + 8 * i;
            if (c == 0 && qr < NH) ws_ml[row_base + qr] = make_float2(m_run[i], l_run[i]);
        }
    } else {  // ------------------------------------------------------------------------- loads, O columns 256..511
        const int t128 = threadIdx.x - 128;
        for (int i = 0; i < WS_STAGES - 1; ++i) {  // the first three stages
            if (i < n) ws_load_stage(stages + i * WS_STAGE, cache, pt, page_size, (t_begin + i) * WS_KEYS, S, t128);
            cp_commit();
        }
        cp_wait<WS_STAGES - 2>();  // stage 0 landed
        fence_async_smem();
        mbar_arrive(&full[0]);
        for (int tt = 0; tt < n; ++tt) {
            const int st = tt % WS_STAGES;
            // refill the stage of tile t - 1 with tile t + 3 once every warp of both warpgroups is done with it
            // (empty: 256 arrivals; a wgmma.wait_group covers the calling warp only), then signal tile t + 1's stage
            const int nt = tt + WS_STAGES - 1;
            if (nt < n) {
                if (tt > 0) mbar_wait(&empty[(tt - 1) % WS_STAGES], ((tt - 1) / WS_STAGES) & 1);
                ws_load_stage(stages + (nt % WS_STAGES) * WS_STAGE, cache, pt, page_size, (t_begin + nt) * WS_KEYS, S,
                              t128);
            }
            cp_commit();
            cp_wait<WS_STAGES - 2>();  // tile t + 1 landed
            if (tt + 1 < n) {
                fence_async_smem();
                mbar_arrive(&full[(tt + 1) % WS_STAGES]);
            }
            mbar_wait(pfull, tt & 1);  // P(t) and alpha(t)
            const float a0 = alpha_s[r0], a1 = alpha_s[r0 + 8];
            rescale_rows(o, a0, a1);
            issue_pv<2>(o, p_addr, smem_addr(stages + st * WS_STAGE) + 4 * WS_ATOM, WS_ATOM);  // V: atoms 4..7
            wg_wait<0>();
            wg_pin(o);
            mbar_arrive(pempty);
            mbar_arrive(&empty[st]);  // this warp is done with tile t's stage
        }
        cp_wait<0>();
    }
    blk.store_o(o, ws_o);
}
#endif  // KDTREE_WGMMA
