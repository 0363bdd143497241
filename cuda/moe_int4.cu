// moe_int4.cu: routed MoE experts with INT4 weights (Kimi K2 format), bf16 activations, fp32 accumulation.
//
// Golden twin: kdtree/golden.py  moe_int4 (float64, exact dequantization).
// Weights: the K2 checkpoint format (kdtree/quant.py: eight 4-bit values q + 8 per int32 along the input,
// one bf16 scale per 32 inputs, W = q * scale) reordered once by kdtree.kernels.repack_moe into mma
// fragment order, so that each lane loads exactly the bytes its A fragment needs, 8 per 32-input group:
//   wr int32 [E, R/16, K/32, 32 lanes, 2]: lane (g, c) = (lane / 4, lane % 4), word j (k-block j of the
//      group), byte b = byte c of checkpoint word 2j + b / 2 of row 16 t + g + 8 (b % 2)
//   sr bf16  [E, R/16, K/32, 8, 2]:       scales of rows 16 t + g and 16 t + g + 8
// for a matrix [R, K]: w13 is [2I, D] (rows [0, I) gate, [I, 2I) up), w2 is [D, I].
// Token-expert pairs arrive grouped by expert (the wrapper sorts them): pairs [expert_off[e], expert_off[e+1])
// belong to expert e, pair p is token pair_tok[p] with weight pair_w[p].
//
// moe_gate_up   grid (I / 16, S), block 256 (8 warps), static smem 16 KB, <= 80 registers (three blocks per
//               SM: at 99 registers two fit, and ncu measured 30% of DRAM bandwidth at 24% occupancy)
//   x         bf16 [T, D] (as uint16)            pair_tok int32 [P]     expert_off int32 [E + 1]
//   active    int32 [S]                          S = min(E, P) expert slots: the experts with pairs first
//                                                (block y serves expert active[y]; an empty one returns)
//   w13r, s13r (above, R = 2I, K = D)
//   h         bf16 [P, I]                        h[p, f] = silu(gate_f . x) * (up_f . x), token of pair p
//   A block owns 16 intermediate features (a 16-row gate tile and a 16-row up tile) of one expert; its
//   8 warps split the inputs D by groups of 32 and meet in shared memory. Tokens go 16 at a time (two
//   n8 tiles) through mma.sync m16n8k16 (bf16 in, fp32 out); A fragments are the packed bytes turned into
//   exact bf16 pairs (0x4300 | n is 128 + n; minus 136 gives n - 8); the scale multiplies each 32-input
//   group's fp32 partial sum; one set of B fragments serves both tiles; two groups' loads go out together.
// moe_down      grid (D / 16, S), block 256, static smem 8 KB
//   h as above; pair_w float [P]; w2r, s2r (R = D, K = I)
//   out       float [T, D], accumulated:  out[t, d] += pair_w[p] * (down_d . h[p]) for every pair of t
//   (the wrapper zeroes it; fp32 atomics, so the summation order of a token's experts may vary).
// moe_gate_up_pipe / moe_down_pipe   the same contracts, launch shapes and outputs as moe_gate_up / moe_down;
//   each lane streams its own fragment bytes (A words, scales, B pairs) through a 4-stage ring in shared memory
//   with cp.async (lane-private: no barrier), so three groups per warp are in flight instead of one or two
//   in registers. Dynamic smem: 8 warps x STAGES x (TILES x 384 + NT x 512) bytes (kernels.MOE_PIPE_SMEM).
// moe_group_i32 / moe_group_i64   grid 1, block 1024, dynamic smem 8 E bytes (E <= 4096)
//   ids       int32 or int64 [P] (topk_ids flattened, P = T * k, pair p is token p / k)   w float [P]
//   pair_tok  int32 [P], pair_w float [P]: the pairs grouped by expert; the order WITHIN an expert is
//             unspecified (shared-memory atomics); expert_off int32 [E + 1]: expert e owns [off[e], off[e+1]);
//             active int32 [S], S = min(E, P): the experts with pairs by id, then the empty ones by id.
//   Ids outside [0, E) are dropped (kdtree.kernels rejects them before launch unless told not to check).
//   Golden twin: kdtree/golden.py group_pairs (stable order: compare within an expert as multisets).
// Shapes: D % 32 == 0, I % 32 == 0 (checked by kdtree.kernels).
#include <cuda_bf16.h>
#include "common.cuh"

