// moe_int4.cu: routed MoE experts with INT4 weights (Kimi K2 format), bf16 activations, fp32 accumulation.
//
// Golden twin: kdtree/ops/moe_int4_golden.py  moe_int4 (float64, exact dequantization).
// Wrappers: kdtree/ops/moe_int4.py.
// Weights: the K2 checkpoint format (kdtree/quant.py: eight 4-bit values q + 8 per int32 along the input,
// one bf16 scale per 32 inputs, W = q * scale) reordered once by kdtree.ops.moe_int4.repack_moe into mma
// fragment order, so that each lane loads exactly the bytes its A fragment needs, 8 per 32-input group:
//   wr int32 [E, R/16, K/32, 32 lanes, 2]: lane (g, c) = (lane / 4, lane % 4), word j (k-block j of the
//      group) holds A register b = 0..3 (rows 16 t + g + 8 (b % 2), checkpoint word 2j + b / 2, its inputs 2c and
//      2c + 1) as nibble b (bits 4b..4b+3: input 2c) and nibble 4 + b (bits 16+4b..: input 2c + 1), so
//      (word >> 4b) & 0x000f000f is register b's pair of 4-bit codes, one per bf16 half
//   sr bf16  [E, R/16, K/32, 8, 2]:       scales of rows 16 t + g and 16 t + g + 8
// for a matrix [R, K]: w13 is [2I, D] (rows [0, I) gate, [I, 2I) up), w2 is [D, I].
// moe_gate_up / moe_down take the token-expert pairs grouped by expert (moe_group does it): pairs
// [expert_off[e], expert_off[e+1]) belong to expert e, pair p is token pair_tok[p] with weight pair_w[p].
// moe_fused_t8 groups them itself.
//
// moe_gate_up_t{8,16,32}   grid (I / 16, Y), block 256 (8 warps), static smem 8 / 16 / 32 KB,
//               <= 80 registers at t8 (three blocks per SM), <= 128 at t16 (two)
//   x         bf16 [T, D] (as uint16)            pair_tok int32 [P]     expert_off int32 [E + 1]
//   items     int32 [Y, 2], chunk int            work items from moe_group: block y serves expert items[y][0],
//                                                pairs [items[y][1], min(items[y][1] + chunk, expert_off[e + 1]))
//                                                (an item of expert -1 returns at once)
//   w13r, s13r (above, R = 2I, K = D)
//   h         bf16 [P, I]                        h[p, f] = silu(gate_f . x) * (up_f . x), token of pair p
//   A block owns 16 intermediate features (a 16-row gate tile and a 16-row up tile) of one item; its
//   8 warps split the inputs D by groups of 32 (warp w takes groups w, w + 8, ...) and meet in shared
//   memory. Pairs go 8 (t8: one n8 tile), 16 (t16: two) or 32 (t32: four) at a time through mma.sync m16n8k16 (bf16 in,
//   fp32 out); an item of more pairs than that runs several passes in order. Items of one pass each put all
//   of an expert's passes in flight at once: the blocks of one expert's items read its rows from DRAM about
//   once and from L2 after that (item order is expert-major, so they run close together). The wrapper
//   takes t8 when experts hold few pairs (decode, small trees) so no mma or register
//   is spent on empty token columns. A fragments are
//   the packed nibbles turned into exact bf16 pairs by one lop3 and one hsub2 each (0x4300 | n is 128 + n;
//   minus 136 gives n - 8); the scale multiplies each 32-input group's fp32 partial sum; one set of B
//   fragments serves both tiles; U groups' A loads go out together (t8: 4, down 3; t16: 2), bypassing L1, and
//   each group's B rows (L1 hits) are loaded as it is used. Each lane walks its words with immediate offsets;
//   rows past a pass's last pair repeat a valid row (computed, not stored).
// moe_down_t{8,16,32}   grid (D / 32, Y), block 256, static smem 8 / 16 / 32 KB; a block owns two 16-row tiles
//   of one item (items, chunk as above); h as above; pair_w float [P]; w2r, s2r (R = D, K = I)
//   out       float [T, D], accumulated:  out[t, d] += pair_w[p] * (down_d . h[p]) for every pair of t
//   (the wrapper zeroes it; fp32 atomics, so the summation order of a token's experts may vary).
// moe_group_i32 / moe_group_i64   grid 1, block 1024, dynamic smem 8 E bytes (E <= 4096, P < 2^24)
//   ids       int32 or int64 [P] (topk_ids flattened, P = T * k, pair p is token p / k)   w float [P]
//   pair_tok  int32 [P], pair_w float [P]: the pairs grouped by expert; the order WITHIN an expert is
//             unspecified (shared-memory atomics); expert_off int32 [E + 1]: expert e owns [off[e], off[e+1]);
//             active int32 [S], S = min(E, P): the experts with pairs by id, then the empty ones by id.
//   chunk, Y, items int32 [Y, 2] (chunk > 0; items may be null when chunk == 0): the work items of the expert
//             GEMMs, (expert, first pair) for each `chunk` pairs of each expert with pairs, experts by id, an
//             expert's chunks in order; rows past the last item are (-1, -1). Y >= ceil(P / chunk) + S holds
//             them all (the wrapper's size).
//   Ids outside [0, E) are dropped (the wrapper rejects them before launch unless told not to check).
//   Golden twin: kdtree/ops/moe_int4_golden.py group_pairs, group_items (stable order: compare within an
//   expert as multisets).
// moe_repack_words / moe_repack_scales   grid ceil(n / 256), block 256, one thread per output element
//   The checkpoint layout -> the fragment order above, for `mats` stacked matrices [R, K] (R % 16 == 0,
//   K % 32 == 0): packed int32 [mats, R, K/8] -> wr int32 [mats, R/16, K/32, 32, 2]; scale bf16 [mats, R, K/32]
//   -> sr bf16 [mats, R/16, K/32, 8, 2] (sr[.., t, grp, g, half] = scale[.., 16 t + 8 half + g, grp]).
//   Golden twin: kdtree/ops/moe_int4.py repack_int4_mma (torch ops); used by the C ABI (include/kdtree.h).
// Shapes: D % 32 == 0, I % 32 == 0 (checked by the wrappers).
#include <cuda_bf16.h>
#include "common.cuh"

