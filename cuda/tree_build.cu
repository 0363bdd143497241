// tree_build.cu: draft logits -> DDTree verify blocks, on the GPU, for a whole batch.
//
// Golden twin: kdtree/ops/tree_golden.py  topk_logprobs + build_tree + compile_tree + pack_mask_bits.
// Wrappers: kdtree/ops/tree.py.
// Three launches, no host round trip (capturable in a CUDA graph):
// (topk_partial_small_* and topk_merge_small, below, serve K <= 256 under the same contracts as 1 and 2.)
//
// 1. topk_partial_{f32,bf16}   grid (n_chunks, R), block 512, chunk <= 16384 columns (32 per thread)
//      logits [R, V] (fp32, or bf16 passed as uint16), R = batch * L rows.
//      Per chunk of `chunk` columns: the chunk's top-Kc (Kc = min(K, chunk size); by value descending,
//      then token ascending) as sortable uint32 keys + token ids, listed so that the columns of any one
//      key value ascend (topk_merge relies on it), padded to K with key 0 / token -1; the chunk max
//      (float) and sum(exp(x - max)) (double).
//      cand_key/cand_tok [R, n_chunks, K]; part_max float [R, n_chunks]; part_sum double [R, n_chunks].
// 2. topk_merge                grid R, block 1024, n_chunks * K <= 16384 candidates (16 per thread)
//      The row's top-K over all candidates (radix select on the key; equal keys by token),
//      bitonic-sorted by (key descending, token ascending); lse = m + log(sum) combined in double;
//      out_tok int32 [R, K], out_lp float [R, K] = float(double(x) - lse)   (-inf stays -inf).
// 3. tree_build_c{1,2,4} / tree_build_groups   grid batch, block 256, dynamic smem = 8 * B + 256 * G
//      + 4 * (B + 1) + 4 * L * K (staged log-probabilities, when stage_lp) + 2 * (B + 1) bytes, G = ceil((B + 1) / 32)
//      Best-first search over the per-depth top-K lists (rows b*L .. b*L+L-1), budget B <= 1024, L <= 63:
//      pop the smallest (-score, depth, parent index, rank) key, emit it, push its next sibling and first
//      child; score(child) = float(score(parent) + logprob), round-to-nearest, no contraction.
//      Warp 0 runs the search; the frontier has one slot per emitted node (its next child) plus the root's:
//      _c{C} keeps slot s in lane s % 32, register s / 32 (C = G rounded up to 1, 2 or 4: B <= 127); _groups
//      keeps the slots in shared memory by groups of 32, each group's best key in one lane (a pop and the
//      popped group's refresh are one warp reduction each, whatever B). All warps then write the block.
//      N = B + 1 rows per request, root first:
//        tokens int32 [batch, N]     root_tok[b], then node tokens; padding rows repeat the root token
//        positions int32 [batch, N]  start_pos[b] + depth
//        parents int32 [batch, N]    -1 for the root and padding rows, else the parent's row
//        depths int32 [batch, N]     0 for the root and padding rows
//        scores float [batch, N]     0 for the root and padding rows
//        mask uint32 [batch, N, W]   W = ceil(N / 32); bit j%32 of word j/32 = row j is an ancestor-or-self
//        n_nodes int32 [batch]       draft nodes emitted (<= B; fewer when fewer finite prefixes exist)
#include "common.cuh"

#define FULL 0xffffffffu

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
__device__ __forceinline__ float load_logit(const uint16_t* p, size_t i) { return bf16f(p[i]); }

// exp(d) for d <= 0 in double, table-driven and without a branch: d = (64k + j) ln2/64 + r, |r| <= ln2/128,
// exp(d) = 2^k * 2^(j/64) * P6(r). Relative error ~2 ulp; d below -700 is taken as -700, whose term (~1e-304)
// cannot change a sum that holds the max's term, 1. tab[64] = 2^(j/64), filled by init_exp_table.
__device__ __forceinline__ double exp_neg_nb(double d, const double* tab) {
    d = fmax(d, -700.0);
    const double n = rint(d * 92.33248261689366);
    double r = fma(-n, 0.01083042469326756, d);
    r = fma(-n, 2.9815858269852933e-12, r);
    const int ni = (int)n, j = ni & 63, k = (ni - j) / 64;
    double p = fma(r, 1.0 / 720.0, 1.0 / 120.0);
    p = fma(r, p, 1.0 / 24.0);
    p = fma(r, p, 1.0 / 6.0);
    p = fma(r, p, 0.5);
    p = fma(r, p, 1.0);
    p = fma(r, p, 1.0);
    const double t = tab[j] * p;
    return __longlong_as_double(__double_as_longlong(t) + ((long long)k << 52));
}

__device__ void init_exp_table(double* tab) {
    for (int j = threadIdx.x; j < 64; j += blockDim.x) tab[j] = exp2((double)j / 64.0);
}

// Block-wide reductions and an exclusive scan (blockDim.x a multiple of 32, <= 1024).
__device__ float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    v = (l < nw) ? red[l] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

