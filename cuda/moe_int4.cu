// moe_int4.cu: routed MoE experts with INT4 weights (Kimi K2 format), bf16 activations, fp32 accumulation.
//
// Golden twin: kdtree/golden.py  moe_int4 (float64, exact dequantization).
// Weights (kdtree/quant.py): int32 words of eight 4-bit values q + 8 (input 8c + i in bits 4i..4i+3 of
// word c), one bf16 scale per 32 inputs; W = q * scale. gate and up are stacked: rows [0, I) gate,
// [I, 2I) up. Token-expert pairs arrive grouped by expert (the wrapper sorts them): pairs
// [expert_off[e], expert_off[e + 1]) belong to expert e, pair p is token pair_tok[p] with weight pair_w[p].
//
// moe_gate_up   grid (I / 16, S), block 256 (8 warps), static smem 16 KB
//   x         bf16 [T, D] (as uint16)            pair_tok int32 [P]     expert_off int32 [E + 1]
//   active    int32 [S]                          S = min(E, P) expert slots: the experts with pairs first
//                                                (block y serves expert active[y]; an empty one returns)
//   w13       int32 [E, 2I, D / 8]               s13 bf16 [E, 2I, D / 32]
//   h         bf16 [P, I]                        h[p, f] = silu(gate_f . x) * (up_f . x), token of pair p
//   A block owns 16 intermediate features (a 16-row gate tile and a 16-row up tile) of one expert; its
//   8 warps split the inputs D by groups of 32 and meet in shared memory. Tokens go 16 at a time (two
//   n8 tiles) through mma.sync m16n8k16 (bf16 in, fp32 out): a thread's A fragment is byte (lane % 4)
//   of four packed words, turned into exact bf16 pairs (0x4300 | n is 128 + n; minus 136 gives n - 8);
//   the scale multiplies each 32-input group's fp32 partial sum; one set of B fragments serves both tiles.
// moe_down      grid (D / 16, S), block 256, static smem 8 KB
//   h as above; pair_w float [P]; w2 int32 [E, D, I / 8]; s2 bf16 [E, D, I / 32]
//   out       float [T, D], accumulated:  out[t, d] += pair_w[p] * (down_d . h[p]) for every pair of t
//   (the wrapper zeroes it; fp32 atomics, so the summation order of a token's experts may vary).
// Shapes: D % 32 == 0, I % 32 == 0 (checked by kdtree.kernels.moe_int4).
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

// byte `c` of a packed word (inputs 2c, 2c + 1 of its eight) -> bf16x2 (q_lo, q_hi), exact
__device__ __forceinline__ uint32_t deq_pair(uint32_t word, int c) {
    const uint32_t b = (word >> (8 * c)) & 0xffu;
    const uint32_t v = (b & 0x0fu) | ((b & 0xf0u) << 12) | 0x43004300u;
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __float2bfloat162_rn(136.0f));
    return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ float bf16f(uint16_t v) { return __uint_as_float(((uint32_t)v) << 16); }

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

