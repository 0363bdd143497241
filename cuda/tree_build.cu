// tree_build.cu: draft logits -> DDTree verify blocks, on the GPU, for a whole batch.
//
// Golden twin: kdtree/golden.py  topk_logprobs + build_tree + compile_tree + pack_mask_bits.
// Three launches, no host round trip (capturable in a CUDA graph):
//
// 1. topk_partial_{f32,bf16}   grid (n_chunks, R), block 512, dynamic smem = chunk * 4 bytes
//      logits [R, V] (fp32, or bf16 passed as uint16), R = batch * L rows.
//      Per chunk of `chunk` columns: the chunk's top-Kc (Kc = min(K, chunk size); by value descending,
//      then token ascending) as sortable uint32 keys + token ids, unordered, padded to K with key 0 /
//      token -1; the chunk max (float) and sum(exp(x - max)) (double).
//      cand_key/cand_tok [R, n_chunks, K]; part_max float [R, n_chunks]; part_sum double [R, n_chunks].
// 2. topk_merge                grid R, block 1024, dynamic smem = n_chunks * K * 8 + K_pow2 * 8 bytes
//      The row's top-K over all candidates (radix select on the key, then on the token among equal keys),
//      bitonic-sorted by (key descending, token ascending); lse = m + log(sum) combined in double;
//      out_tok int32 [R, K], out_lp float [R, K] = float(double(x) - lse)   (-inf stays -inf).
// 3. tree_build                grid batch, block 256, dynamic smem from B (see tree_smem_bytes in kernels.py)
//      Best-first search over the per-depth top-K lists (rows b*L .. b*L+L-1), budget B <= 1024:
//      pop the smallest (-score, depth, rank path) key, emit it, push its next sibling and first child;
//      score(child) = float(score(parent) + logprob), round-to-nearest, no contraction. One thread runs
//      the heap; all threads write the verify block. N = B + 1 rows per request, root first:
//        tokens int32 [batch, N]     root_tok[b], then node tokens; padding rows repeat the root token
//        positions int32 [batch, N]  start_pos[b] + depth
//        parents int32 [batch, N]    -1 for the root and padding rows, else the parent's row
//        depths int32 [batch, N]     0 for the root and padding rows
//        scores float [batch, N]     0 for the root and padding rows
//        mask uint32 [batch, N, W]   W = ceil(N / 32); bit j%32 of word j/32 = row j is an ancestor-or-self
//        n_nodes int32 [batch]       draft nodes emitted (<= B; fewer when fewer finite prefixes exist)
#include "common.cuh"

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ uint32_t f2key(float x) {
    if (x == 0.0f) x = 0.0f;  // -0 and +0 are one value, as in numpy
    uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key2f(uint32_t k) {
    uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    return __uint_as_float(b);
}

__device__ __forceinline__ float load_logit(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load_logit(const uint16_t* p, size_t i) {
    return __uint_as_float(((uint32_t)p[i]) << 16);  // bf16 -> fp32 exactly
}

// Block-wide reductions and an exclusive scan (blockDim.x a multiple of 32, <= 1024).
__device__ float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    v = (l < nw) ? red[l] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ double block_sum(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    v = (l < nw) ? red[l] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Exclusive prefix sum of v over the block, in thread order; *total gets the sum.
__device__ int block_exclusive_scan(int v, int* red, int* total) {
    int l = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (l >= o) x += y;
    }
    __syncthreads();
    if (l == 31) red[w] = x;
    __syncthreads();
    if (w == 0) {
        int s = (l < nw) ? red[l] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, s, o);
            if (l >= o) s += y;
        }
        if (l < nw) red[l] = s;  // inclusive warp totals
    }
    __syncthreads();
    int before = (w > 0 ? red[w - 1] : 0) + x - v;
    *total = red[nw - 1];
    __syncthreads();
    return before;
}

// Radix select over keys[0..n) in shared memory: the key of the `want`-th largest element (1-based),
// restricted to elements for which `active(i)` holds; *remaining = how many elements equal to the result
// are still needed (want - count of larger ones). `descending` false selects the want-th smallest.
template <typename Get>
__device__ uint32_t radix_select(int n, int want, bool descending, Get get, uint32_t* hist, int* s_int,
                                 int* remaining_out) {
    uint32_t prefix = 0, mask = 0;
    int remaining = want;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            bool ok;
            uint32_t k = get(i, &ok);
            if (ok && (k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int cum = 0, sel = descending ? 0 : 255;
            for (int t = 0; t < 256; ++t) {
                int b = descending ? 255 - t : t;
                int h = (int)hist[b];
                if (cum + h >= remaining) { sel = b; break; }
                cum += h;
            }
            s_int[0] = sel;
            s_int[1] = remaining - cum;
        }
        __syncthreads();
        prefix |= ((uint32_t)s_int[0]) << shift;
        mask |= 255u << shift;
        remaining = s_int[1];
        __syncthreads();
    }
    *remaining_out = remaining;
    return prefix;
}