#define NT 2            // n8 token tiles per pass: 16 tokens
#define WARPS 8

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// byte b of a fragment word (inputs 2c, 2c + 1 of one row's eight) -> bf16x2 (q_lo, q_hi), exact
template <int B>
__device__ __forceinline__ uint32_t deq_pair(uint32_t word) {
    const uint32_t v = ((word >> (8 * B)) & 0x0fu) | (((word >> (8 * B)) & 0xf0u) << 12) | 0x43004300u;
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __float2bfloat162_rn(136.0f));
    return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ float bf16f(uint32_t v16) { return __uint_as_float(v16 << 16); }

__device__ __forceinline__ uint32_t ld_pair(const uint16_t* row, int k) {  // two bf16 at k, k + 1 (k even)
    return row ? __ldg(reinterpret_cast<const uint32_t*>(row + k)) : 0u;
}

// This thread's B fragments of one 32-input group for NT n8 token tiles: xr[nt] is its token row
// (token nt * 8 + lane / 4) or null; b[nt] = inputs (2c, 2c+1), (2c+8, +9), (2c+16, +17), (2c+24, +25).
__device__ __forceinline__ void load_b(uint32_t (*b)[4], const uint16_t* const* xr, int grp) {
    const int k0 = grp * 32 + 2 * (threadIdx.x & 3);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) b[nt][j] = ld_pair(xr[nt], k0 + 8 * j);
}

// This thread's B-fragment rows for a pass of 16 pairs from pc (token nt * 8 + lane / 4 of the pass): row
// base + id * ld, id = pair_tok[p] (a token's activations) or p itself (the pair's workspace row); null past p1.
__device__ __forceinline__ void pass_rows(const uint16_t** r, const uint16_t* base, int ld, const int32_t* pair_tok,
                                          int pc, int p1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int p = pc + nt * 8 + ((threadIdx.x & 31) >> 2);
        r[nt] = p < p1 ? base + (size_t)(pair_tok ? pair_tok[p] : p) * ld : nullptr;
    }
}

// One tile's fragment bytes and scales for one group: 8 bytes + 4 bytes per lane.
struct AFrag { uint2 w; uint32_t s; };

__device__ __forceinline__ AFrag load_a(const int32_t* Wt, const uint16_t* St, int grp) {
    const int lane = threadIdx.x & 31;
    AFrag f;
    f.w = __ldg(reinterpret_cast<const uint2*>(Wt + (size_t)grp * 64 + lane * 2));
    f.s = __ldg(reinterpret_cast<const uint32_t*>(St + (size_t)grp * 16 + (lane >> 2) * 2));
    return f;
}

// acc += scale * (q . x) for one group of a 16-row tile; acc[nt] = (row g: tokens 2c, 2c+1; row g+8: same)
__device__ __forceinline__ void mma_group(float (*acc)[4], const AFrag& f, const uint32_t (*b)[4]) {
    const uint32_t a0[4] = {deq_pair<0>(f.w.x), deq_pair<1>(f.w.x), deq_pair<2>(f.w.x), deq_pair<3>(f.w.x)};
    const uint32_t a1[4] = {deq_pair<0>(f.w.y), deq_pair<1>(f.w.y), deq_pair<2>(f.w.y), deq_pair<3>(f.w.y)};
    const float s0 = bf16f(f.s & 0xffffu), s1 = bf16f(f.s >> 16);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
        mma16816(t, a0, b[nt][0], b[nt][1]);
        mma16816(t, a1, b[nt][2], b[nt][3]);
        acc[nt][0] += t[0] * s0; acc[nt][1] += t[1] * s0;
        acc[nt][2] += t[2] * s1; acc[nt][3] += t[3] * s1;
    }
}

