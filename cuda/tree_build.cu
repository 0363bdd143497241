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
// 3. tree_build                grid batch, block 128, dynamic smem from B and C (tree_smem_bytes in kernels.py)
//      Best-first search over the per-depth top-K lists (rows b*L .. b*L+L-1), budget B <= 1024, L <= 63:
//      pop the smallest (-score, depth, rank path) key, emit it, push its next sibling and first child;
//      score(child) = float(score(parent) + logprob), round-to-nearest, no contraction. Warp 0 runs the
//      search over a frontier of 32 * C slots (C = ceil((2B + 1) / 32) + 1); all warps write the block. N = B + 1 rows per request, root first:
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
// restricted to elements for which `get` reports ok; *remaining_out = how many elements equal to the
// result are still needed (want - count of larger ones). `descending` false selects the want-th smallest.
// Histogram atomics are aggregated per warp (__match_any_sync); warp 0 searches the 256 bins in parallel.
template <typename Get>
__device__ uint32_t radix_select(int n, int want, bool descending, Get get, uint32_t* hist, int* s_int,
                                 int* remaining_out) {
    const int lane = threadIdx.x & 31;
    uint32_t prefix = 0, mask = 0;
    int remaining = want;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += blockDim.x) {
            const int i = base + threadIdx.x;
            bool ok = false;
            uint32_t k = 0;
            if (i < n) k = get(i, &ok);
            ok = ok && (k & mask) == prefix;
            const uint32_t bin = ok ? (k >> shift) & 255u : 0xffffffffu;
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (ok && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (uint32_t)__popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            int c[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int t = lane * 8 + j, bin = descending ? 255 - t : t;
                c[j] = (int)hist[bin];
                tot += c[j];
            }
            int incl = tot;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            const int excl = incl - tot;
            const unsigned owner = __ballot_sync(0xffffffffu, excl < remaining && remaining <= incl);
            if (lane == __ffs(owner) - 1) {
                int cum = excl;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (cum + c[j] >= remaining) {
                        const int t = lane * 8 + j;
                        s_int[0] = descending ? 255 - t : t;
                        s_int[1] = remaining - cum;
                        break;
                    }
                    cum += c[j];
                }
            }
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
// One warp runs the best-first search. The frontier lives in shared memory, lane l owning slots
// [l*C, (l+1)*C) (pushes go to lanes round-robin; popped slots get key 0). Each pop: every lane scans its
// own slots, then a warp butterfly finds the best entry. key = f2key(score) << 32 | (63 - depth) << 26, so
// one 64-bit compare settles score and depth; equal keys fall back to the rank-path walk.
struct Tree {
    uint64_t* f_key; int16_t* f_par; int16_t* f_rank;                          // frontier [32 * C]
    float* n_score; int32_t* n_tok; int16_t* n_par; int16_t* n_rank; int8_t* n_depth;  // nodes [B]
};

__device__ __forceinline__ bool better(const Tree& t, uint64_t ka, int sa, uint64_t kb, int sb) {
    if (ka != kb) return ka > kb;
    if (ka == 0ull || sa == sb) return false;
    int pa = t.f_par[sa], pb = t.f_par[sb], ra = t.f_rank[sa], rb = t.f_rank[sb];
    while (pa != pb) { ra = t.n_rank[pa]; rb = t.n_rank[pb]; pa = t.n_par[pa]; pb = t.n_par[pb]; }
    return ra < rb;
}

__device__ __forceinline__ uint64_t entry_key(float score, int depth) {
    return ((uint64_t)f2key(score) << 32) | ((uint64_t)(63 - depth) << 26);
}

extern "C" __global__ void __launch_bounds__(128) tree_build(
    const int32_t* __restrict__ top_tok, const float* __restrict__ top_lp, int L, int K, int B, int C, int stage_lp,
    const int32_t* __restrict__ root_tok, const int32_t* __restrict__ start_pos,
    int32_t* __restrict__ tokens, int32_t* __restrict__ positions, int32_t* __restrict__ parents,
    int32_t* __restrict__ depths, float* __restrict__ scores, uint32_t* __restrict__ mask,
    int32_t* __restrict__ n_nodes) {
    extern __shared__ uint64_t sm_tree[];
    const int b = blockIdx.x, N = B + 1, W = (N + 31) >> 5, F = 32 * C;
    Tree t;
    t.f_key = sm_tree;
    t.n_score = (float*)(t.f_key + F);
    t.n_tok = (int32_t*)(t.n_score + B);
    float* lp_s = (float*)(t.n_tok + B);           // [L * K] when staged
    t.f_par = (int16_t*)(lp_s + (stage_lp ? L * K : 0));
    t.f_rank = t.f_par + F;
    t.n_par = t.f_rank + F;
    t.n_rank = t.n_par + B;
    int16_t* prow = t.n_rank + B;  // parent row of each verify row [N]
    t.n_depth = (int8_t*)(prow + N);
    __shared__ int s_n;
    const int32_t* tt = top_tok + (size_t)b * L * K;
    const float* lp = top_lp + (size_t)b * L * K;
    if (stage_lp) {
        for (int i = threadIdx.x; i < L * K; i += blockDim.x) lp_s[i] = lp[i];
        __syncthreads();
        lp = lp_s;
    }

    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int cnt = 0, pushes = 0, n = 0;
        uint64_t mk = 0ull;  // this lane's best entry (key, slot)
        int ms = -1;
        auto push = [&](uint64_t key, int par, int rank) {
            if (lane == (pushes & 31)) {
                const int sl = lane * C + cnt++;
                t.f_key[sl] = key; t.f_par[sl] = (int16_t)par; t.f_rank[sl] = (int16_t)rank;
                if (better(t, key, sl, mk, ms)) { mk = key; ms = sl; }
            }
            ++pushes;
        };
        if (lp[0] != NEG_INF) push(entry_key(lp[0], 1), -1, 0);
        __syncwarp();
        while (n < B) {
            uint64_t bk = mk;
            int bs = ms;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const uint64_t ok = __shfl_xor_sync(0xffffffffu, bk, o);
                const int os = __shfl_xor_sync(0xffffffffu, bs, o);
                if (better(t, ok, os, bk, bs)) { bk = ok; bs = os; }
            }
            if (bk == 0ull) break;
            const float sc = key2f((uint32_t)(bk >> 32));
            const int d = 63 - (int)((bk >> 26) & 63ull), par = t.f_par[bs], r = t.f_rank[bs];
            const int idx = n++, owner = bs / C;
            __syncwarp();
            if (lane == 0) {
                t.f_key[bs] = 0ull;
                t.n_score[idx] = sc; t.n_par[idx] = (int16_t)par; t.n_rank[idx] = (int16_t)r; t.n_depth[idx] = (int8_t)d;
            }
            __syncwarp();
            // the owner's new best: a short lane rescans its slots alone; a long one is rescanned by the warp
            if (C <= 16) {
                if (lane == owner) {
                    mk = 0ull; ms = -1;
                    for (int i = 0; i < cnt; ++i) {
                        const int sl = lane * C + i;
                        const uint64_t k = t.f_key[sl];
                        if (better(t, k, sl, mk, ms)) { mk = k; ms = sl; }
                    }
                }
            } else {
                const int ocnt = __shfl_sync(0xffffffffu, cnt, owner);
                uint64_t rk = 0ull;
                int rs = -1;
                for (int i = lane; i < ocnt; i += 32) {
                    const int sl = owner * C + i;
                    const uint64_t k = t.f_key[sl];
                    if (better(t, k, sl, rk, rs)) { rk = k; rs = sl; }
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const uint64_t ok = __shfl_xor_sync(0xffffffffu, rk, o);
                    const int os = __shfl_xor_sync(0xffffffffu, rs, o);
                    if (better(t, ok, os, rk, rs)) { rk = ok; rs = os; }
                }
                if (lane == owner) { mk = rk; ms = rs; }
            }
            if (r + 1 < K) {
                const float l2 = lp[(d - 1) * K + r + 1];
                if (l2 != NEG_INF) push(entry_key(__fadd_rn(par >= 0 ? t.n_score[par] : 0.0f, l2), d), par, r + 1);
            }
            if (d < L) {
                const float l3 = lp[d * K];
                if (l3 != NEG_INF) push(entry_key(__fadd_rn(sc, l3), d + 1), idx, 0);
            }
            __syncwarp();
        }
        if (lane == 0) s_n = n;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < s_n; i += blockDim.x) t.n_tok[i] = tt[(t.n_depth[i] - 1) * K + t.n_rank[i]];
    __syncthreads();
    const int n = s_n;
    const int32_t root = root_tok[b], sp = start_pos[b];
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const size_t o = (size_t)b * N + i;
        if (i >= 1 && i <= n) {
            const int k = i - 1, pr = t.n_par[k] + 1;  // the root's children get row 0
            tokens[o] = t.n_tok[k]; positions[o] = sp + t.n_depth[k]; parents[o] = pr;
            depths[o] = t.n_depth[k]; scores[o] = t.n_score[k]; prow[i] = (int16_t)pr;
        } else {
            tokens[o] = root; positions[o] = sp; parents[o] = -1; depths[o] = 0; scores[o] = 0.0f;
            prow[i] = -1;
        }
    }
    __syncthreads();
    for (int q = threadIdx.x; q < N * W; q += blockDim.x) {
        const int i = q / W, w = q - i * W;
        uint32_t bits = 0;
        for (int j = i; j >= 0; j = (i <= n) ? prow[j] : -1)
            if ((j >> 5) == w) bits |= 1u << (j & 31);
        mask[(size_t)b * N * W + q] = bits;
    }
    if (threadIdx.x == 0) n_nodes[b] = n;
}