template <typename T>
__device__ void topk_partial_impl(const T* __restrict__ logits, int V, int K, int chunk,
                                  uint32_t* __restrict__ cand_key, int32_t* __restrict__ cand_tok,
                                  float* __restrict__ part_max, double* __restrict__ part_sum) {
    extern __shared__ uint32_t skeys[];
    __shared__ uint32_t hist[256];
    __shared__ float fred[32];
    __shared__ double dred[32];
    __shared__ int ired[32];
    __shared__ int s_int[2];
    const int r = blockIdx.y, c = blockIdx.x, nch = gridDim.x;
    const int lo = c * chunk, n = min(V, lo + chunk) - lo;
    const size_t base = (size_t)r * V + lo;

    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float x = load_logit(logits, base + i);
        skeys[i] = f2key(x);
        m = fmaxf(m, x);
    }
    m = block_max(m, fred);
    double s = 0.0;
    if (m != NEG_INF)
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += exp((double)key2f(skeys[i]) - (double)m);
    s = block_sum(s, dred);
    const size_t pidx = (size_t)r * nch + c;
    if (threadIdx.x == 0) { part_max[pidx] = m; part_sum[pidx] = s; }

    const int Kc = min(K, n);
    int need_eq;
    uint32_t thr = radix_select(n, Kc, true, [&](int i, bool* ok) { *ok = true; return skeys[i]; }, hist, s_int,
                              &need_eq);
    // Ordered selection: every key > T, then the first need_eq keys == T by index.
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int a = min(n, (int)threadIdx.x * per), e = min(n, a + per);
    int gt = 0, eq = 0;
    for (int i = a; i < e; ++i) { gt += skeys[i] > thr; eq += skeys[i] == thr; }
    int gt_total, eq_total;
    int gt_off = block_exclusive_scan(gt, ired, &gt_total);
    int eq_off = block_exclusive_scan(eq, ired, &eq_total);
    uint32_t* ok = cand_key + pidx * K;
    int32_t* ot = cand_tok + pidx * K;
    for (int i = a; i < e; ++i) {
        uint32_t k = skeys[i];
        if (k > thr) { ok[gt_off] = k; ot[gt_off] = lo + i; ++gt_off; }
        else if (k == thr) {
            if (eq_off < need_eq) { ok[gt_total + eq_off] = k; ot[gt_total + eq_off] = lo + i; }
            ++eq_off;
        }
    }
    for (int j = Kc + threadIdx.x; j < K; j += blockDim.x) { ok[j] = 0u; ot[j] = -1; }
}

extern "C" __global__ void __launch_bounds__(512) topk_partial_f32(
    const float* __restrict__ logits, int V, int K, int chunk, uint32_t* cand_key, int32_t* cand_tok,
    float* part_max, double* part_sum) {
    topk_partial_impl(logits, V, K, chunk, cand_key, cand_tok, part_max, part_sum);
}

extern "C" __global__ void __launch_bounds__(512) topk_partial_bf16(
    const uint16_t* __restrict__ logits, int V, int K, int chunk, uint32_t* cand_key, int32_t* cand_tok,
    float* part_max, double* part_sum) {
    topk_partial_impl(logits, V, K, chunk, cand_key, cand_tok, part_max, part_sum);
}