// The block's 8 warps each hold partial sums over their inputs for 16 rows x 16 pair slots: reduce them in shared
// memory, then h = silu(gate) * up as bf16 (gate_up) or out += pair weight * down (fp32 atomics).
__device__ __forceinline__ void gate_up_store(float (*red)[2][NT][128], const float (*g)[4], const float (*u)[4],
                                              int pc, int p1, int f0, int I, uint16_t* __restrict__ h) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) { red[warp][0][nt][lane * 4 + i] = g[nt][i]; red[warp][1][nt][lane * 4 + i] = u[nt][i]; }
    __syncthreads();
    for (int j = threadIdx.x; j < NT * 128; j += blockDim.x) {
        const int nt = j >> 7, q = j & 127, ln = q >> 2, i = q & 3;
        float gs = 0.f, us = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) { gs += red[w][0][nt][q]; us += red[w][1][nt][q]; }
        const int row = (ln >> 2) + ((i & 2) ? 8 : 0), tok = nt * 8 + 2 * (ln & 3) + (i & 1);
        const int p = pc + tok;
        if (p < p1) {
            const float v = gs / (1.0f + __expf(-gs)) * us;
            const __nv_bfloat16 hv = __float2bfloat16_rn(v);
            h[(size_t)p * I + f0 + row] = *reinterpret_cast<const uint16_t*>(&hv);
        }
    }
    __syncthreads();
}