__device__ double block_sum(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    v = (l < nw) ? red[l] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// Exclusive prefix sum of v over the block, in thread order; *total gets the sum.
__device__ int block_exclusive_scan(int v, int* red, int* total) {
    int l = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(FULL, x, o);
        if (l >= o) x += y;
    }
    __syncthreads();
    if (l == 31) red[w] = x;
    __syncthreads();
    if (w == 0) {
        int s = (l < nw) ? red[l] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(FULL, s, o);
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

// ------------------------------------------------------------------------------- register selection
// Each thread holds up to E keys of a contiguous range of items in registers (key 0 = no item; a real
// key is never 0: f2key(-inf) = 0x007fffff). select_kth finds the want-th largest key over the block in
// three radix passes (bits 31..20, 19..8, 7..0; 4096 / 4096 / 256 bins). Before the passes, a lower
// bound: the want-th largest of every thread's top two keys, to 12 bits, is at most the answer (those
// are want distinct items), so only keys at or above it reach the histograms: a few hundred atomics
// instead of one per item. On return an item is selected when (k & mask) is above `prefix`, or equal
// to it and among the first `remaining` such items in item order; eq_count items share the prefix.
// (The bound below uses each thread's top two keys, or top four when want > 256.)
// The passes stop once the prefix's items are all needed or a pass ends at or below low_bit (the caller
// knows that keys sharing the bits above it are equal: widened bf16 keys are decided by their top 16).
struct Selection { uint32_t prefix, mask, bound; int remaining, eq_count; };

// The bin holding the want-th item counted from the top (descending) of hist[0..nb); block-uniform
// result in s_int: {bin, want - items in higher bins, items in the bin, items in all bins}.
__device__ void find_bin(const uint32_t* hist, int nb, int want, int* red, int* s_int) {
    const int per = (nb + blockDim.x - 1) / blockDim.x;
    const int a = min(nb, (int)threadIdx.x * per), e = min(nb, a + per);
    int c = 0;
    for (int t = a; t < e; ++t) c += (int)hist[nb - 1 - t];
    int total;
    const int before = block_exclusive_scan(c, red, &total);
    if (threadIdx.x == 0) { s_int[0] = 0; s_int[1] = want; s_int[2] = 0; s_int[3] = total; }
    __syncthreads();
    if (before < want && want <= before + c) {
        int cum = before;
        for (int t = a; t < e; ++t) {
            const int bin = nb - 1 - t, h = (int)hist[bin];
            if (cum + h >= want) { s_int[0] = bin; s_int[1] = want - cum; s_int[2] = h; break; }
            cum += h;
        }
    }
    __syncthreads();
}

// A lower bound (to 12 bits) on the want-th largest key: the want-th largest of every thread's top T
// keys (those are want distinct items); 0 when fewer than `want` are listed. T = 2, or 4 for want > 256.
template <int T, int E>
__device__ void top_keys(const uint32_t (&k)[E], uint32_t* hist) {
    uint32_t a[T];
#pragma unroll
    for (int q = 0; q < T; ++q) a[q] = 0u;
#pragma unroll
    for (int j = 0; j < E; ++j) {
        uint32_t x = k[j];
#pragma unroll
        for (int q = 0; q < T; ++q) { const uint32_t h = max(a[q], x); x = min(a[q], x); a[q] = h; }
    }
#pragma unroll
    for (int q = 0; q < T; ++q) if (a[q]) atomicAdd(&hist[a[q] >> 20], 1u);
}

template <int E>
__device__ uint32_t top_bound(const uint32_t (&k)[E], int want, uint32_t* hist, int* red, int* s_int) {
    for (int i = threadIdx.x; i < 4096; i += blockDim.x) hist[i] = 0u;
    __syncthreads();
    if (want > 256) top_keys<4, E>(k, hist); else top_keys<2, E>(k, hist);
    __syncthreads();
    find_bin(hist, 4096, want, red, s_int);
    const uint32_t bound = (s_int[3] >= want) ? ((uint32_t)s_int[0]) << 20 : 0u;
    __syncthreads();
    return bound;
}

// The radix passes; visit(f) calls f(key) for each of the thread's items (key 0 = none).
template <typename Visit>
__device__ Selection radix_passes(Visit visit, int want, uint32_t bound, int low_bit, uint32_t* hist, int* red,
                                  int* s_int) {
    Selection s{0u, 0u, bound, want, 0};
    const int shifts[3] = {20, 8, 0}, widths[3] = {12, 12, 8};
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = shifts[pass], nb = 1 << widths[pass];
        const uint32_t bm = (uint32_t)nb - 1u;
        for (int i = threadIdx.x; i < nb; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        visit([&](uint32_t v) {
            if (v != 0u && v >= s.bound && (v & s.mask) == s.prefix) atomicAdd(&hist[(v >> shift) & bm], 1u);
        });
        __syncthreads();
        find_bin(hist, nb, s.remaining, red, s_int);
        s.prefix |= ((uint32_t)s_int[0]) << shift;
        s.mask |= bm << shift;
        s.remaining = s_int[1];
        s.eq_count = s_int[2];
        __syncthreads();  // everyone has read s_int before the next pass
        if (s.remaining == s.eq_count || shift <= low_bit) break;
    }
    return s;
}

template <int E>
__device__ Selection select_kth(const uint32_t (&k)[E], int want, int low_bit, uint32_t* hist, int* red,
                                int* s_int) {
    const uint32_t bound = top_bound<E>(k, want, hist, red, s_int);
    return radix_passes([&](auto f) {
#pragma unroll
        for (int j = 0; j < E; ++j) f(k[j]);
    }, want, bound, low_bit, hist, red, s_int);
}

// Selected items in item order: every key above the prefix first, then the first `remaining` sharing
// it. Calls emit(j, slot) for each of the thread's selected registers; slots are 0..want-1.
template <int E, typename Emit>
__device__ void emit_selected(const uint32_t (&k)[E], const Selection& s, int* red, Emit emit) {
    int gt = 0, eq = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) {
        const uint32_t v = k[j], vm = v & s.mask;
        gt += (v != 0u && vm > s.prefix);
        eq += (v != 0u && vm == s.prefix);
    }
    int gt_total, eq_total;
    int gt_off = block_exclusive_scan(gt, red, &gt_total);
    int eq_off = block_exclusive_scan(eq, red, &eq_total);
#pragma unroll
    for (int j = 0; j < E; ++j) {
        const uint32_t v = k[j], vm = v & s.mask;
        if (v == 0u) continue;
        if (vm > s.prefix) { emit(j, gt_off); ++gt_off; }
        else if (vm == s.prefix) {
            if (eq_off < s.remaining) emit(j, gt_total + eq_off);
            ++eq_off;
        }
    }
}

// The want largest of the block's register items at or above bound (item order among equal keys), written
// to ok[slot] (key) / ot[slot] (col0 + the item's column offset j), slots 0..want-1.
template <int E>
__device__ __forceinline__ void select_registers(const uint32_t (&k)[E], int want, uint32_t bound, int low_bit, uint32_t* hist,
                                 int* red, int* s_int, uint32_t* ok, int32_t* ot, int col0) {
    const Selection sel = radix_passes([&](auto f) {
#pragma unroll
        for (int j = 0; j < E; ++j) f(k[j]);
    }, want, bound, low_bit, hist, red, s_int);
    emit_selected<E>(k, sel, red, [&](int j, int slot) { ok[slot] = k[j]; ot[slot] = col0 + j; });
}

// Load this thread's cnt items (keys; 0 after them), 8 at a time through 16-byte loads where `vec`
// (the range starts 16-byte aligned), else one by one; *m gets their max.
template <int E>
__device__ void load_keys(const float* p, int cnt, bool vec, uint32_t (&k)[E], float* m) {
#pragma unroll
    for (int j = 0; j < E; j += 8) {
        if (vec && j + 8 <= cnt) {
            const float4 q0 = *reinterpret_cast<const float4*>(p + j), q1 = *reinterpret_cast<const float4*>(p + j + 4);
            const float x[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
            for (int h = 0; h < 8; ++h) { k[j + h] = f2key(x[h]); *m = fmaxf(*m, x[h]); }
        } else {
#pragma unroll
            for (int h = 0; h < 8; ++h) {
                k[j + h] = 0u;
                if (j + h < cnt) { const float x = p[j + h]; k[j + h] = f2key(x); *m = fmaxf(*m, x); }
            }
        }
    }
}

template <int E>
__device__ void load_keys(const uint16_t* p, int cnt, bool vec, uint32_t (&k)[E], float* m) {
#pragma unroll
    for (int j = 0; j < E; j += 8) {
        if (vec && j + 8 <= cnt) {
            const uint4 q = *reinterpret_cast<const uint4*>(p + j);
            const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                const float x0 = __uint_as_float(w[h] << 16), x1 = __uint_as_float(w[h] & 0xffff0000u);
                k[j + 2 * h] = f2key(x0); k[j + 2 * h + 1] = f2key(x1);
                *m = fmaxf(*m, fmaxf(x0, x1));
            }
        } else {
#pragma unroll
            for (int h = 0; h < 8; ++h) {
                k[j + h] = 0u;
                if (j + h < cnt) { const float x = load_logit(p, (size_t)(j + h)); k[j + h] = f2key(x); *m = fmaxf(*m, x); }
            }
        }
    }
}

// Partial: thread t holds columns [t * w, t * w + w) of the chunk, w = a multiple of 8 <= PE.
#define PE 32
#define LIST_CAP 4096
// This thread's slice of chunk blockIdx.x of row blockIdx.y: columns [lo + t0, lo + t0 + cnt) of the chunk
// [lo, lo + n); every thread holds w columns, w = a multiple of 8 <= PE. load_chunk also starts the exp table.
struct ChunkSlice { int lo, n, w, t0, cnt; };
template <typename T>
__device__ __forceinline__ ChunkSlice load_chunk(const T* __restrict__ logits, int V, int chunk, double* tab,
                                                 uint32_t (&k)[PE], float& m) {
    ChunkSlice sl;
    const int r = blockIdx.y, c = blockIdx.x;
    sl.lo = c * chunk;
    sl.n = min(V, sl.lo + chunk) - sl.lo;
    sl.w = (((sl.n + blockDim.x - 1) / blockDim.x) + 7) & ~7;
    sl.t0 = threadIdx.x * sl.w;
    sl.cnt = max(0, min(sl.w, sl.n - sl.t0));
    const size_t base = (size_t)r * V + sl.lo + sl.t0;
    const bool vec = (V % 8) == 0 && (chunk % 8) == 0;  // then every thread's range is 16-byte aligned
    init_exp_table(tab);
    m = NEG_INF;
    load_keys<PE>(logits + base, sl.cnt, vec, k, &m);
    return sl;
}

// sum over this thread's cnt keys of exp(x - m) in double (0 when m is -inf); tab: the exp table, published
__device__ __forceinline__ double sum_exp(const uint32_t (&k)[PE], int cnt, float m, const double* tab) {
    double s = 0.0;
    if (m != NEG_INF) {
#pragma unroll
        for (int j = 0; j < PE; ++j)
            if (j < cnt) s += exp_neg_nb((double)key2f(k[j]) - (double)m, tab);
    }
    return s;
}

// Warp 0: row r's log-sum-exp from its chunks' maxima and sums (lse = m + log(sum of sum_c exp(max_c - m))), in
// double, into *lse
__device__ __forceinline__ void row_lse(const float* __restrict__ part_max, const double* __restrict__ part_sum,
                                        int r, int nch, double* lse) {
    float m = NEG_INF;
    for (int c = threadIdx.x; c < nch; c += 32) m = fmaxf(m, part_max[(size_t)r * nch + c]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    double s = 0.0;
    for (int c = threadIdx.x; c < nch; c += 32) {
        const float pm = part_max[(size_t)r * nch + c];
        if (pm != NEG_INF) s += part_sum[(size_t)r * nch + c] * exp((double)pm - (double)m);
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL, s, o);
    if (threadIdx.x == 0) *lse = (double)m + log(s);
}

// The parameters of both partial top-K implementations (logits of type T; the entry points' order)
#define TOPK_PARTIAL_PARAMS                                                                                       \
    const T* __restrict__ logits, int V, int K, int chunk, int low_bit, uint32_t* __restrict__ cand_key,          \
        int32_t* __restrict__ cand_tok, float* __restrict__ part_max, double* __restrict__ part_sum

template <typename T>
__device__ void topk_partial_impl(TOPK_PARTIAL_PARAMS) {
    __shared__ uint32_t hist[4096];
    __shared__ double tab[64];
    __shared__ float fred[32];
    __shared__ double dred[32];
    __shared__ int ired[32];
    __shared__ int s_int[4];
    __shared__ uint32_t lkey[LIST_CAP];
    __shared__ uint16_t lcol[LIST_CAP];
    const int r = blockIdx.y, c = blockIdx.x, nch = gridDim.x;
    uint32_t k[PE];
    float m;
    const ChunkSlice sl = load_chunk(logits, V, chunk, tab, k, m);
    const int lo = sl.lo, n = sl.n, t0 = sl.t0, cnt = sl.cnt;
    m = block_max(m, fred);  // its barriers also publish tab
    double s = sum_exp(k, cnt, m, tab);
    s = block_sum(s, dred);
    const size_t pidx = (size_t)r * nch + c;
    if (threadIdx.x == 0) { part_max[pidx] = m; part_sum[pidx] = s; }

    const int Kc = min(K, n);
    uint32_t* ok = cand_key + pidx * K;
    int32_t* ot = cand_tok + pidx * K;
    const uint32_t bound = top_bound<PE>(k, Kc, hist, ired, s_int);
    // Fast path: the items at or above the bound (usually a few hundred) go to a list in item order.
    int sv = 0;
#pragma unroll
    for (int j = 0; j < PE; ++j) sv += (k[j] != 0u && k[j] >= bound);
    int total;
    int off = block_exclusive_scan(sv, ired, &total);
    if (total <= LIST_CAP) {
#pragma unroll
        for (int j = 0; j < PE; ++j)
            if (k[j] != 0u && k[j] >= bound) { lkey[off] = k[j]; lcol[off] = t0 + j; ++off; }
        __syncthreads();
        const Selection sel = radix_passes([&](auto f) {
            for (int i = threadIdx.x; i < total; i += blockDim.x) f(lkey[i]);
        }, Kc, bound, low_bit, hist, ired, s_int);
        // ordered emit over the list: thread t takes list items [t * lw, t * lw + lw)
        const int lw = (total + blockDim.x - 1) / blockDim.x, la = min(total, (int)threadIdx.x * lw),
                  le = min(total, la + lw);
        int gt = 0, eq = 0;
        for (int i = la; i < le; ++i) {
            const uint32_t vm = lkey[i] & sel.mask;
            gt += vm > sel.prefix;
            eq += vm == sel.prefix;
        }
        int gt_total, eq_total;
        int gt_off = block_exclusive_scan(gt, ired, &gt_total);
        int eq_off = block_exclusive_scan(eq, ired, &eq_total);
        for (int i = la; i < le; ++i) {
            const uint32_t v = lkey[i], vm = v & sel.mask;
            if (vm > sel.prefix) { ok[gt_off] = v; ot[gt_off] = lo + lcol[i]; ++gt_off; }
            else if (vm == sel.prefix) {
                if (eq_off < sel.remaining) { ok[gt_total + eq_off] = v; ot[gt_total + eq_off] = lo + lcol[i]; }
                ++eq_off;
            }
        }
    } else {  // many ties at the bound: select over the registers
        select_registers<PE>(k, Kc, bound, low_bit, hist, ired, s_int, ok, ot, lo + t0);
    }
    for (int j = Kc + threadIdx.x; j < K; j += blockDim.x) { ok[j] = 0u; ot[j] = -1; }
}

// The f32 and bf16 (uint16, low_bit 16) entry points of a partial top-K implementation
#define TOPK_PARTIAL_ENTRIES(NAME, IMPL)                                                                          \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME##_f32(                                              \
        const float* __restrict__ logits, int V, int K, int chunk, uint32_t* cand_key, int32_t* cand_tok,         \
        float* part_max, double* part_sum) {                                                                      \
        IMPL(logits, V, K, chunk, 0, cand_key, cand_tok, part_max, part_sum);                                     \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME##_bf16(                                             \
        const uint16_t* __restrict__ logits, int V, int K, int chunk, uint32_t* cand_key, int32_t* cand_tok,      \
        float* part_max, double* part_sum) {                                                                      \
        IMPL(logits, V, K, chunk, 16, cand_key, cand_tok, part_max, part_sum);                                    \
    }
TOPK_PARTIAL_ENTRIES(topk_partial, topk_partial_impl)

// Bitonic sort, descending, of one uint64 per thread over threads [0, n), n a power of two <= blockDim.x:
// strides below 32 through warp shuffles, larger ones through shared memory buf[n].
__device__ uint64_t bitonic_desc(uint64_t v, int n, uint64_t* buf) {
    const int i = threadIdx.x;
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            uint64_t o;
            if (stride >= 32) {
                if (i < n) buf[i] = v;
                __syncthreads();
                o = (i < n) ? buf[i ^ stride] : 0ull;
                __syncthreads();
            } else {
                o = __shfl_xor_sync(FULL, v, stride);
            }
            const bool lower = (i & stride) == 0, desc = (i & size) == 0;
            v = (lower == desc) ? (v > o ? v : o) : (v < o ? v : o);
        }
    }
    return v;
}