extern "C" __global__ void __launch_bounds__(1024) topk_merge(
    const uint32_t* __restrict__ cand_key, const int32_t* __restrict__ cand_tok,
    const float* __restrict__ part_max, const double* __restrict__ part_sum, int nch, int K, int Kp,
    int32_t* __restrict__ out_tok, float* __restrict__ out_lp) {
    extern __shared__ uint64_t sm64[];
    uint64_t* sorted = sm64;                                  // [Kp]
    uint32_t* keys = (uint32_t*)(sm64 + Kp);                  // [M]
    int32_t* toks = (int32_t*)(keys + (size_t)nch * K);       // [M]
    __shared__ uint32_t hist[256];
    __shared__ int s_int[2];
    __shared__ int s_count;
    __shared__ double s_lse;
    const int r = blockIdx.x, M = nch * K;
    for (int i = threadIdx.x; i < M; i += blockDim.x) {
        keys[i] = cand_key[(size_t)r * M + i];
        toks[i] = cand_tok[(size_t)r * M + i];
    }
    if (threadIdx.x == 0) {
        float m = NEG_INF;
        for (int c = 0; c < nch; ++c) m = fmaxf(m, part_max[(size_t)r * nch + c]);
        double s = 0.0;
        for (int c = 0; c < nch; ++c) {
            float pm = part_max[(size_t)r * nch + c];
            if (pm != NEG_INF) s += part_sum[(size_t)r * nch + c] * exp((double)pm - (double)m);
        }
        s_lse = (double)m + log(s);
        s_count = 0;
    }
    __syncthreads();
    int need_eq;
    uint32_t T = radix_select(M, K, true, [&](int i, bool* ok) { *ok = true; return keys[i]; }, hist, s_int,
                              &need_eq);
    int dummy;
    uint32_t Ttok = radix_select(M, need_eq, false, [&](int i, bool* ok) {
        *ok = keys[i] == T; return (uint32_t)toks[i]; }, hist, s_int, &dummy);
    for (int i = threadIdx.x; i < Kp; i += blockDim.x) sorted[i] = 0ull;
    __syncthreads();
    for (int i = threadIdx.x; i < M; i += blockDim.x) {
        uint32_t k = keys[i];
        if (k > T || (k == T && (uint32_t)toks[i] <= Ttok)) {
            int slot = atomicAdd(&s_count, 1);
            sorted[slot] = ((uint64_t)k << 32) | (uint64_t)(~(uint32_t)toks[i]);
        }
    }
    __syncthreads();
    // bitonic sort, descending
    for (int size = 2; size <= Kp; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < Kp; i += blockDim.x) {
                int j = i ^ stride;
                if (j > i) {
                    bool desc = (i & size) == 0;
                    uint64_t x = sorted[i], y = sorted[j];
                    if (desc ? (x < y) : (x > y)) { sorted[i] = y; sorted[j] = x; }
                }
            }
            __syncthreads();
        }
    }
    const double lse = s_lse;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        uint64_t v = sorted[i];
        float x = key2f((uint32_t)(v >> 32));
        out_tok[(size_t)r * K + i] = (int32_t)(~(uint32_t)(v & 0xffffffffu));
        out_lp[(size_t)r * K + i] = (x == NEG_INF) ? NEG_INF : (float)((double)x - lse);
    }
}

// ---------------------------------------------------------------------------------------- tree build
struct TreeSmem {
    float* h_score; int16_t* h_par; int16_t* h_rank; int8_t* h_depth;   // heap [B + 2]
    float* n_score; int16_t* n_par; int16_t* n_rank; int8_t* n_depth; int32_t* n_tok;  // nodes [B]
};

// Does heap entry a sort before entry b?  (-score, depth, rank path) ascending.
__device__ __forceinline__ bool before(const TreeSmem& s, float sa, int da, int pa, int ra, float sb, int db,
                                       int pb, int rb) {
    if (sa != sb) return sa > sb;
    if (da != db) return da < db;
    while (pa != pb) { ra = s.n_rank[pa]; rb = s.n_rank[pb]; pa = s.n_par[pa]; pb = s.n_par[pb]; }
    return ra < rb;
}

__device__ __forceinline__ bool heap_before(const TreeSmem& s, int i, int j) {
    return before(s, s.h_score[i], s.h_depth[i], s.h_par[i], s.h_rank[i], s.h_score[j], s.h_depth[j], s.h_par[j],
                  s.h_rank[j]);
}

__device__ __forceinline__ void heap_swap(const TreeSmem& s, int i, int j) {
    float f = s.h_score[i]; s.h_score[i] = s.h_score[j]; s.h_score[j] = f;
    int16_t p = s.h_par[i]; s.h_par[i] = s.h_par[j]; s.h_par[j] = p;
    int16_t q = s.h_rank[i]; s.h_rank[i] = s.h_rank[j]; s.h_rank[j] = q;
    int8_t d = s.h_depth[i]; s.h_depth[i] = s.h_depth[j]; s.h_depth[j] = d;
}