__device__ __forceinline__ void down_store(float (*red)[NT][128], const float (*a)[4], int pc, int p1, int d0, int D,
                                           const int32_t* __restrict__ pair_tok, const float* __restrict__ pair_w,
                                           float* __restrict__ out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][nt][lane * 4 + i] = a[nt][i];
    __syncthreads();
    for (int j = threadIdx.x; j < NT * 128; j += blockDim.x) {
        const int nt = j >> 7, q = j & 127, ln = q >> 2, i = q & 3;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += red[w][nt][q];
        const int row = (ln >> 2) + ((i & 2) ? 8 : 0), tok = nt * 8 + 2 * (ln & 3) + (i & 1);
        const int p = pc + tok;
        if (p < p1) atomicAdd(out + (size_t)pair_tok[p] * D + d0 + row, pair_w[p] * s);
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(256, 3) moe_gate_up(
    const uint16_t* __restrict__ x, const int32_t* __restrict__ pair_tok, const int32_t* __restrict__ expert_off,
    const int32_t* __restrict__ active, const int32_t* __restrict__ w13r, const uint16_t* __restrict__ s13r, int D,
    int I, uint16_t* __restrict__ h) {
    __shared__ float red[WARPS][2][NT][128];
    const int e = active[blockIdx.y], p0 = expert_off[e], p1 = expert_off[e + 1];
    if (p0 >= p1) return;
    const int f0 = blockIdx.x * 16, warp = threadIdx.x >> 5;
    const int G = D / 32, tiles = 2 * I / 16;
    const int gb = warp * G / WARPS, ge = (warp + 1) * G / WARPS;
    const size_t tg = (size_t)e * tiles + blockIdx.x, tu = (size_t)e * tiles + I / 16 + blockIdx.x;
    const int32_t* Wg = w13r + tg * G * 64;
    const int32_t* Wu = w13r + tu * G * 64;
    const uint16_t* Sg = s13r + tg * G * 16;
    const uint16_t* Su = s13r + tu * G * 16;
    for (int pc = p0; pc < p1; pc += 8 * NT) {
        const uint16_t* xr[NT];
        pass_rows(xr, x, D, pair_tok, pc, p1);
        float ag[NT][4] = {}, au[NT][4] = {};
        for (int grp = gb; grp < ge; grp += 2) {
            const bool two = grp + 1 < ge;
            const AFrag g0 = load_a(Wg, Sg, grp), u0 = load_a(Wu, Su, grp);
            const AFrag g1 = two ? load_a(Wg, Sg, grp + 1) : g0, u1 = two ? load_a(Wu, Su, grp + 1) : u0;
            uint32_t b0[NT][4], b1[NT][4];
            load_b(b0, xr, grp);  // shared by the gate and up tiles
            if (two) load_b(b1, xr, grp + 1);
            mma_group(ag, g0, b0);
            mma_group(au, u0, b0);
            if (two) { mma_group(ag, g1, b1); mma_group(au, u1, b1); }
        }
        gate_up_store(red, ag, au, pc, p1, f0, I, h);
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_down(
    const uint16_t* __restrict__ h, const int32_t* __restrict__ pair_tok, const float* __restrict__ pair_w,
    const int32_t* __restrict__ expert_off, const int32_t* __restrict__ active, const int32_t* __restrict__ w2r,
    const uint16_t* __restrict__ s2r, int D, int I, float* __restrict__ out) {
    __shared__ float red[WARPS][NT][128];
    const int e = active[blockIdx.y], p0 = expert_off[e], p1 = expert_off[e + 1];
    if (p0 >= p1) return;
    const int d0 = blockIdx.x * 16, warp = threadIdx.x >> 5;
    const int G = I / 32;
    const int gb = warp * G / WARPS, ge = (warp + 1) * G / WARPS;
    const size_t t = (size_t)e * (D / 16) + blockIdx.x;
    const int32_t* W = w2r + t * G * 64;
    const uint16_t* S = s2r + t * G * 16;
    for (int pc = p0; pc < p1; pc += 8 * NT) {
        const uint16_t* hr[NT];
        pass_rows(hr, h, I, nullptr, pc, p1);
        float acc[NT][4] = {};
        for (int grp = gb; grp < ge; grp += 2) {
            const bool two = grp + 1 < ge;
            const AFrag a0 = load_a(W, S, grp), a1 = two ? load_a(W, S, grp + 1) : a0;
            uint32_t b0[NT][4], b1[NT][4];
            load_b(b0, hr, grp);
            if (two) load_b(b1, hr, grp + 1);
            mma_group(acc, a0, b0);
            if (two) mma_group(acc, a1, b1);
        }
        down_store(red, acc, pc, p1, d0, D, pair_tok, pair_w, out);
    }
}

// ------------------------------------------------------------------------------------ pair grouping
// One block: counts per expert (shared atomics), one exclusive scan that carries both the pair offset (high
// word) and the number of non-empty experts before e (low word), then a scatter through per-expert cursors.
template <typename Id>
__device__ void moe_group_impl(const Id* __restrict__ ids, const float* __restrict__ w, int P, int k, int E,
                               int S, int32_t* __restrict__ pair_tok, float* __restrict__ pair_w,
                               int32_t* __restrict__ expert_off, int32_t* __restrict__ active) {
    extern __shared__ int32_t sm_group[];
    int32_t* cnt = sm_group;      // [E] pairs per expert, then the cursors
    int32_t* cur = sm_group + E;  // [E]
    __shared__ uint64_t wsum[32];
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += nt) cnt[e] = 0;
    __syncthreads();
    for (int p = tid; p < P; p += nt) {
        const long long e = (long long)ids[p];
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    // thread t owns experts [t * per, (t + 1) * per): local sums, a block scan of (pairs << 32 | non-empty)
    const int per = (E + nt - 1) / nt, e0 = min(E, tid * per), e1 = min(E, e0 + per);
    uint64_t mine = 0;
    for (int e = e0; e < e1; ++e) mine += ((uint64_t)cnt[e] << 32) | (uint64_t)(cnt[e] > 0);
    uint64_t inc = mine;  // inclusive scan within the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint64_t v = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += v;
    }
    if (lane == 31) wsum[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        uint64_t v = lane < (nt >> 5) ? wsum[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint64_t u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        wsum[lane] = v;  // inclusive over warps
    }
    __syncthreads();
    uint64_t run = inc - mine + (warp > 0 ? wsum[warp - 1] : 0ull);  // exclusive prefix of this thread
    const int nnz = (int)(uint32_t)wsum[(nt >> 5) - 1];
    for (int e = e0; e < e1; ++e) {
        const int off = (int)(run >> 32), before = (int)(uint32_t)run, c = cnt[e];
        expert_off[e] = off;
        cur[e] = off;
        const int slot = c > 0 ? before : nnz + (e - before);
        if (slot < S) active[slot] = e;
        run += ((uint64_t)c << 32) | (uint64_t)(c > 0);
    }
    if (tid == nt - 1) expert_off[E] = (int)(wsum[(nt >> 5) - 1] >> 32);
    __syncthreads();
    for (int p = tid; p < P; p += nt) {
        const long long e = (long long)ids[p];
        if (e < 0 || e >= E) continue;
        const int q = atomicAdd(&cur[e], 1);
        pair_tok[q] = p / k;
        pair_w[q] = w[p];
    }
}

extern "C" __global__ void __launch_bounds__(1024) moe_group_i32(
    const int32_t* ids, const float* w, int P, int k, int E, int S, int32_t* pair_tok, float* pair_w,
    int32_t* expert_off, int32_t* active) {
    moe_group_impl<int32_t>(ids, w, P, k, E, S, pair_tok, pair_w, expert_off, active);
}

extern "C" __global__ void __launch_bounds__(1024) moe_group_i64(
    const int64_t* ids, const float* w, int P, int k, int E, int S, int32_t* pair_tok, float* pair_w,
    int32_t* expert_off, int32_t* active) {
    moe_group_impl<int64_t>(ids, w, P, k, E, S, pair_tok, pair_w, expert_off, active);
}

// ------------------------------------------------------------------------------------ pipelined variants
#define STAGES 4

__device__ __forceinline__ uint32_t sm_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(sm_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {  // zero-fills past src_bytes
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sm_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit_group() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// One warp's ring: every slot is [item][lane], so each lane reads back exactly the words it copied.
template <int TILES>
struct Ring {
    uint2 a[STAGES][TILES][32];      // fragment words of each tile
    uint32_t s[STAGES][TILES][32];   // the lane's two row scales of each tile
    uint32_t b[STAGES][NT][4][32];   // B fragment pairs
};

template <int TILES>
__device__ __forceinline__ void ring_issue(Ring<TILES>& R, int st, const int32_t* const* W, const uint16_t* const* S,
                                           const uint16_t* const* xr, const uint16_t* any, int grp) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
        cp_async8(&R.a[st][t][lane], W[t] + (size_t)grp * 64 + lane * 2);
        cp_async4(&R.s[st][t][lane], S[t] + (size_t)grp * 16 + (lane >> 2) * 2, 4);
    }
    const int k0 = grp * 32 + 2 * (lane & 3);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            cp_async4(&R.b[st][nt][j][lane], xr[nt] ? xr[nt] + k0 + 8 * j : any, xr[nt] ? 4 : 0);
}

// acc[t] += scale * (q . x) over this warp's groups [gb, ge) for TILES tiles, streamed through the ring
template <int TILES>
__device__ __forceinline__ void ring_loop(Ring<TILES>& R, float (*acc)[NT][4], const int32_t* const* W,
                                          const uint16_t* const* S, const uint16_t* const* xr, const uint16_t* any,
                                          int gb, int ge) {
    const int lane = threadIdx.x & 31, n = ge - gb;
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < n) ring_issue<TILES>(R, i, W, S, xr, any, gb + i);
        cp_commit_group();
    }
    for (int i = 0; i < n; ++i) {
        // refill the slot read in iteration i - 1 (its values were consumed by that iteration's mma)
        if (i + STAGES - 1 < n) ring_issue<TILES>(R, (i + STAGES - 1) % STAGES, W, S, xr, any, gb + i + STAGES - 1);
        cp_commit_group();
        cp_wait_group<STAGES - 1>();  // this lane's copies of group i have landed
        const int st = i % STAGES;
        uint32_t b[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) b[nt][j] = R.b[st][nt][j][lane];
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
            AFrag f;
            f.w = R.a[st][t][lane];
            f.s = R.s[st][t][lane];
            mma_group(acc[t], f, b);
        }
    }
    cp_wait_group<0>();
}