// The merge's general selection of a row's top K from every thread's E candidate keys k (tokens at ct), sorted
// (key descending, token ascending) and written out with log-probabilities x - *lse (read after the sort's
// barriers, so a value warp 0 stored before the call is visible)
template <int E>
__device__ __forceinline__ void merge_select_write(const uint32_t (&k)[E], int K, int Kp, const int32_t* ct, int r,
                                                   const double* lse_p, uint32_t* hist, int* ired, int* s_int,
                                                   uint64_t* buf, int32_t* __restrict__ out_tok,
                                                   float* __restrict__ out_lp) {
    const Selection sel = select_kth<E>(k, K, 0, hist, ired, s_int);
    emit_selected<E>(k, sel, ired, [&](int j, int slot) {
        buf[slot] = ((uint64_t)k[j] << 32) | (uint64_t)(~(uint32_t)ct[j]); });
    __syncthreads();
    uint64_t v = (threadIdx.x < K) ? buf[threadIdx.x] : 0ull;
    __syncthreads();
    v = bitonic_desc(v, Kp, buf);
    const double lse = *lse_p;
    if (threadIdx.x < K) {
        const float x = key2f((uint32_t)(v >> 32));
        out_tok[(size_t)r * K + threadIdx.x] = (int32_t)(~(uint32_t)(v & 0xffffffffu));
        out_lp[(size_t)r * K + threadIdx.x] = (x == NEG_INF) ? NEG_INF : (float)((double)x - lse);
    }
}

