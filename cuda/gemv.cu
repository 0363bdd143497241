// gemv.cu: skinny bf16 GEMMs for decode, y = x W^T with few rows of x, streaming W once.
//
// Golden twin: kdtree/ops/gemv_golden.py  gemv (float64 sums, bf16 output). Wrapper: kdtree/ops/gemv.py.
//
// gemv_bf16   grid (ceil(N / 8), ceil(M / GEMV_ROWS)), block 256 (8 warps, a warp an output column n), dynamic
//             smem GEMV_ROWS x GEMV_CHUNK bf16 (the x rows of one K chunk)
//   x   bf16 [M, K]   K a multiple of 8; rows 16-byte aligned
//   w   bf16 [N, K]   (nn.Linear's weight)
//   y   bf16 [M, N]   y[m, n] = rb(sum_k x[m, k] w[n, k]), fp32 products and sums
//   Each lane reads 16 bytes of its warp's weight row per step (a warp 512 bytes, four steps in flight),
//   the x chunk from shared memory; the lanes' sums meet by shuffles.
#include <cuda_bf16.h>
#include "common.cuh"

#define GEMV_ROWS 8       // rows of x a block (ops.gemv.GEMV_ROWS)
#define GEMV_CHUNK 2048   // columns of x staged at a time (ops.gemv.GEMV_CHUNK)


extern "C" __global__ void gemv_bf16(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w, int M, int N,
                                     int K, uint16_t* __restrict__ y) {
    extern __shared__ uint4 xs[];  // [GEMV_ROWS][GEMV_CHUNK / 8]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * 8 + warp, m0 = blockIdx.y * GEMV_ROWS;
    const int rows = min(GEMV_ROWS, M - m0);
    float acc[GEMV_ROWS];
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) acc[j] = 0.f;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)(n < N ? n : 0) * K);
    for (int k0 = 0; k0 < K; k0 += GEMV_CHUNK) {
        const int kc = min(GEMV_CHUNK, K - k0) / 8;  // 16-byte vectors in this chunk
        __syncthreads();  // the previous chunk's readers are done
        for (int i = threadIdx.x; i < rows * kc; i += blockDim.x) {
            const int j = i / kc, v = i % kc;
            xs[j * (GEMV_CHUNK / 8) + v] = reinterpret_cast<const uint4*>(x + (size_t)(m0 + j) * K + k0)[v];
        }
        __syncthreads();
        if (n < N) {
#pragma unroll 4
            for (int v = lane; v < kc; v += 32) {
                float wv[8];
                unpack8(__ldg(wr + k0 / 8 + v), wv);
#pragma unroll
                for (int j = 0; j < GEMV_ROWS; j++) {
                    if (j < rows) {
                        float xv[8];
                        unpack8(xs[j * (GEMV_CHUNK / 8) + v], xv);
#pragma unroll
                        for (int c = 0; c < 8; c++) acc[j] += xv[c] * wv[c];
                    }
                }
            }
        }
    }
    if (n >= N) return;
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        const float s = warp_sum(acc[j]);
        if (lane == 0 && j < rows) y[(size_t)(m0 + j) * N + n] = __bfloat16_as_ushort(__float2bfloat16_rn(s));
    }
}