__device__ void heap_push(const TreeSmem& s, int& size, float score, int par, int rank, int depth) {
    int i = size++;
    s.h_score[i] = score; s.h_par[i] = (int16_t)par; s.h_rank[i] = (int16_t)rank; s.h_depth[i] = (int8_t)depth;
    while (i > 0) {
        int p = (i - 1) >> 1;
        if (!heap_before(s, i, p)) break;
        heap_swap(s, i, p);
        i = p;
    }
}

__device__ void heap_pop(const TreeSmem& s, int& size) {
    --size;
    if (size == 0) return;
    s.h_score[0] = s.h_score[size]; s.h_par[0] = s.h_par[size];
    s.h_rank[0] = s.h_rank[size]; s.h_depth[0] = s.h_depth[size];
    int i = 0;
    while (true) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < size && heap_before(s, l, m)) m = l;
        if (r < size && heap_before(s, r, m)) m = r;
        if (m == i) break;
        heap_swap(s, i, m);
        i = m;
    }
}

extern "C" __global__ void __launch_bounds__(256) tree_build(
    const int32_t* __restrict__ top_tok, const float* __restrict__ top_lp, int L, int K, int B,
    const int32_t* __restrict__ root_tok, const int32_t* __restrict__ start_pos,
    int32_t* __restrict__ tokens, int32_t* __restrict__ positions, int32_t* __restrict__ parents,
    int32_t* __restrict__ depths, float* __restrict__ scores, uint32_t* __restrict__ mask,
    int32_t* __restrict__ n_nodes) {
    extern __shared__ float smf[];
    const int b = blockIdx.x, N = B + 1, W = (N + 31) >> 5, H = B + 2;
    TreeSmem s;
    s.h_score = smf;
    s.n_score = s.h_score + H;
    s.n_tok = (int32_t*)(s.n_score + B);
    s.h_par = (int16_t*)(s.n_tok + B);
    s.h_rank = s.h_par + H;
    s.n_par = s.h_rank + H;
    s.n_rank = s.n_par + B;
    int16_t* prow = s.n_rank + B;                 // parent row of each verify row [N]
    s.h_depth = (int8_t*)(prow + N);
    s.n_depth = s.h_depth + H;
    __shared__ int s_n;
    const int32_t* tt = top_tok + (size_t)b * L * K;
    const float* lp = top_lp + (size_t)b * L * K;

    if (threadIdx.x == 0) {
        int size = 0, n = 0;
        if (lp[0] != NEG_INF) heap_push(s, size, lp[0], -1, 0, 1);
        while (size > 0 && n < B) {
            float sc = s.h_score[0];
            int par = s.h_par[0], r = s.h_rank[0], d = s.h_depth[0];
            heap_pop(s, size);
            int idx = n++;
            s.n_score[idx] = sc; s.n_par[idx] = (int16_t)par; s.n_rank[idx] = (int16_t)r;
            s.n_depth[idx] = (int8_t)d; s.n_tok[idx] = tt[(size_t)(d - 1) * K + r];
            if (r + 1 < K) {
                float l2 = lp[(size_t)(d - 1) * K + r + 1];
                if (l2 != NEG_INF) heap_push(s, size, __fadd_rn(par >= 0 ? s.n_score[par] : 0.0f, l2), par, r + 1, d);
            }
            if (d < L) {
                float l3 = lp[(size_t)d * K];
                if (l3 != NEG_INF) heap_push(s, size, __fadd_rn(sc, l3), idx, 0, d + 1);
            }
        }
        s_n = n;
    }
    __syncthreads();
    const int n = s_n;
    const int32_t root = root_tok[b], sp = start_pos[b];
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const size_t o = (size_t)b * N + i;
        if (i >= 1 && i <= n) {
            int k = i - 1, p = s.n_par[k] + 1;
            int pr = (s.n_par[k] >= 0) ? p : 0;
            tokens[o] = s.n_tok[k]; positions[o] = sp + s.n_depth[k]; parents[o] = pr;
            depths[o] = s.n_depth[k]; scores[o] = s.n_score[k]; prow[i] = (int16_t)pr;
        } else {
            tokens[o] = root; positions[o] = sp; parents[o] = -1; depths[o] = 0; scores[o] = 0.0f;
            prow[i] = -1;
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < N * W; t += blockDim.x) {
        int i = t / W, w = t - i * W;
        uint32_t bits = 0;
        for (int j = i; j >= 0; j = (i <= n) ? prow[j] : -1)
            if ((j >> 5) == w) bits |= 1u << (j & 31);
        mask[(size_t)b * N * W + t] = bits;
    }
    if (threadIdx.x == 0) n_nodes[b] = n;
}