// Merge: the row's candidates in chunk order; a chunk lists, for any one key value, its columns in
// ascending order, so item order among equal keys is token order and emit_selected keeps the tie-break.
#define ME 16
extern "C" __global__ void __launch_bounds__(1024) topk_merge(
    const uint32_t* __restrict__ cand_key, const int32_t* __restrict__ cand_tok,
    const float* __restrict__ part_max, const double* __restrict__ part_sum, int nch, int K, int Kp,
    int32_t* __restrict__ out_tok, float* __restrict__ out_lp) {
    __shared__ uint32_t hist[4096];
    __shared__ uint64_t buf[1024];
    __shared__ int ired[32];
    __shared__ int s_int[4];
    __shared__ double s_lse;
    const int r = blockIdx.x, M = nch * K;
    const int w = (M + blockDim.x - 1) / blockDim.x;  // <= ME
    const int t0 = threadIdx.x * w, cnt = max(0, min(w, M - t0));
    const uint32_t* ck = cand_key + (size_t)r * M + t0;
    const int32_t* ct = cand_tok + (size_t)r * M + t0;
    uint32_t k[ME];
#pragma unroll
    for (int j = 0; j < ME; ++j) k[j] = (j < cnt) ? ck[j] : 0u;  // padding candidates have key 0
    if (threadIdx.x < 32) row_lse(part_max, part_sum, r, nch, &s_lse);
    merge_select_write<ME>(k, K, Kp, ct, r, &s_lse, hist, ired, s_int, buf, out_tok, out_lp);
}