#define WARPS 8

// A register B of a fragment word -> bf16x2 (q(2c), q(2c+1)) - 8, exact: one lop3 ((w >> 4B) & m) | 0x4300_4300
// (bf16 128 + n per half) and one sub.bf16x2 of 136 (0x4308)
template <int B>
__device__ __forceinline__ uint32_t deq_pair(uint32_t word) {
    uint32_t v, r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(v) : "r"(word >> (4 * B)), "n"(0x000f000f), "n"(0x43004300));
    asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(v), "r"(0x43084308u));
    return r;
}

// One 16-row tile's fragment words and scales for one group: 8 bytes + 4 bytes per lane.
struct AFrag { uint2 w; uint32_t s; };

// This lane's walk over its warp's input groups: A words of TL tiles (uint2 per group, stride 32), their scales
// (one word: rows g and g + 8, stride 8), and the B rows of NT token tiles (four words per group at 4j from
// word c, stride 16). Rows past the pass's last pair repeat a valid row: their columns are computed, never stored.
template <int NT, int TL>
struct Walk {
    const uint2* w;      // tile 0's words; tile t's at + t * tw
    const uint32_t* s;   // tile 0's scales; tile t's at + t * ts
    int tw, ts;
    const uint32_t* x[NT];
};

// Weights are read once: they bypass L1 (L1::no_allocate), so the B rows, re-read every group, stay there.
__device__ __forceinline__ uint2 ld_stream(const uint2* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint32_t ld_stream(const uint32_t* p) {
    uint32_t v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
}

// A warp walks every WARPS-th group (warp w: groups w, w + 8, ...), so one step of a block's 8 warps reads
// consecutive groups of each tile.
#define GS WARPS

template <int NT, int TL>
__device__ __forceinline__ void load_a(const Walk<NT, TL>& q, int i, AFrag* a) {
#pragma unroll
    for (int t = 0; t < TL; ++t) {
        a[t].w = ld_stream(q.w + t * q.tw + 32 * GS * i);
        a[t].s = ld_stream(q.s + t * q.ts + 8 * GS * i);
    }
}

// CG: B rows through L2 only (ld.global.cg), for rows written earlier in the same launch (moe_fused_t8)
template <int NT, int TL, bool CG>
__device__ __forceinline__ void load_b(const Walk<NT, TL>& q, int i, uint32_t (*b)[4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t* p = q.x[nt] + 16 * GS * i + 4 * j;
            b[nt][j] = CG ? __ldcg(p) : __ldg(p);
        }
}

// acc += scale * (q . x) for one group of a 16-row tile; acc[nt] = (row g: tokens 2c, 2c+1; row g+8: same)
template <int NT>
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

// The block's 8 warps each hold partial sums over their inputs for 16 rows x 8 NT pair slots: reduce them in
// shared memory, then h = silu(gate) * up as bf16 (gate_up) or out += pair weight * down (fp32 atomics).
template <int NT>
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

template <int NT>
__device__ __forceinline__ void down_store(float (*red)[2][NT][128], const float (*a)[NT][4], int pc, int p1, int d0,
                                           int D, const int32_t* __restrict__ pair_tok,
                                           const float* __restrict__ pair_w, float* __restrict__ out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][t][nt][lane * 4 + i] = a[t][nt][i];
    __syncthreads();
    for (int j = threadIdx.x; j < 2 * NT * 128; j += blockDim.x) {
        const int t = j / (NT * 128), nt = (j >> 7) % NT, q = j & 127, ln = q >> 2, i = q & 3;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) s += red[w][t][nt][q];
        const int row = 16 * t + (ln >> 2) + ((i & 2) ? 8 : 0), tok = nt * 8 + 2 * (ln & 3) + (i & 1);
        const int p = pc + tok;
        if (p < p1) atomicAdd(out + (size_t)pair_tok[p] * D + d0 + row, pair_w[p] * s);
    }
    __syncthreads();
}

