// moe_bf16.cu: routed MoE experts with bf16 weights for a few token-expert pairs a call (decode, short chains
// and small trees): one warp per weight row, every lane streaming 16 bytes of it per step, fp32 accumulation.
//
// Golden twin: kdtree/ops/moe_bf16_golden.py  moe_bf16 (float64).
// Wrapper: kdtree/ops/moe_bf16.py. The pairs come grouped by expert from moe_int4.cu's moe_group_* (the
// wrapper calls kdtree.ops.moe_int4.group_pairs): pairs [expert_off[e], expert_off[e+1]) belong to expert e,
// pair p is token pair_tok[p] with weight pair_w[p]; block row y serves expert active[y] (an empty one returns).
//
// moe_bf16_gate_up   grid (ceil(I / 8), S), block 256 (8 warps)
//   x         bf16 [T, D] (as uint16)           w13  bf16 [E, 2I, D] (rows [0, I) gate, [I, 2I) up)
//   h         bf16 [P, I]                       h[p, f] = bf16(silu(gate_f . x) * (up_f . x)), x the token of
//                                               pair p; fp32 products and sums, silu as x / (1 + exp(-x))
//   Warp w of block x owns feature f = 8 x + w: its gate and up rows stream once per PC pairs (an expert with
//   more pairs re-reads them, from L2, for each further PC), the pairs' x rows from L1 / L2.
// moe_bf16_down   grid (ceil(D / 8), S), block 256
//   h as above; pair_w float [P]; w2 bf16 [E, D, I]
//   out       float [T, D], accumulated: out[t, d] += pair_w[p] * (down_d . h[p]) for every pair p of token t
//   (fp32 atomics: the wrapper zeroes out first; the summation order of a token's experts may vary).
// Shapes: D % 8 == 0, I % 8 == 0, rows 16-byte aligned (checked by the wrapper); lane l reads elements
// [8 l + 256 i, 8 l + 256 i + 8) of a row.
#include <cuda_bf16.h>
#include "common.cuh"

#define WARPS 8
#define PC 8  // pairs a warp holds at once: PC fp32 partial sums per row

// 16 bytes of a weight row, read once: past L1 (L1::no_allocate), so the activations stay there.
__device__ __forceinline__ uint4 ld_row(const uint16_t* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 ld_act(const uint16_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// acc += the dot product of two runs of 8 bf16 (fp32 products and sums, in index order)
__device__ __forceinline__ float dot8(const uint4 a, const uint4 b, float acc) {
    float fa[8], fb[8];
    unpack8(a, fa);
    unpack8(b, fb);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(fa[i], fb[i], acc);
    return acc;
}

__device__ __forceinline__ uint16_t to_bf16(float v) {  // round to nearest even; NaN stays NaN
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    return *reinterpret_cast<const uint16_t*>(&b);
}

extern "C" __global__ void __launch_bounds__(256) moe_bf16_gate_up(
    const uint16_t* __restrict__ x, const int32_t* __restrict__ pair_tok, const int32_t* __restrict__ expert_off,
    const int32_t* __restrict__ active, const uint16_t* __restrict__ w13, int D, int I, uint16_t* __restrict__ h) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = active[blockIdx.y], p0 = expert_off[e], p1 = expert_off[e + 1];
    const int f = blockIdx.x * WARPS + warp;
    if (p0 >= p1 || f >= I) return;
    const uint16_t* g_row = w13 + ((size_t)e * 2 * I + f) * D;
    const uint16_t* u_row = g_row + (size_t)I * D;
    for (int pc = p0; pc < p1; pc += PC) {
        const int n = min(PC, p1 - pc);
        const uint16_t* xr[PC];
#pragma unroll
        for (int j = 0; j < PC; ++j) xr[j] = x + (size_t)pair_tok[pc + min(j, n - 1)] * D;
        float ga[PC], ua[PC];
#pragma unroll
        for (int j = 0; j < PC; ++j) ga[j] = ua[j] = 0.f;
#pragma unroll 2
        for (int k = 8 * lane; k < D; k += 256) {
            const uint4 gw = ld_row(g_row + k), uw = ld_row(u_row + k);
#pragma unroll
            for (int j = 0; j < PC; ++j)
                if (j < n) {
                    const uint4 xv = ld_act(xr[j] + k);
                    ga[j] = dot8(gw, xv, ga[j]);
                    ua[j] = dot8(uw, xv, ua[j]);
                }
        }
#pragma unroll
        for (int j = 0; j < PC; ++j)
            if (j < n) {
                const float g = warp_sum(ga[j]), u = warp_sum(ua[j]);
                if (lane == 0) h[(size_t)(pc + j) * I + f] = to_bf16(g / (1.0f + __expf(-g)) * u);
            }
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_bf16_down(
    const uint16_t* __restrict__ h, const int32_t* __restrict__ pair_tok, const float* __restrict__ pair_w,
    const int32_t* __restrict__ expert_off, const int32_t* __restrict__ active, const uint16_t* __restrict__ w2,
    int D, int I, float* __restrict__ out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = active[blockIdx.y], p0 = expert_off[e], p1 = expert_off[e + 1];
    const int d = blockIdx.x * WARPS + warp;
    if (p0 >= p1 || d >= D) return;
    const uint16_t* row = w2 + ((size_t)e * D + d) * I;
    for (int pc = p0; pc < p1; pc += PC) {
        const int n = min(PC, p1 - pc);
        float acc[PC];
#pragma unroll
        for (int j = 0; j < PC; ++j) acc[j] = 0.f;
#pragma unroll 2
        for (int k = 8 * lane; k < I; k += 256) {
            const uint4 wv = ld_row(row + k);
#pragma unroll
            for (int j = 0; j < PC; ++j)
                if (j < n) acc[j] = dot8(wv, ld_act(h + (size_t)(pc + j) * I + k), acc[j]);
        }
#pragma unroll
        for (int j = 0; j < PC; ++j)
            if (j < n) {
                const float s = warp_sum(acc[j]);
                if (lane == 0) atomicAdd(out + (size_t)pair_tok[pc + j] * D + d, pair_w[pc + j] * s);
            }
    }
}