// ------------------------------------------------------------------------------ top-K for K <= 256
// topk_partial_small_{f32,bf16} and topk_merge_small: the same contracts as topk_partial / topk_merge, for
// K <= 256, with a handful of block barriers instead of ~45 (ncu, H200, batch 32: the general partial spends ~31%
// of its warp samples in the double-precision exp and ~50% in the histogram selections and their scans). Measured
// faster than the general pair at K = 16 and slower at K = 64 (ranking by counting is quadratic in the list).
//   - max and sum(exp) per thread first (a thread's terms relative to its own max), combined once per block;
//   - the lower bound is the smallest of each full warp's ceil(Kc / full warps)-th largest thread maximum
//     (together at least Kc distinct items), from a sort of the warp's 32 maxima in registers;
//   - the items at or above it go to a shared-memory list through shared atomics; a list of at most RANK_CAP
//     items is ranked by counting (rank = items with a larger key, or an equal key and a smaller column), which
//     gives the chunk's top-Kc already sorted (key descending, column ascending); a longer one (ties, -inf-heavy
//     chunks) takes the general kernel's radix selection over the registers.
// The merge's lower bound is the larger of: the largest over chunks of the chunk's smallest listed key (each
// chunk lists its top-min(K, width) keys, padding 0), and the smallest of every chunk's first ceil(K / chunks)
// listed keys (the ranked lists are sorted, so those are each chunk's best). It keeps the candidates at or above
// it and ranks them by counting (key descending, token ascending) when at most RANK_CAP survive; otherwise the
// general merge's selection.
#define RANK_CAP 1024
static_assert(RANK_CAP >= 512, "a list longer than RANK_CAP must hold more than K items (K <= 256, q <= 32)");

// Descending sort of one uint32 per lane over the warp (bitonic, shuffles only); lane 0 ends with the largest.
__device__ __forceinline__ uint32_t warp_sort_desc(uint32_t v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1)
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const uint32_t o = __shfl_xor_sync(FULL, v, stride);
            const bool lower = (lane & stride) == 0, desc = (lane & size) == 0;
            v = (lower == desc) ? max(v, o) : min(v, o);
        }
    return v;
}

template <typename T>
__device__ void topk_partial_small_impl(TOPK_PARTIAL_PARAMS) {
    __shared__ uint32_t hist[4096];
    __shared__ double tab[64];
    __shared__ float wmax[32];
    __shared__ double wsum[32];
    __shared__ uint32_t wbound[32];
    __shared__ int ired[32];
    __shared__ int s_int[4];
    __shared__ int s_cnt;
    __shared__ uint32_t s_bound;
    __shared__ uint32_t lkey[LIST_CAP];
    __shared__ uint16_t lcol[LIST_CAP];
    const int r = blockIdx.y, c = blockIdx.x, nch = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int lo = c * chunk, n = min(V, lo + chunk) - lo;
    const int w = (((n + blockDim.x - 1) / blockDim.x) + 7) & ~7;
    const int t0 = threadIdx.x * w, cnt = max(0, min(w, n - t0));
    const size_t base = (size_t)r * V + lo + t0;
    const bool vec = (V % 8) == 0 && (chunk % 8) == 0;
    init_exp_table(tab);
    if (threadIdx.x == 0) s_cnt = 0;

    uint32_t k[PE];
    float m = NEG_INF;
    load_keys<PE>(logits + base, cnt, vec, k, &m);
    uint32_t top = 0u;  // this thread's largest key (0: no item)
#pragma unroll
    for (int j = 0; j < PE; ++j) top = max(top, k[j]);
    __syncthreads();  // tab
    double s = sum_exp(k, cnt, m, tab);
    // warp: max, sum relative to it, and the bound's share
    float mw = m;
    for (int o = 16; o > 0; o >>= 1) mw = fmaxf(mw, __shfl_xor_sync(FULL, mw, o));
    double sw = (m != NEG_INF) ? s * exp_neg_nb((double)m - (double)mw, tab) : 0.0;
    for (int o = 16; o > 0; o >>= 1) sw += __shfl_xor_sync(FULL, sw, o);
    // the bound: each full warp (all 32 lanes hold columns) offers its q-th largest thread maximum, q =
    // ceil(Kc / full warps); the smallest offer has q * full >= Kc distinct items at or above it. No full
    // warp, or q > 32: no bound (0).
    const int Kc = min(K, n);
    const int full = min((int)blockDim.x, (n + w - 1) / w) >> 5;
    const int q = full > 0 ? (Kc + full - 1) / full : 33;
    const uint32_t sorted = warp_sort_desc(top);
    const uint32_t bw = q > 32 ? 0u : (warp < full ? __shfl_sync(FULL, sorted, q - 1) : 0xffffffffu);
    if (lane == 0) { wmax[warp] = mw; wsum[warp] = sw; wbound[warp] = bw; }
    __syncthreads();
    const size_t pidx = (size_t)r * nch + c;
    if (warp == 0) {
        const float wm = lane < nw ? wmax[lane] : NEG_INF;
        float M = wm;
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL, M, o));
        double S = (lane < nw && wm != NEG_INF) ? wsum[lane] * exp_neg_nb((double)wm - (double)M, tab) : 0.0;
        for (int o = 16; o > 0; o >>= 1) S += __shfl_xor_sync(FULL, S, o);
        uint32_t b = lane < nw ? wbound[lane] : 0xffffffffu;
        for (int o = 16; o > 0; o >>= 1) b = min(b, __shfl_xor_sync(FULL, b, o));
        if (lane == 0) { part_max[pidx] = M; part_sum[pidx] = (M != NEG_INF) ? S : 0.0; s_bound = b; }
    }
    __syncthreads();
    const uint32_t bound = s_bound;
    // the items at or above the bound, in any order (columns kept)