template <int NT, int TL>
__device__ __forceinline__ void advance(Walk<NT, TL>& q, int groups) {
    q.w += 32 * GS * groups;
    q.s += 8 * GS * groups;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) q.x[nt] += 16 * GS * groups;
}

// acc[t] += scale * (q . x) over the next n groups of the walk, U groups' loads in flight at a time
template <int NT, int TL, int U, bool CG = false>
__device__ __forceinline__ void kloop(float (*acc)[NT][4], Walk<NT, TL> q, int n) {
    for (; n >= U; n -= U) {
        AFrag a[U][TL];
#pragma unroll
        for (int u = 0; u < U; ++u) load_a<NT, TL>(q, u, a[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            uint32_t b[NT][4];  // B rows are L1/L2 hits: loaded when needed, so registers go to A in flight
            load_b<NT, TL, CG>(q, u, b);
#pragma unroll
            for (int t = 0; t < TL; ++t) mma_group<NT>(acc[t], a[u][t], b);
        }
        advance<NT, TL>(q, U);
    }
    for (; n > 0; --n) {
        AFrag a[TL];
        uint32_t b[NT][4];
        load_a<NT, TL>(q, 0, a);
        load_b<NT, TL, CG>(q, 0, b);
#pragma unroll
        for (int t = 0; t < TL; ++t) mma_group<NT>(acc[t], a[t], b);
        advance<NT, TL>(q, 1);
    }
}

// This lane's B rows for the pass of 8 NT pairs from pc: row base + id * ld (id = pair_tok[p], a token's
// activations, or p itself, the pair's workspace row), at word c of group gb; p clamped to the last pair.
template <int NT, int TL>
__device__ __forceinline__ void pass_rows(Walk<NT, TL>& q, const uint16_t* base, int ld,
                                          const int32_t* __restrict__ pair_tok, int pc, int p1, int gb) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int p = min(pc + nt * 8 + (lane >> 2), p1 - 1);
        q.x[nt] = reinterpret_cast<const uint32_t*>(base + (size_t)(pair_tok ? pair_tok[p] : p) * ld) + gb * 16 +
                  (lane & 3);
    }
}

