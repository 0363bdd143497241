// plan_estimates.cu: the cost-aware budget's expected emitted tokens per request and plan, in one launch.
//
// Golden twin: kdtree/ops/plan_estimates_golden.py  plan_estimates (float64).
// Wrappers: kdtree/ops/plan_estimates.py. The torch twin kdtree.budget.expected computes the same (CPU
// engines); this kernel replaces its ~30 launches in a graphed round's front phase.
//
// plan_estimates     grid batch, block 256, static smem (MAX_NODES + 8) floats
//   scores float [batch, N], depths int32 [batch, N]: a best-first verify block (row 0 the root; N - 1 = n
//   nodes, 1 <= n <= MAX_NODES; depth 0 = not a node). chain_lp float: the chain's top-1 log-probability of
//   request i at depth d (0-based, d < L <= 64) at chain_lp[i * lp_row + d * lp_col].
//   inner float [E]: the calibration bins' inner edges (E >= 0), table float [D2, E + 1]: row 0 zeros, row
//   r >= 1 the realized / predicted ratio of depth r (row D2 - 1 also serves deeper nodes).
//   Acceptance of a node of depth r and log prefix probability s: p = exp(s), j = #{inner edges <= p},
//   q = min(p * table[min(r, D2 - 1), j], 1).
//   idx int32 [T]: per tree plan, the cumulative count's index min(m, n) - 1; kexp float [T]: log2(m / n)
//   clamped at 0 (the doublings past the block). extrapolate != 0 when some kexp > 0.
//   Writes out[i * out_row + c], c < T + 2: 1 (AR), 1 + sum of the chain's q (its prefix probabilities
//   exp(cumsum(chain_lp))), then per tree plan 1 + cum[idx] (+ the extrapolation
//   d * rho * expm1(k log rho) / expm1(log rho), a = cum[n - 1], d = a - cum[n/2 - 1] (a when n < 2),
//   rho = d / max(cum[n/2 - 1] - cum[n/4 - 1], 1e-30) for n >= 4 else 1, clamped to [1e-12, 1 - 1e-6]).
//   cum: the inclusive prefix sums of the nodes' q in row order (a block-wide scan; float32, so sums may
//   differ from a sequential sum by rounding).
#include "common.cuh"

#define PE_THREADS 256
#define PE_MAX_NODES 1024
#define PE_PER_THREAD (PE_MAX_NODES / PE_THREADS)
#define PE_MAX_CHAIN 64

__device__ __forceinline__ float pe_accept(float s, int r, const float* __restrict__ inner, int E,
                                           const float* __restrict__ table, int D2) {
    const float p = expf(s);
    int j = 0;
    for (int e = 0; e < E; ++e) j += inner[e] <= p;
    const int row = r < D2 - 1 ? r : D2 - 1;
    return fminf(p * table[row * (E + 1) + j], 1.0f);
}

__device__ __forceinline__ float warp_incl_scan(float v, int lane) {
    for (int o = 1; o < 32; o <<= 1) {
        const float u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    return v;
}

extern "C" __global__ void __launch_bounds__(PE_THREADS) plan_estimates(
    const float* __restrict__ scores, const int32_t* __restrict__ depths, int N,
    const float* __restrict__ chain_lp, int lp_row, int lp_col, int L,
    const float* __restrict__ inner, int E, const float* __restrict__ table, int D2,
    const int32_t* __restrict__ idx, const float* __restrict__ kexp, int T, int extrapolate,
    float* __restrict__ out, int out_row) {
    __shared__ float cum[PE_MAX_NODES];
    __shared__ float warp_tot[PE_THREADS / 32];
    __shared__ float chain_sum;
    const int i = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int n = N - 1;
    const float* sc = scores + (size_t)i * N + 1;
    const int32_t* dp = depths + (size_t)i * N + 1;
    // each thread's consecutive run of nodes: its q values, their running sum
    const int per = (n + PE_THREADS - 1) / PE_THREADS;
    const int lo = t * per, hi = min(lo + per, n);
    float q[PE_PER_THREAD];
    float run = 0.0f;
#pragma unroll
    for (int k = 0; k < PE_PER_THREAD; ++k) {
        const int j = lo + k;
        q[k] = 0.0f;
        if (k < per && j < hi) {
            const int r = dp[j];
            q[k] = r > 0 ? pe_accept(sc[j], r, inner, E, table, D2) : 0.0f;
            run += q[k];
        }
    }
    // block-wide exclusive offset of this thread's run
    const float incl = warp_incl_scan(run, lane);
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        float w = lane < PE_THREADS / 32 ? warp_tot[lane] : 0.0f;
        w = warp_incl_scan(w, lane);
        if (lane < PE_THREADS / 32) warp_tot[lane] = w;
    }
    __syncthreads();
    float acc = (incl - run) + (warp > 0 ? warp_tot[warp - 1] : 0.0f);
#pragma unroll
    for (int k = 0; k < PE_PER_THREAD; ++k) {
        const int j = lo + k;
        if (k < per && j < hi) {
            acc += q[k];
            cum[j] = acc;
        }
    }
    // the chain (warp 1): prefix log-probabilities by depth, their acceptance summed
    if (warp == 1) {
        float carry = 0.0f, total = 0.0f;
        for (int d0 = 0; d0 < L; d0 += 32) {
            const int d = d0 + lane;
            float lp = d < L ? chain_lp[(size_t)i * lp_row + (size_t)d * lp_col] : 0.0f;
            const float pre = warp_incl_scan(lp, lane) + carry;
            float qc = d < L ? pe_accept(pre, d + 1, inner, E, table, D2) : 0.0f;
            for (int o = 16; o > 0; o >>= 1) qc += __shfl_xor_sync(0xffffffffu, qc, o);
            total += qc;
            carry = __shfl_sync(0xffffffffu, pre, 31);
        }
        if (lane == 0) chain_sum = total;
    }
    __syncthreads();
    float* o = out + (size_t)i * out_row;
    if (t == 0) {
        o[0] = 1.0f;
        o[1] = 1.0f + chain_sum;
    }
    if (t < T) {
        float v = cum[idx[t]];
        if (extrapolate) {
            const float a = cum[n - 1];
            const float h = n >= 2 ? cum[n / 2 - 1] : 0.0f;
            const float d = a - h;
            float rho = 1.0f;
            if (n >= 4) rho = d / fmaxf(h - cum[n / 4 - 1], 1e-30f);
            rho = fminf(fmaxf(rho, 1e-12f), 1.0f - 1e-6f);
            const float lr = logf(rho);
            v += d * rho * expm1f(kexp[t] * lr) / expm1f(lr);
        }
        o[2 + t] = 1.0f + v;
    }
}