#pragma unroll
    for (int j = 0; j < PE; ++j)
        if (k[j] != 0u && k[j] >= bound) {
            const int pos = atomicAdd(&s_cnt, 1);
            if (pos < LIST_CAP) { lkey[pos] = k[j]; lcol[pos] = (uint16_t)(t0 + j); }
        }
    __syncthreads();
    const int total = s_cnt;
    uint32_t* ok = cand_key + pidx * K;
    int32_t* ot = cand_tok + pidx * K;
    if (total <= RANK_CAP) {
        for (int i = threadIdx.x; i < total; i += blockDim.x) {
            const uint32_t ki = lkey[i];
            const int ci = lcol[i];
            int rank = 0;
            for (int j = 0; j < total; ++j) {
                const uint32_t kj = lkey[j];
                rank += (kj > ki) || (kj == ki && (int)lcol[j] < ci);
            }
            if (rank < Kc) { ok[rank] = ki; ot[rank] = lo + ci; }
        }
    } else {  // many items at the bound: the general selection over the registers (item order among equals),
              // from the bound's 12-bit bin (radix_passes counts whole first-pass bins)
        select_registers<PE>(k, Kc, bound & 0xfff00000u, low_bit, hist, ired, s_int, ok, ot, lo + t0);
    }
    for (int j = Kc + threadIdx.x; j < K; j += blockDim.x) { ok[j] = 0u; ot[j] = -1; }
}

TOPK_PARTIAL_ENTRIES(topk_partial_small, topk_partial_small_impl)