// One 32-input group of a 16-row tile: acc += scale * (q . x). W, S: the tile's first row (ldw words,
// lds scales per row); this thread's rows are g and g + 8.
__device__ __forceinline__ void tile_group(float (*acc)[4], const int32_t* W, const uint16_t* S, int ldw, int lds,
                                           int grp, const uint32_t (*b)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const uint4 w0 = __ldg(reinterpret_cast<const uint4*>(W + (size_t)g * ldw + grp * 4));
    const uint4 w1 = __ldg(reinterpret_cast<const uint4*>(W + (size_t)(g + 8) * ldw + grp * 4));
    const float s0 = bf16f(__ldg(S + (size_t)g * lds + grp)), s1 = bf16f(__ldg(S + (size_t)(g + 8) * lds + grp));
    // k-block 0 = words 0, 1; k-block 1 = words 2, 3. A regs: (row g, k 2c), (row g+8, k 2c), (row g, k 2c+8), (row g+8, k 2c+8)
    const uint32_t a0[4] = {deq_pair(w0.x, c), deq_pair(w1.x, c), deq_pair(w0.y, c), deq_pair(w1.y, c)};
    const uint32_t a1[4] = {deq_pair(w0.z, c), deq_pair(w1.z, c), deq_pair(w0.w, c), deq_pair(w1.w, c)};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
        mma16816(t, a0, b[nt][0], b[nt][1]);
        mma16816(t, a1, b[nt][2], b[nt][3]);
        acc[nt][0] += t[0] * s0; acc[nt][1] += t[1] * s0;   // row g, tokens 2c, 2c + 1
        acc[nt][2] += t[2] * s1; acc[nt][3] += t[3] * s1;   // row g + 8
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_gate_up(
    const uint16_t* __restrict__ x, const int32_t* __restrict__ pair_tok, const int32_t* __restrict__ expert_off,
    const int32_t* __restrict__ active, const int32_t* __restrict__ w13, const uint16_t* __restrict__ s13, int D,
    int I, uint16_t* __restrict__ h) {
    __shared__ float red[WARPS][2][NT][128];
    const int e = active[blockIdx.y], p0 = expert_off[e], p1 = expert_off[e + 1];
    if (p0 >= p1) return;
    const int f0 = blockIdx.x * 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ldw = D / 8, lds = D / 32, G = D / 32;
    const int gb = warp * G / WARPS, ge = (warp + 1) * G / WARPS;
    const int32_t* Wg = w13 + ((size_t)e * 2 * I + f0) * ldw;
    const int32_t* Wu = w13 + ((size_t)e * 2 * I + I + f0) * ldw;
    const uint16_t* Sg = s13 + ((size_t)e * 2 * I + f0) * lds;
    const uint16_t* Su = s13 + ((size_t)e * 2 * I + I + f0) * lds;
    for (int pc = p0; pc < p1; pc += 8 * NT) {
        const uint16_t* xr[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int p = pc + nt * 8 + (lane >> 2);
            xr[nt] = p < p1 ? x + (size_t)pair_tok[p] * D : nullptr;
        }
        float ag[NT][4] = {}, au[NT][4] = {};
        for (int grp = gb; grp < ge; ++grp) {
            uint32_t b[NT][4];
            load_b(b, xr, grp);  // shared by the gate and up tiles
            tile_group(ag, Wg, Sg, ldw, lds, grp, b);
            tile_group(au, Wu, Su, ldw, lds, grp, b);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) { red[warp][0][nt][lane * 4 + i] = ag[nt][i]; red[warp][1][nt][lane * 4 + i] = au[nt][i]; }
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
}

extern "C" __global__ void __launch_bounds__(256) moe_down(
    const uint16_t* __restrict__ h, const int32_t* __restrict__ pair_tok, const float* __restrict__ pair_w,
    const int32_t* __restrict__ expert_off, const int32_t* __restrict__ active, const int32_t* __restrict__ w2,
    const uint16_t* __restrict__ s2, int D, int I, float* __restrict__ out) {
    __shared__ float red[WARPS][NT][128];
    const int e = active[blockIdx.y], p0 = expert_off[e], p1 = expert_off[e + 1];
    if (p0 >= p1) return;
    const int d0 = blockIdx.x * 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ldw = I / 8, lds = I / 32, G = I / 32;
    const int gb = warp * G / WARPS, ge = (warp + 1) * G / WARPS;
    const int32_t* W = w2 + ((size_t)e * D + d0) * ldw;
    const uint16_t* S = s2 + ((size_t)e * D + d0) * lds;
    for (int pc = p0; pc < p1; pc += 8 * NT) {
        const uint16_t* hr[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int p = pc + nt * 8 + (lane >> 2);
            hr[nt] = p < p1 ? h + (size_t)p * I : nullptr;
        }
        float acc[NT][4] = {};
        for (int grp = gb; grp < ge; ++grp) {
            uint32_t b[NT][4];
            load_b(b, hr, grp);
            tile_group(acc, W, S, ldw, lds, grp, b);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][nt][lane * 4 + i] = acc[nt][i];
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
}