extern "C" __global__ void __launch_bounds__(256, 3) moe_gate_up_pipe(
    const uint16_t* __restrict__ x, const int32_t* __restrict__ pair_tok, const int32_t* __restrict__ expert_off,
    const int32_t* __restrict__ active, const int32_t* __restrict__ w13r, const uint16_t* __restrict__ s13r, int D,
    int I, uint16_t* __restrict__ h) {
    __shared__ float red[WARPS][2][NT][128];
    extern __shared__ __align__(16) unsigned char ring_smem[];
    const int e = active[blockIdx.y], p0 = expert_off[e], p1 = expert_off[e + 1];
    if (p0 >= p1) return;
    const int f0 = blockIdx.x * 16, warp = threadIdx.x >> 5;
    Ring<2>& R = reinterpret_cast<Ring<2>*>(ring_smem)[warp];
    const int G = D / 32, tiles = 2 * I / 16;
    const int gb = warp * G / WARPS, ge = (warp + 1) * G / WARPS;
    const size_t tg = (size_t)e * tiles + blockIdx.x, tu = (size_t)e * tiles + I / 16 + blockIdx.x;
    const int32_t* W[2] = {w13r + tg * G * 64, w13r + tu * G * 64};
    const uint16_t* S[2] = {s13r + tg * G * 16, s13r + tu * G * 16};
    for (int pc = p0; pc < p1; pc += 8 * NT) {
        const uint16_t* xr[NT];
        pass_rows(xr, x, D, pair_tok, pc, p1);
        float acc[2][NT][4] = {};
        ring_loop<2>(R, acc, W, S, xr, x, gb, ge);
        gate_up_store(red, acc[0], acc[1], pc, p1, f0, I, h);
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_down_pipe(
    const uint16_t* __restrict__ h, const int32_t* __restrict__ pair_tok, const float* __restrict__ pair_w,
    const int32_t* __restrict__ expert_off, const int32_t* __restrict__ active, const int32_t* __restrict__ w2r,
    const uint16_t* __restrict__ s2r, int D, int I, float* __restrict__ out) {
    __shared__ float red[WARPS][NT][128];
    extern __shared__ __align__(16) unsigned char ring_smem[];
    const int e = active[blockIdx.y], p0 = expert_off[e], p1 = expert_off[e + 1];
    if (p0 >= p1) return;
    const int d0 = blockIdx.x * 16, warp = threadIdx.x >> 5;
    Ring<1>& R = reinterpret_cast<Ring<1>*>(ring_smem)[warp];
    const int G = I / 32;
    const int gb = warp * G / WARPS, ge = (warp + 1) * G / WARPS;
    const size_t t = (size_t)e * (D / 16) + blockIdx.x;
    const int32_t* W[1] = {w2r + t * G * 64};
    const uint16_t* S[1] = {s2r + t * G * 16};
    for (int pc = p0; pc < p1; pc += 8 * NT) {
        const uint16_t* hr[NT];
        pass_rows(hr, h, I, nullptr, pc, p1);
        float acc[1][NT][4] = {};
        ring_loop<1>(R, acc, W, S, hr, h, gb, ge);
        down_store(red, acc[0], pc, p1, d0, D, pair_tok, pair_w, out);
    }
}