#define MAX_MERGE_CHUNKS 1024
extern "C" __global__ void __launch_bounds__(1024) topk_merge_small(
    const uint32_t* __restrict__ cand_key, const int32_t* __restrict__ cand_tok,
    const float* __restrict__ part_max, const double* __restrict__ part_sum, int nch, int K, int Kp,
    int32_t* __restrict__ out_tok, float* __restrict__ out_lp) {
    __shared__ uint32_t hist[4096];
    __shared__ uint64_t buf[1024];
    __shared__ uint32_t cmin[MAX_MERGE_CHUNKS];
    __shared__ uint32_t lkey[RANK_CAP];
    __shared__ int32_t ltok[RANK_CAP];
    __shared__ int ired[32];
    __shared__ int s_int[4];
    __shared__ int s_cnt;
    __shared__ uint32_t s_bound, s_firstq;
    __shared__ double s_lse;
    const int r = blockIdx.x, M = nch * K;
    const int w = (M + blockDim.x - 1) / blockDim.x;  // <= ME
    const int t0 = threadIdx.x * w, cnt = max(0, min(w, M - t0));
    const uint32_t* ck = cand_key + (size_t)r * M + t0;
    const int32_t* ct = cand_tok + (size_t)r * M + t0;
    for (int c = threadIdx.x; c < nch; c += blockDim.x) cmin[c] = 0xffffffffu;
    if (threadIdx.x == 0) { s_cnt = 0; s_firstq = 0xffffffffu; }
    uint32_t k[ME];
#pragma unroll
    for (int j = 0; j < ME; ++j) k[j] = (j < cnt) ? ck[j] : 0u;
    if (threadIdx.x < 32) row_lse(part_max, part_sum, r, nch, &s_lse);
    __syncthreads();  // cmin, s_cnt
    {  // each chunk's smallest listed key (every chunk lists K keys, padding 0), and the smallest of the first
       // q = ceil(K / nch) keys of every chunk
        const int q = (K + nch - 1) / nch;
        int cc = -1;
        uint32_t mn = 0xffffffffu, mq = 0xffffffffu;
#pragma unroll
        for (int j = 0; j < ME; ++j) {
            if (j < cnt) {
                const int c = (t0 + j) / K;
                if (c != cc) {
                    if (cc >= 0) atomicMin(&cmin[cc], mn);
                    cc = c;
                    mn = 0xffffffffu;
                }
                mn = min(mn, k[j]);
                if ((t0 + j) - c * K < q) mq = min(mq, k[j]);
            }
        }
        if (cc >= 0) atomicMin(&cmin[cc], mn);
        atomicMin(&s_firstq, mq);
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the bound: the largest chunk minimum (that chunk's K keys are all >= it), or the
                             // smallest of the chunks' first q keys (nch * q >= K keys are >= it), whichever is larger
        uint32_t b = 0u;
        for (int c = threadIdx.x; c < nch; c += 32) b = max(b, cmin[c]);
        for (int o = 16; o > 0; o >>= 1) b = max(b, __shfl_xor_sync(FULL, b, o));
        if (threadIdx.x == 0) s_bound = max(b, s_firstq);
    }
    __syncthreads();
    const uint32_t bound = s_bound;
#pragma unroll
    for (int j = 0; j < ME; ++j)
        if (k[j] != 0u && k[j] >= bound) {
            const int pos = atomicAdd(&s_cnt, 1);
            if (pos < RANK_CAP) { lkey[pos] = k[j]; ltok[pos] = ct[j]; }
        }
    __syncthreads();
    const int total = s_cnt;
    const double lse = s_lse;
    if (total <= RANK_CAP) {
        for (int i = threadIdx.x; i < total; i += blockDim.x) {
            const uint32_t ki = lkey[i];
            const int32_t ti = ltok[i];
            int rank = 0;
            for (int j = 0; j < total; ++j) {
                const uint32_t kj = lkey[j];
                rank += (kj > ki) || (kj == ki && ltok[j] < ti);
            }
            if (rank < K) {
                const float x = key2f(ki);
                out_tok[(size_t)r * K + rank] = ti;
                out_lp[(size_t)r * K + rank] = (x == NEG_INF) ? NEG_INF : (float)((double)x - lse);
            }
        }
        return;
    }
    // many survivors (ties at the bound): the general merge's selection
    merge_select_write<ME>(k, K, Kp, ct, r, &lse, hist, ired, s_int, buf, out_tok, out_lp);
}

// ---------------------------------------------------------------------------------------- tree build
// Search key, one uint64 compared as an integer (larger = earlier): f2key(score) in the high word; below it
// 63 - depth (6 bits), 2047 - parent slot (11 bits; slot 0 = the root, slot p + 1 = node p) and
// 1023 - rank (10 bits). Every field is decodable, so a popped key is the whole node record.
__device__ __forceinline__ uint64_t tree_key(float score, int depth, int slot, int rank) {
    return ((uint64_t)f2key(score) << 32) | ((uint64_t)(63 - depth) << 21) | ((uint64_t)(2047 - slot) << 10) |
           (uint64_t)(1023 - rank);
}

// The low word's fields back: depth, parent slot, rank.
__device__ __forceinline__ void key_fields(uint32_t lo, int& depth, int& slot, int& rank) {
    depth = 63 - (int)((lo >> 21) & 63u);
    slot = 2047 - (int)((lo >> 10) & 2047u);
    rank = 1023 - (int)(lo & 1023u);
}

// Warp 0's search with the frontier in registers: slot s in lane s % 32, register s / 32 (C registers per lane;
// cheapest while C is small). Each pop is computed by the whole warp alike (the popped key is uniform); only the
// two owning lanes store, and only they refresh their best. Returns the number of nodes emitted.
template <int C>
__device__ int search_regs(const float* lp, int L, int K, int B, uint64_t* nodes, float* nsc) {
    const int lane = threadIdx.x;
    uint64_t key[C];
#pragma unroll
    for (int j = 0; j < C; ++j) key[j] = 0ull;
    if (lane == 0 && lp[0] != NEG_INF) key[0] = tree_key(lp[0], 1, 0, 0);
    uint64_t best = key[0];
    int n = 0;
    for (; n < B; ++n) {
        // warp argmax of the lanes' best keys: the high words, then the low words among the winners
        const uint32_t hi = __reduce_max_sync(FULL, (uint32_t)(best >> 32));
        const uint32_t lo = __reduce_max_sync(FULL, (uint32_t)(best >> 32) == hi ? (uint32_t)best : 0u);
        if (hi == 0u) break;  // frontier empty (a real key's high word is never 0)
        const float score = key2f(hi);
        int d, s, rk;
        key_fields(lo, d, s, rk);
        const int t = n + 1;
        const float l2 = (rk + 1 < K) ? lp[(d - 1) * K + rk + 1] : NEG_INF;  // next sibling
        const float l3 = (d < L) ? lp[d * K] : NEG_INF;                      // first child
        const float ps = nsc[s];
        const uint64_t k2 = (l2 != NEG_INF) ? tree_key(__fadd_rn(ps, l2), d, s, rk + 1) : 0ull;
        const uint64_t k3 = (l3 != NEG_INF) ? tree_key(__fadd_rn(score, l3), d + 1, t, 0) : 0ull;
        const bool own_s = lane == (s & 31), own_t = lane == (t & 31);
        const int js = s >> 5, jt = t >> 5;
#pragma unroll
        for (int j = 0; j < C; ++j) {
            if (own_s && j == js) key[j] = k2;
            if (own_t && j == jt) key[j] = k3;
        }
        if (own_s) {  // its best was popped: tree reduction over the registers
            uint64_t m[C];
#pragma unroll
            for (int j = 0; j < C; ++j) m[j] = key[j];
#pragma unroll
            for (int w = 1; w < C; w <<= 1)
#pragma unroll
                for (int j = 0; j + w < C; j += 2 * w) m[j] = m[j + w] > m[j] ? m[j + w] : m[j];
            best = m[0];
        } else if (own_t) {  // a new key in an empty slot
            best = k3 > best ? k3 : best;
        }
        if (lane == 0) { nodes[n] = ((uint64_t)hi << 32) | lo; nsc[t] = score; }
        __syncwarp();
    }
    return n;
}

// Warp 0's search with the frontier in shared memory, fk[s] for slot s, by groups of 32 slots; lane j keeps
// group j's best key in ga (lane 0 group 32's in gb), so a pop is one warp reduction over the lanes, and
// refreshing the popped slot's group is one more (over its other 31 slots, issued alongside the loads of the
// new keys' log-probabilities): the work per pop does not grow with the budget.
__device__ int search_groups(const float* lp, int L, int K, int B, uint64_t* nodes, uint64_t* fk, float* nsc) {
    const int lane = threadIdx.x;
    const uint64_t root_key = (lp[0] != NEG_INF) ? tree_key(lp[0], 1, 0, 0) : 0ull;
    if (lane == 0) fk[0] = root_key;
    uint64_t ga = (lane == 0) ? root_key : 0ull, gb = 0ull;
    __syncwarp();
    int n = 0;
    for (; n < B; ++n) {
        const uint64_t v = ga > gb ? ga : gb;
        const uint32_t hi = __reduce_max_sync(FULL, (uint32_t)(v >> 32));
        const uint32_t lo = __reduce_max_sync(FULL, (uint32_t)(v >> 32) == hi ? (uint32_t)v : 0u);
        if (hi == 0u) break;  // frontier empty
        const float score = key2f(hi);
        int d, s, rk;
        key_fields(lo, d, s, rk);
        const int t = n + 1;
        const int js = s >> 5, jt = t >> 5;
        // the popped slot's group without it (slot t, if in the group, is still empty)
        const uint64_t o = (lane == (s & 31)) ? 0ull : fk[32 * js + lane];
        const float l2 = (rk + 1 < K) ? lp[(d - 1) * K + rk + 1] : NEG_INF;  // next sibling
        const float l3 = (d < L) ? lp[d * K] : NEG_INF;                      // first child
        const float ps = nsc[s];
        const uint32_t oh = __reduce_max_sync(FULL, (uint32_t)(o >> 32));
        const uint32_t ol = __reduce_max_sync(FULL, (uint32_t)(o >> 32) == oh ? (uint32_t)o : 0u);
        const uint64_t k2 = (l2 != NEG_INF) ? tree_key(__fadd_rn(ps, l2), d, s, rk + 1) : 0ull;
        const uint64_t k3 = (l3 != NEG_INF) ? tree_key(__fadd_rn(score, l3), d + 1, t, 0) : 0ull;
        uint64_t gs = ((uint64_t)oh << 32) | ol;
        gs = k2 > gs ? k2 : gs;
        if (jt == js) gs = k3 > gs ? k3 : gs;
        if (js < 32) { if (lane == js) ga = gs; } else if (lane == 0) gb = gs;
        if (jt != js) {
            if (jt < 32) { if (lane == jt) ga = k3 > ga ? k3 : ga; } else if (lane == 0) gb = k3 > gb ? k3 : gb;
        }
        if (lane == (s & 31)) fk[s] = k2;
        if (lane == (t & 31)) fk[t] = k3;
        if (lane == 0) { nodes[n] = ((uint64_t)hi << 32) | lo; nsc[t] = score; }
        __syncwarp();
    }
    return n;
}

// C > 0: search_regs<C>; C = 0: search_groups.
template <int C>
__device__ void tree_build_impl(
    const int32_t* __restrict__ top_tok, const float* __restrict__ top_lp, int L, int K, int B, int stage_lp,
    const int32_t* __restrict__ root_tok, const int32_t* __restrict__ start_pos,
    int32_t* __restrict__ tokens, int32_t* __restrict__ positions, int32_t* __restrict__ parents,
    int32_t* __restrict__ depths, float* __restrict__ scores, uint32_t* __restrict__ mask,
    int32_t* __restrict__ n_nodes) {
    extern __shared__ uint64_t sm_tree[];
    const int b = blockIdx.x, N = B + 1, W = (N + 31) >> 5, G = (N + 31) >> 5;
    uint64_t* nodes = sm_tree;                                   // [B] popped keys, in emission order
    uint64_t* fk = nodes + B;                                    // [32 G] frontier keys by slot (0 = none)
    float* nsc = (float*)(fk + 32 * G);                          // [B + 1] slot scores (slot 0 = the root)
    float* lp_s = nsc + N;                                       // [L * K] when staged
    int16_t* prow = (int16_t*)(lp_s + (stage_lp ? L * K : 0));   // [N] parent row of each verify row
    __shared__ int s_n;
    const int32_t* tt = top_tok + (size_t)b * L * K;
    const float* lp = top_lp + (size_t)b * L * K;
    if (stage_lp) {
        for (int i = threadIdx.x; i < L * K; i += blockDim.x) lp_s[i] = lp[i];
        lp = lp_s;
    }
    if (C == 0)
        for (int i = threadIdx.x; i < 32 * G; i += blockDim.x) fk[i] = 0ull;
    if (threadIdx.x == 0) nsc[0] = 0.0f;
    __syncthreads();
    if (threadIdx.x < 32) {
        int n;
        if constexpr (C > 0) n = search_regs<C>(lp, L, K, B, nodes, nsc);
        else n = search_groups(lp, L, K, B, nodes, fk, nsc);
        if (threadIdx.x == 0) s_n = n;
    }
    __syncthreads();
    const int n = s_n;
    const int32_t root = root_tok[b], sp = start_pos[b];
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const size_t o = (size_t)b * N + i;
        if (i >= 1 && i <= n) {
            const uint64_t k = nodes[i - 1];
            const uint32_t lo = (uint32_t)k;
            int d, s, rk;
            key_fields(lo, d, s, rk);
            tokens[o] = tt[(d - 1) * K + rk]; positions[o] = sp + d; parents[o] = s;  // slot s = row s
            depths[o] = d; scores[o] = key2f((uint32_t)(k >> 32)); prow[i] = (int16_t)s;
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

#define TREE_BUILD(NAME, C)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                \
        const int32_t* top_tok, const float* top_lp, int L, int K, int B, int stage_lp,                    \
        const int32_t* root_tok, const int32_t* start_pos, int32_t* tokens, int32_t* positions,            \
        int32_t* parents, int32_t* depths, float* scores, uint32_t* mask, int32_t* n_nodes) {              \
        tree_build_impl<C>(top_tok, top_lp, L, K, B, stage_lp, root_tok, start_pos, tokens, positions,     \
                           parents, depths, scores, mask, n_nodes);                                        \
    }
TREE_BUILD(tree_build_c1, 1)
TREE_BUILD(tree_build_c2, 2)
TREE_BUILD(tree_build_c4, 4)
TREE_BUILD(tree_build_groups, 0)