// The walk over tiles first + t * step (a tile: 16 rows x K of one matrix, G groups of 32 inputs), from group gb
template <int NT, int TL>
__device__ __forceinline__ void tile_walk(Walk<NT, TL>& q, const int32_t* wr, const uint16_t* sr, size_t first,
                                          int step, int G, int gb) {
    const int lane = threadIdx.x & 31;
    q.w = reinterpret_cast<const uint2*>(wr + first * G * 64) + gb * 32 + lane;
    q.s = reinterpret_cast<const uint32_t*>(sr + first * G * 16) + gb * 8 + (lane >> 2);
    q.tw = step * G * 32;
    q.ts = step * G * 8;
}

// gate+up of one expert's pairs [p0, p1) for intermediate features 16 ftile .. + 15 (pair_tok: global or shared)
template <int NT, int U>
__device__ __forceinline__ void gate_up_tile(float (*red)[2][NT][128], const uint16_t* __restrict__ x,
                                             const int32_t* pair_tok, int p0, int p1, const int32_t* __restrict__ w13r,
                                             const uint16_t* __restrict__ s13r, int e, int ftile, int D, int I,
                                             uint16_t* __restrict__ h) {
    const int warp = threadIdx.x >> 5;
    const int G = D / 32, tiles = 2 * I / 16;
    const int gb = warp, ng = (G - warp + GS - 1) / GS;  // this warp's groups gb, gb + GS, ...
    const size_t tg = (size_t)e * tiles + ftile;
    for (int pc = p0; pc < p1; pc += 8 * NT) {
        Walk<NT, 2> q;
        tile_walk(q, w13r, s13r, tg, I / 16, G, gb);  // gate rows, then (t = 1) the same features' up rows
        pass_rows(q, x, D, pair_tok, pc, p1, gb);
        float acc[2][NT][4] = {};
        kloop<NT, 2, U>(acc, q, ng);
        gate_up_store<NT>(red, acc[0], acc[1], pc, p1, 16 * ftile, I, h);
    }
}

// down + combine of one expert's pairs [p0, p1) (workspace rows p) for outputs 32 dpair .. + 31
template <int NT, int U, bool CG>
__device__ __forceinline__ void down_tile(float (*red)[2][NT][128], const uint16_t* h, const int32_t* pair_tok,
                                          const float* pair_w, int p0, int p1, const int32_t* __restrict__ w2r,
                                          const uint16_t* __restrict__ s2r, int e, int dpair, int D, int I,
                                          float* __restrict__ out) {
    const int warp = threadIdx.x >> 5;
    const int G = I / 32;
    const int gb = warp, ng = (G - warp + GS - 1) / GS;  // this warp's groups gb, gb + GS, ...
    const size_t t0 = (size_t)e * (D / 16) + 2 * dpair;
    for (int pc = p0; pc < p1; pc += 8 * NT) {
        Walk<NT, 2> q;
        tile_walk(q, w2r, s2r, t0, 1, G, gb);  // outputs 32 dpair .. + 15, then (t = 1) the next 16
        pass_rows(q, h, I, nullptr, pc, p1, gb);
        float acc[2][NT][4] = {};
        kloop<NT, 2, U, CG>(acc, q, ng);
        down_store<NT>(red, acc, pc, p1, 32 * dpair, D, pair_tok, pair_w, out);
    }
}

// Block y's work item: expert e and its pairs [p0, p1); false for a row past the last item.
__device__ __forceinline__ bool item_work(const int32_t* __restrict__ items, const int32_t* __restrict__ expert_off,
                                          int chunk, int& e, int& p0, int& p1) {
    const int2 it = reinterpret_cast<const int2*>(items)[blockIdx.y];
    if (it.x < 0) return false;
    e = it.x;
    p0 = it.y;
    p1 = min(p0 + chunk, expert_off[e + 1]);
    return p0 < p1;
}

template <int NT, int U>
__device__ __forceinline__ void gate_up_body(const uint16_t* __restrict__ x, const int32_t* __restrict__ pair_tok,
                                             const int32_t* __restrict__ expert_off, const int32_t* __restrict__ items,
                                             int chunk, const int32_t* __restrict__ w13r,
                                             const uint16_t* __restrict__ s13r, int D, int I,
                                             uint16_t* __restrict__ h) {
    __shared__ float red[WARPS][2][NT][128];
    int e, p0, p1;
    if (!item_work(items, expert_off, chunk, e, p0, p1)) return;
    gate_up_tile<NT, U>(red, x, pair_tok, p0, p1, w13r, s13r, e, blockIdx.x, D, I, h);
}

