// common.cuh: what every kernel source shares: fixed-width integer types for both nvcc and NVRTC (which ships
// no <stdint.h>), and the device helpers written once for several families.
#pragma once
#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#define NEG_INF __int_as_float(0xff800000)

// bf16 bits (the low 16 bits of v16) -> fp32, exactly.
__device__ __forceinline__ float bf16f(uint32_t v16) { return __uint_as_float(v16 << 16); }

// Eight bf16 (16 bytes, the lower index in each word's low half) -> fp32, exactly.
__device__ __forceinline__ void unpack8(const uint4& q, float* f) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { f[2 * i] = bf16f(w[i] & 0xffffu); f[2 * i + 1] = bf16f(w[i] >> 16); }
}

// The sum of v over the warp's 32 lanes, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// c[0..3] += A (16 x 16, row-major bf16 fragment a[0..3]) x B (16 x 8, col-major bf16 fragment b0, b1), fp32
// accumulate: mma.sync m16n8k16 (sm_80 and later).
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
