// attn_merge.cu: two attention passes of the same query rows over disjoint key sets, merged by log-sum-exp
// (the prefix / rest split of a verify: kdtree.ops.attn_split, layers.kernel_attention).
//
// Golden twin: kdtree/ops/attn_merge_golden.py  merge_states (float64). Wrapper: kdtree/ops/attn_merge.py.
//
// merge_states_bf16   grid ceil(R / 8), block 256 (a warp a row: 8 values a lane a step)
//   o1, o2   bf16 [R, D]   each pass's output, normalised over its own keys; D a multiple of 8, rows 16-byte
//                          aligned
//   l1, l2   fp32 [R]      each pass's natural-log log-sum-exp; -inf: the pass saw no key, and its o row is
//                          ignored whatever it holds (NaN included)
//   o        bf16 [R, D]   rb((w1 o1 + w2 o2) / (w1 + w2)), w_i = exp(l_i - max(l1, l2)); 0 where both
//                          are -inf
//   lse      fp32 [R]      max(l1, l2) + log(w1 + w2); -inf where both are
//   Inputs are finite or -inf (the caller's contract). A pass whose weight is 0 is not read.
#include <cuda_bf16.h>
#include "common.cuh"

#define MERGE_ROWS 8   // rows a block (ops.attn_merge.MERGE_ROWS)

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    const __nv_bfloat16 a = __float2bfloat16_rn(lo), b = __float2bfloat16_rn(hi);
    return (uint32_t)(*reinterpret_cast<const uint16_t*>(&a)) |
           ((uint32_t)(*reinterpret_cast<const uint16_t*>(&b)) << 16);
}

extern "C" __global__ void __launch_bounds__(256) merge_states_bf16(
    const uint16_t* __restrict__ o1, const float* __restrict__ l1, const uint16_t* __restrict__ o2,
    const float* __restrict__ l2, long long R, int D, uint16_t* __restrict__ o, float* __restrict__ lse) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * MERGE_ROWS + warp;
    if (r >= R) return;
    const float a = l1[r], b = l2[r];
    const float mx = fmaxf(a, b);
    const bool none = mx == NEG_INF;
    const float m = none ? 0.f : mx;
    const float w1 = expf(a - m), w2 = expf(b - m);  // exp(-inf) = 0: an empty pass weighs nothing
    const float den = w1 + w2;
    const float s1 = w1 > 0.f ? w1 / den : 0.f, s2 = w2 > 0.f ? w2 / den : 0.f;
    const uint4* p1 = reinterpret_cast<const uint4*>(o1 + r * D);
    const uint4* p2 = reinterpret_cast<const uint4*>(o2 + r * D);
    uint4* q = reinterpret_cast<uint4*>(o + r * D);
    for (int v = lane; v < D / 8; v += 32) {
        float f1[8], f2[8];
        if (s1 > 0.f) unpack8(p1[v], f1);
        if (s2 > 0.f) unpack8(p2[v], f2);
        float y[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = (s1 > 0.f ? s1 * f1[i] : 0.f) + (s2 > 0.f ? s2 * f2[i] : 0.f);
        q[v] = make_uint4(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]), pack_bf16x2(y[4], y[5]),
                          pack_bf16x2(y[6], y[7]));
    }
    if (lane == 0) lse[r] = none ? NEG_INF : m + logf(den);
}