template <int NT, int U>
__device__ __forceinline__ void down_body(const uint16_t* __restrict__ h, const int32_t* __restrict__ pair_tok,
                                          const float* __restrict__ pair_w, const int32_t* __restrict__ expert_off,
                                          const int32_t* __restrict__ items, int chunk,
                                          const int32_t* __restrict__ w2r, const uint16_t* __restrict__ s2r, int D,
                                          int I, float* __restrict__ out) {
    __shared__ float red[WARPS][2][NT][128];
    int e, p0, p1;
    if (!item_work(items, expert_off, chunk, e, p0, p1)) return;
    down_tile<NT, U, false>(red, h, pair_tok, pair_w, p0, p1, w2r, s2r, e, blockIdx.x, D, I, out);
}

#define MOE_GEMMS(SUFFIX, NT, U, UD, MINB)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, MINB) moe_gate_up_##SUFFIX(                                    \
        const uint16_t* __restrict__ x, const int32_t* __restrict__ pair_tok, const int32_t* __restrict__ expert_off, \
        const int32_t* __restrict__ items, int chunk, const int32_t* __restrict__ w13r,                               \
        const uint16_t* __restrict__ s13r, int D, int I, uint16_t* __restrict__ h) {                                 \
        gate_up_body<NT, U>(x, pair_tok, expert_off, items, chunk, w13r, s13r, D, I, h);                              \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, MINB) moe_down_##SUFFIX(                                       \
        const uint16_t* __restrict__ h, const int32_t* __restrict__ pair_tok, const float* __restrict__ pair_w,       \
        const int32_t* __restrict__ expert_off, const int32_t* __restrict__ items, int chunk,                         \
        const int32_t* __restrict__ w2r, const uint16_t* __restrict__ s2r, int D, int I, float* __restrict__ out) {   \
        down_body<NT, UD>(h, pair_tok, pair_w, expert_off, items, chunk, w2r, s2r, D, I, out);                         \
    }

// suffix, token tiles, groups in flight (gate_up, down), blocks per SM (t8: <= 80 registers, down at U = 4 spills).
// Measured on the H200 at K2.6 shapes: U 2-16 at 2-3 blocks per SM, none faster than 4 / 3 at 3.
// Tuning knobs (the loader compiles with the defaults; -DMOE_T8_U=... etc. to explore).
#ifndef MOE_T8_U
#define MOE_T8_U 4
#endif
#ifndef MOE_T8_UD
#define MOE_T8_UD 3
#endif
#ifndef MOE_T8_MINB
#define MOE_T8_MINB 3
#endif
MOE_GEMMS(t8, 1, MOE_T8_U, MOE_T8_UD, MOE_T8_MINB)
MOE_GEMMS(t16, 2, 2, 2, 2)
MOE_GEMMS(t32, 4, 2, 2, 1)  // 148 registers: one block per SM; every pair of an expert with up to 32 in one pass

// ------------------------------------------------------------------------------------ pair grouping
// One block: counts per expert (shared atomics), one exclusive scan that carries the pair offset (bits 40..63),
// the work items (13..39) and the number of non-empty experts (0..12) before e, then a scatter through
// per-expert cursors.
#define GROUP_ITEMS_SHIFT 13
#define GROUP_PAIRS_SHIFT 40
__device__ __forceinline__ uint64_t group_key(int c, int chunk) {
    const uint64_t items = chunk > 0 ? (uint64_t)((c + chunk - 1) / chunk) : 0ull;
    return ((uint64_t)c << GROUP_PAIRS_SHIFT) | (items << GROUP_ITEMS_SHIFT) | (uint64_t)(c > 0);
}
__device__ __forceinline__ int key_pairs(uint64_t v) { return (int)(v >> GROUP_PAIRS_SHIFT); }
__device__ __forceinline__ int key_items(uint64_t v) {
    return (int)((v >> GROUP_ITEMS_SHIFT) & ((1ull << (GROUP_PAIRS_SHIFT - GROUP_ITEMS_SHIFT)) - 1));
}
__device__ __forceinline__ int key_nonempty(uint64_t v) { return (int)(v & ((1ull << GROUP_ITEMS_SHIFT) - 1)); }

template <typename Id>
__device__ void moe_group_impl(const Id* __restrict__ ids, const float* __restrict__ w, int P, int k, int E,
                               int S, int chunk, int Y, int32_t* __restrict__ pair_tok, float* __restrict__ pair_w,
                               int32_t* __restrict__ expert_off, int32_t* __restrict__ active,
                               int32_t* __restrict__ items) {
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
    // thread t owns experts [t * per, (t + 1) * per): local sums, a block scan of the packed keys
    const int per = (E + nt - 1) / nt, e0 = min(E, tid * per), e1 = min(E, e0 + per);
    uint64_t mine = 0;
    for (int e = e0; e < e1; ++e) mine += group_key(cnt[e], chunk);
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
    const uint64_t all = wsum[(nt >> 5) - 1];
    const int nnz = key_nonempty(all);
    for (int e = e0; e < e1; ++e) {
        const int off = key_pairs(run), before = key_nonempty(run), c = cnt[e];
        expert_off[e] = off;
        cur[e] = off;
        const int slot = c > 0 ? before : nnz + (e - before);
        if (slot < S) active[slot] = e;
        if (chunk > 0)
            for (int j = 0, y = key_items(run); j < c; j += chunk, ++y) {
                items[2 * y] = e;
                items[2 * y + 1] = off + j;
            }
        run += group_key(c, chunk);
    }
    if (tid == nt - 1) expert_off[E] = key_pairs(all);
    if (chunk > 0)
        for (int y = key_items(all) + tid; y < Y; y += nt) {
            items[2 * y] = -1;
            items[2 * y + 1] = -1;
        }
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
    const int32_t* ids, const float* w, int P, int k, int E, int S, int chunk, int Y, int32_t* pair_tok,
    float* pair_w, int32_t* expert_off, int32_t* active, int32_t* items) {
    moe_group_impl<int32_t>(ids, w, P, k, E, S, chunk, Y, pair_tok, pair_w, expert_off, active, items);
}

extern "C" __global__ void __launch_bounds__(1024) moe_group_i64(
    const int64_t* ids, const float* w, int P, int k, int E, int S, int chunk, int Y, int32_t* pair_tok,
    float* pair_w, int32_t* expert_off, int32_t* active, int32_t* items) {
    moe_group_impl<int64_t>(ids, w, P, k, E, S, chunk, Y, pair_tok, pair_w, expert_off, active, items);
}

// ------------------------------------------------------------------------------------ fused small-batch path
// moe_fused_t8_{i32,i64}   grid: a persistent grid of MOE_FUSED_MINB blocks per SM
//                          (ops.moe_int4.FUSED_BLOCKS_PER_SM),
//   block 256, static smem 9.5 KB
//   The whole routed-expert call for at most FUSED_MAX_PAIRS pairs (decode, short chains) in ONE launch: each
//   block groups the pairs itself in shared memory (ids outside [0, E) dropped), then takes work items from a
//   ticket counter in this order: Z items that zero `out`, S * I/16 gate+up items (slot-major), S * D/32 down
//   items (slot-major). A down item of slot s waits (one thread spins) until the I/16 gate+up items of s and
//   the Z zeroing items are done. Tickets are handed out in order and a gate+up or zeroing item never waits,
//   so every item a down item waits on belongs to a running block: no deadlock, whatever the grid size.
//   x bf16 [T, D]; ids int32 (_i32) or int64 (_i64) [P]; w float [P] (pair p = token p / k); h bf16 [P, I] workspace (row = the
//   pair's rank in expert order); out float [T, D] (written whole: zeroed, then accumulated with fp32 atomics).
//   sync int32 [4 + FUSED_MAX_PAIRS]: ticket, exits, zeroed, done[slot]; all zero between calls (the last
//   block to exit resets them; the wrapper allocates them zeroed once per stream, or per captured graph).
//   One call in flight per sync buffer. P <= FUSED_MAX_PAIRS (checked by the wrapper).
#define FUSED_MAX_PAIRS 64
#define ZERO_CHUNK 4096  // floats of `out` per zeroing item

__device__ __forceinline__ int ld_acquire(const int32_t* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

template <typename Id, int UG, int UD>
__device__ __forceinline__ void moe_fused_impl(
    const uint16_t* __restrict__ x, const Id* __restrict__ ids, const float* __restrict__ w, int P, int k, int E,
    const int32_t* __restrict__ w13r, const uint16_t* __restrict__ s13r, const int32_t* __restrict__ w2r,
    const uint16_t* __restrict__ s2r, int D, int I, int T, uint16_t* h, float* out, int32_t* sync) {
    __shared__ float red[WARPS][2][1][128];
    __shared__ int32_t tok[FUSED_MAX_PAIRS], key[FUSED_MAX_PAIRS], exp_of[FUSED_MAX_PAIRS];
    __shared__ float pw[FUSED_MAX_PAIRS];
    __shared__ int32_t slot_off[FUSED_MAX_PAIRS + 1], slot_exp[FUSED_MAX_PAIRS];
    __shared__ int32_t n_slots, ticket;
    const int tid = threadIdx.x;
    int32_t* const next = sync;        // [0] the next ticket
    int32_t* const exits = sync + 1;   // [1] blocks done with the loop
    int32_t* const zeroed = sync + 2;  // [2] zeroing items done
    int32_t* const done = sync + 4;    // [4 + s] gate+up items of slot s done
    if (tid == 0) ticket = atomicAdd(next, 1);
    // group: rank of pair p = number of pairs with a smaller (expert, p) key; dropped ids sort last
    for (int p = tid; p < P; p += blockDim.x) {
        const long long e = (long long)ids[p];
        key[p] = (e >= 0 && e < E ? (int)e : E) * FUSED_MAX_PAIRS + p;
    }
    __syncthreads();
    for (int p = tid; p < P; p += blockDim.x) {
        const int kp = key[p];
        int r = 0;
        for (int q = 0; q < P; ++q) r += key[q] < kp;
        tok[r] = p / k;
        pw[r] = w[p];
        exp_of[r] = kp / FUSED_MAX_PAIRS;  // E for a dropped pair
    }
    __syncthreads();
    if (tid == 0) {
        int s = 0;
        for (int r = 0; r < P && exp_of[r] < E; ++r)
            if (r == 0 || exp_of[r] != exp_of[r - 1]) { slot_off[s] = r; slot_exp[s] = exp_of[r]; ++s; }
        int valid = 0;
        while (valid < P && exp_of[valid] < E) ++valid;
        slot_off[s] = valid;
        n_slots = s;
    }
    __syncthreads();
    const int S = n_slots, FT = I / 16, DT = D / 32;
    const int Z = (T * D + ZERO_CHUNK - 1) / ZERO_CHUNK;
    const int total = Z + S * (FT + DT);
    int item = ticket;
    while (item < total) {
        __syncthreads();  // every thread has read `ticket` (and the last item's shared memory is free)
        if (tid == 0) ticket = atomicAdd(next, 1);  // the next item's ticket, fetched while this one runs
        if (item < Z) {
            float4* o = reinterpret_cast<float4*>(out) + (size_t)item * (ZERO_CHUNK / 4);
            const int n4 = min(ZERO_CHUNK, T * D - item * ZERO_CHUNK) / 4;
            for (int i = tid; i < n4; i += blockDim.x) o[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            __syncthreads();
            if (tid == 0) { __threadfence(); atomicAdd(zeroed, 1); }
        } else if (item < Z + S * FT) {
            const int s = (item - Z) / FT, ft = (item - Z) % FT;
            gate_up_tile<1, UG>(red, x, tok, slot_off[s], slot_off[s + 1], w13r, s13r, slot_exp[s], ft, D, I, h);
            if (tid == 0) { __threadfence(); atomicAdd(done + s, 1); }  // gate_up_store ends with a barrier
        } else {
            const int s = (item - Z - S * FT) / DT, dp = (item - Z - S * FT) % DT;
            if (tid == 0) {
                while (ld_acquire(done + s) < FT || ld_acquire(zeroed) < Z) __nanosleep(64);
            }
            __syncthreads();
            down_tile<1, UD, true>(red, h, tok, pw, slot_off[s], slot_off[s + 1], w2r, s2r, slot_exp[s], dp, D, I,
                                  out);
        }
        __syncthreads();
        item = ticket;
    }
    if (tid == 0) __threadfence();  // this block's counter updates (a zeroing item's too) before its exit
    if (tid == 0 && atomicAdd(exits, 1) == (int)gridDim.x - 1) {  // the last block out resets the counters
        *next = 0;
        *zeroed = 0;
        for (int s = 0; s < FUSED_MAX_PAIRS; ++s) done[s] = 0;
        __threadfence();
        *exits = 0;
    }
}

// Four blocks per SM at 64 registers with 2 gate+up / 2 down groups in flight per warp: measured on the H200 (K2.6
// shapes, one token, same run) 66.8 us against 71.3 at three blocks (4 / 3 groups), 68.8 at four with 3 / 2 and
// 78.9 at two with 8 / 6. More resident warps hide more load latency here than more loads per warp do.
#ifndef MOE_FUSED_MINB
#define MOE_FUSED_MINB 4  // ops.moe_int4.FUSED_BLOCKS_PER_SM
#endif
#ifndef MOE_FUSED_U
#define MOE_FUSED_U 2
#endif
#ifndef MOE_FUSED_UD
#define MOE_FUSED_UD 2
#endif
#define MOE_FUSED(SUFFIX, Id, UG, UD)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, MOE_FUSED_MINB) moe_fused_t8_##SUFFIX(                         \
        const uint16_t* __restrict__ x, const Id* __restrict__ ids, const float* __restrict__ w, int P, int k, int E, \
        const int32_t* __restrict__ w13r, const uint16_t* __restrict__ s13r, const int32_t* __restrict__ w2r,         \
        const uint16_t* __restrict__ s2r, int D, int I, int T, uint16_t* h, float* out, int32_t* sync) {             \
        moe_fused_impl<Id, UG, UD>(x, ids, w, P, k, E, w13r, s13r, w2r, s2r, D, I, T, h, out, sync);                 \
    }
MOE_FUSED(i32, int32_t, MOE_FUSED_U, MOE_FUSED_UD)
MOE_FUSED(i64, int64_t, MOE_FUSED_U, MOE_FUSED_UD)

extern "C" __global__ void __launch_bounds__(256) moe_repack_words(
    const uint8_t* __restrict__ packed, long long mats, int R, int K, int32_t* __restrict__ wr) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int G = K / 32;
    const long long per_mat = (long long)R * K / 8;
    if (i >= mats * per_mat) return;
    const int j = (int)(i % 2), lane = (int)((i / 2) % 32), grp = (int)((i / 64) % G);
    const long long rest = i / (64LL * G);
    const int tile = (int)(rest % (R / 16));
    const long long m = rest / (R / 16);
    const int g = lane / 4, c = lane % 4;
    const uint8_t* base = packed + m * per_mat * 4;
    uint32_t word = 0;
    for (int b = 0; b < 4; ++b) {  // register b = 2 w + half
        const int w = b >> 1, half = b & 1;
        const int row = tile * 16 + half * 8 + g;
        const uint32_t byte = base[(size_t)row * (K / 2) + grp * 16 + j * 8 + w * 4 + c];
        word |= ((byte & 0xfu) << (4 * b)) | ((byte >> 4) << (4 * b + 16));
    }
    wr[i] = (int32_t)word;
}

extern "C" __global__ void __launch_bounds__(256) moe_repack_scales(
    const uint16_t* __restrict__ scale, long long mats, int R, int K, uint16_t* __restrict__ sr) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int G = K / 32;
    const long long per_mat = (long long)R * G;
    if (i >= mats * per_mat) return;
    const int half = (int)(i % 2), g = (int)((i / 2) % 8), grp = (int)((i / 16) % G);
    const long long rest = i / (16LL * G);
    const int tile = (int)(rest % (R / 16));
    const long long m = rest / (R / 16);
    sr[i] = scale[m * per_mat + (size_t)(tile * 16 + half * 8 + g) * G + grp];
}
