// decode_fused.cu: the small kernels of the fused MLA + MoE decode layer (kdtree/fused.py), each replacing a
// chain of torch glue ops with the torch reference's own bf16 rounding at every step it rounds.
//
// Golden twin: kdtree/ops/decode_golden.py (numpy, same names). Wrappers: kdtree/ops/decode.py.
// bf16 tensors travel as uint16 bits; "rb(v)" below is v rounded to bf16 (round to nearest even) and back.
//
// add_rmsnorm     grid (M), block a multiple of 32 up to 1024 (ops.decode: enough for one 8-wide chunk a thread
//                 where D allows). x, delta, shared_, y, x_out bf16 [M, D]; routed fp32 [M, D]; w bf16 [D];
//                 D a multiple of 8. The residual step then RMSNorm of a decoder layer:
//                   s     = routed ? (shared_ ? rb(rb(routed) + shared_) : rb(routed)) : delta (may be null)
//                   x_out = s ? rb(x + s) : x
//                   y     = rb(w * rb(x_out * rsqrt(mean(x_out^2) + eps)))
//                 (MoE.forward's y.to(bf16) + shared, Block's x + ..., RMSNorm.forward).
// mla_latent      grid (M), block 256. qkv bf16 [M, QL + R + P] (q_a rows, then kv_a's latent and rope key);
//                 wq bf16 [QL], wkv bf16 [R]; cos, sin bf16 [M, P/2]; slots int64 [M]; pool bf16 [rows, R + P].
//                   q_out[m]           = RMSNorm(qkv[m, :QL]) * wq                         (QL may be 0)
//                   pool[slots[m], :R] = RMSNorm(qkv[m, QL:QL+R]) * wkv
//                   pool[slots[m], R:] = rope(qkv[m, QL+R:], cos[m], sin[m])
// q_absorb        grid (R / 256, H, ceil(M / QA_ROWS)), block 256. qb bf16 [M, H, Dn + P] (q_b's output);
//                 wkvb bf16 [H, Dn + Dv, R] (kv_b_proj's weight); qk bf16 [M, H, R + P]:
//                   qk[m, h, :R] = rb(sum_d qb[m, h, d] wkvb[h, d, :])   (d < Dn, fp32 accumulation)
//                   qk[m, h, R:] = rope(qb[m, h, Dn:], cos[m], sin[m])
// uv_absorb       grid (Dv / 32, H, ceil(M / UV_ROWS)), block 256. o_lat bf16 [M, H, R]; out bf16 [M, H * Dv]:
//                   out[m, h * Dv + d] = rb(sum_r o_lat[m, h, r] wkvb[h, Dn + d, r])
// router_scores   grid (E, ceil(M / RS_ROWS)), block 128. x bf16 [M, D], w bf16 [E, D] -> scores fp32 [M, E]
//                 = sigmoid(x . w_e) with fp32 products and sums (Gate.scores).
// router_select_jJ grid (ceil(M / 4)), block 128 (a warp a row), J in SEL_JS (E <= 32 J: ops.decode takes the
//                 smallest). scores fp32 [M, E] (E <= 1024), bias [E] fp32
//                 (bias_bf16 = 0) or bf16 bits (bias_bf16 = 1)
//                 -> weights fp32 [M, k], ids int32 [M, k] (k <= 32): Gate.forward's noaux_tc selection:
//                 c = scores + bias; with n_group > 1 only the topk_group groups of largest top-2 sum stay;
//                 ids = the k largest c (ties to the lower id), in that order; weights = scores[ids],
//                 / (sum + 1e-20) when norm, times scale.
// silu_mul        grid (ceil(M * I / 2048)), block 256. g, u bf16 rows of I at row stride ld (a fused gate+up
//                 GEMM's halves, or two GEMMs' outputs); out bf16 [M, I] = rb(rb(silu(g)) * u). I % 8 == 0.
//
// rope (interleave = 1, DeepSeek's storage): x1 = x[2i], x2 = x[2i + 1]; else x1 = x[i], x2 = x[i + P/2]:
//   out[i] = rb(rb(x1 c_i) - rb(x2 s_i)), out[i + P/2] = rb(rb(x2 c_i) + rb(x1 s_i))     (model.apply_rope)
#include <cuda_bf16.h>
#include "common.cuh"

#define QA_ROWS 4     // q_absorb: query rows a block (ops.decode.QA_ROWS)
#define UV_ROWS 4     // uv_absorb: rows a block (ops.decode.UV_ROWS)
#define RS_ROWS 8     // router_scores: rows a block (ops.decode.RS_ROWS)
#define SEL_MAX_E 1024
#define SEL_MAX_K 32
#define AN_CHUNKS 4   // add_rmsnorm: 8-wide chunks a thread keeps in registers (more are read back)

__device__ __forceinline__ float rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ uint16_t f2b(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float b2f(uint16_t v) { return bf16f(v); }

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)f2b(f[2 * i]) | ((uint32_t)f2b(f[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Sums of a and b over the block (blockDim.x a multiple of 32, <= 1024); every thread gets both.
__device__ __forceinline__ void block_sum2(float& a, float& b) {
    __shared__ float red[2][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();  // red may still be read by an earlier call
    if (lane == 0) { red[0][warp] = a; red[1][warp] = b; }
    __syncthreads();
    a = lane < nw ? red[0][lane] : 0.f;
    b = lane < nw ? red[1][lane] : 0.f;
    a = warp_sum(a);
    b = warp_sum(b);
}

// One rotated pair of a rope: (x1, x2) by (c, s) -> (o1, o2), model.apply_rope's bf16 steps.
__device__ __forceinline__ void rope_pair(float x1, float x2, float c, float s, float& o1, float& o2) {
    o1 = rb(rb(x1 * c) - rb(x2 * s));
    o2 = rb(rb(x2 * c) + rb(x1 * s));
}

// Rope of P values x (bf16) into out (bf16), pair i handled by thread t of nt (cos/sin bf16 [P/2]).
__device__ __forceinline__ void rope_row(const uint16_t* x, const uint16_t* cs, const uint16_t* sn, int P,
                                         int interleave, uint16_t* out, int t, int nt) {
    const int half = P / 2;
    for (int i = t; i < half; i += nt) {
        const float x1 = b2f(interleave ? x[2 * i] : x[i]);
        const float x2 = b2f(interleave ? x[2 * i + 1] : x[i + half]);
        float o1, o2;
        rope_pair(x1, x2, b2f(cs[i]), b2f(sn[i]), o1, o2);
        out[i] = f2b(o1);
        out[i + half] = f2b(o2);
    }
}

extern "C" __global__ void __launch_bounds__(1024) add_rmsnorm(
    const uint16_t* __restrict__ x, const float* __restrict__ routed, const uint16_t* __restrict__ shared_,
    const uint16_t* __restrict__ delta, const uint16_t* __restrict__ w, int D, float eps,
    uint16_t* __restrict__ x_out, uint16_t* __restrict__ y) {
    const size_t row = (size_t)blockIdx.x * D;
    const bool add = routed != nullptr || delta != nullptr;
    const int step = blockDim.x * 8;
    float keep[AN_CHUNKS][8];  // the x_out values of this thread's first AN_CHUNKS chunks
    float ss = 0.f, unused = 0.f;
    int k = 0;
    for (int i = threadIdx.x * 8; i < D; i += step, k++) {
        float v[8];
        unpack8(*reinterpret_cast<const uint4*>(x + row + i), v);
        if (add) {
            float s[8];
            if (routed != nullptr) {
                const float4 r0 = *reinterpret_cast<const float4*>(routed + row + i);
                const float4 r1 = *reinterpret_cast<const float4*>(routed + row + i + 4);
                s[0] = rb(r0.x); s[1] = rb(r0.y); s[2] = rb(r0.z); s[3] = rb(r0.w);
                s[4] = rb(r1.x); s[5] = rb(r1.y); s[6] = rb(r1.z); s[7] = rb(r1.w);
                if (shared_ != nullptr) {
                    float h[8];
                    unpack8(*reinterpret_cast<const uint4*>(shared_ + row + i), h);
#pragma unroll
                    for (int j = 0; j < 8; j++) s[j] = rb(s[j] + h[j]);
                }
            } else {
                unpack8(*reinterpret_cast<const uint4*>(delta + row + i), s);
            }
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = rb(v[j] + s[j]);
        }
#pragma unroll
        for (int j = 0; j < 8; j++) ss += v[j] * v[j];
        *reinterpret_cast<uint4*>(x_out + row + i) = pack8(v);
#pragma unroll
        for (int c = 0; c < AN_CHUNKS; c++)
            if (c == k)
#pragma unroll
                for (int j = 0; j < 8; j++) keep[c][j] = v[j];
    }
    block_sum2(ss, unused);
    const float inv = rsqrtf(ss / (float)D + eps);
    k = 0;
    for (int i = threadIdx.x * 8; i < D; i += step, k++) {  // this thread's own elements of x_out
        float v[8], g[8];
        if (k < AN_CHUNKS) {
#pragma unroll
            for (int c = 0; c < AN_CHUNKS; c++)
                if (c == k)
#pragma unroll
                    for (int j = 0; j < 8; j++) v[j] = keep[c][j];
        } else {
            unpack8(*reinterpret_cast<const uint4*>(x_out + row + i), v);
        }
        unpack8(*reinterpret_cast<const uint4*>(w + i), g);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = g[j] * rb(v[j] * inv);
        *reinterpret_cast<uint4*>(y + row + i) = pack8(v);
    }
}

extern "C" __global__ void mla_latent(const uint16_t* __restrict__ qkv, int QL, int R, int P,
                                      const uint16_t* __restrict__ wq, const uint16_t* __restrict__ wkv,
                                      const uint16_t* __restrict__ cs, const uint16_t* __restrict__ sn,
                                      const int64_t* __restrict__ slots, float eps, int interleave,
                                      uint16_t* __restrict__ q_out, uint16_t* __restrict__ pool) {
    const int m = blockIdx.x, W = QL + R + P;
    const uint16_t* row = qkv + (size_t)m * W;
    float sq = 0.f, skv = 0.f;
    for (int i = threadIdx.x; i < QL; i += blockDim.x) { const float v = b2f(row[i]); sq += v * v; }
    for (int i = threadIdx.x; i < R; i += blockDim.x) { const float v = b2f(row[QL + i]); skv += v * v; }
    block_sum2(sq, skv);
    const float iq = rsqrtf(sq / (float)(QL > 0 ? QL : 1) + eps), ikv = rsqrtf(skv / (float)R + eps);
    for (int i = threadIdx.x; i < QL; i += blockDim.x)
        q_out[(size_t)m * QL + i] = f2b(b2f(wq[i]) * rb(b2f(row[i]) * iq));
    uint16_t* dst = pool + (size_t)slots[m] * (R + P);
    for (int i = threadIdx.x; i < R; i += blockDim.x) dst[i] = f2b(b2f(wkv[i]) * rb(b2f(row[QL + i]) * ikv));
    rope_row(row + QL + R, cs + (size_t)m * (P / 2), sn + (size_t)m * (P / 2), P, interleave, dst + R,
             threadIdx.x, blockDim.x);
}

// Block: 256 columns of one head (32 threads x 8 columns) x 8 groups of the Dn rows (group g takes d = g, g + 8,
// ...); the groups' partial sums meet in shared memory. QA_ROWS query rows a block.
extern "C" __global__ void q_absorb(const uint16_t* __restrict__ qb, const uint16_t* __restrict__ wkvb,
                                    const uint16_t* __restrict__ cs, const uint16_t* __restrict__ sn, int M, int H,
                                    int Dn, int Dv, int R, int P, int interleave, uint16_t* __restrict__ qk) {
    extern __shared__ float smem[];  // qn [QA_ROWS][Dn], then part [8][QA_ROWS][256]
    float* qn = smem;
    float* part = smem + QA_ROWS * Dn;
    const int h = blockIdx.y, m0 = blockIdx.z * QA_ROWS, t = threadIdx.x;
    const int lane = t & 31, g = t >> 5, c0 = blockIdx.x * 256 + lane * 8;
    const int Dq = Dn + P;
    for (int i = t; i < QA_ROWS * Dn; i += blockDim.x) {
        const int j = i / Dn, d = i % Dn;
        qn[i] = m0 + j < M ? b2f(qb[((size_t)(m0 + j) * H + h) * Dq + d]) : 0.f;
    }
    __syncthreads();
    float acc[QA_ROWS][8];
#pragma unroll
    for (int j = 0; j < QA_ROWS; j++)
#pragma unroll
        for (int c = 0; c < 8; c++) acc[j][c] = 0.f;
    const uint16_t* wh = wkvb + (size_t)h * (Dn + Dv) * R + c0;
#pragma unroll 4
    for (int d = g; d < Dn; d += 8) {
        float wv[8];
        unpack8(__ldg(reinterpret_cast<const uint4*>(wh + (size_t)d * R)), wv);
#pragma unroll
        for (int j = 0; j < QA_ROWS; j++) {
            const float q = qn[j * Dn + d];
#pragma unroll
            for (int c = 0; c < 8; c++) acc[j][c] += q * wv[c];
        }
    }
#pragma unroll
    for (int j = 0; j < QA_ROWS; j++)
#pragma unroll
        for (int c = 0; c < 8; c++) part[(g * QA_ROWS + j) * 256 + lane * 8 + c] = acc[j][c];
    __syncthreads();
    for (int i = t; i < QA_ROWS * 256; i += blockDim.x) {  // (row j, column c) sums over the 8 groups, in order
        const int j = i / 256, c = i % 256;
        if (m0 + j >= M) continue;
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) s += part[(k * QA_ROWS + j) * 256 + c];
        qk[((size_t)(m0 + j) * H + h) * (R + P) + blockIdx.x * 256 + c] = f2b(s);
    }
    if (blockIdx.x == 0) {  // the rope part of these rows: warp j < QA_ROWS takes row m0 + j
        if (g < QA_ROWS && m0 + g < M) {
            const int m = m0 + g;
            rope_row(qb + ((size_t)m * H + h) * Dq + Dn, cs + (size_t)m * (P / 2), sn + (size_t)m * (P / 2), P,
                     interleave, qk + ((size_t)m * H + h) * (R + P) + R, lane, 32);
        }
    }
}

// Block: 32 output dims d of one head, a warp taking 4; a lane reads 8 of each weight row's R columns per
// step (16 bytes), UV_ROWS rows of o_lat held in shared memory.
extern "C" __global__ void uv_absorb(const uint16_t* __restrict__ o_lat, const uint16_t* __restrict__ wkvb, int M,
                                     int H, int Dn, int Dv, int R, uint16_t* __restrict__ out) {
    extern __shared__ float ol[];  // [UV_ROWS][R]
    const int h = blockIdx.y, m0 = blockIdx.z * UV_ROWS, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    for (int i = t; i < UV_ROWS * R; i += blockDim.x) {
        const int j = i / R, r = i % R;
        ol[i] = m0 + j < M ? b2f(o_lat[((size_t)(m0 + j) * H + h) * R + r]) : 0.f;
    }
    __syncthreads();
    const int d0 = blockIdx.x * 32 + warp * 4;
    float acc[4][UV_ROWS];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int j = 0; j < UV_ROWS; j++) acc[a][j] = 0.f;
#pragma unroll 2
    for (int r = lane * 8; r < R; r += 256) {
#pragma unroll
        for (int a = 0; a < 4; a++) {
            float wv[8];
            unpack8(__ldg(reinterpret_cast<const uint4*>(wkvb + ((size_t)h * (Dn + Dv) + Dn + d0 + a) * R + r)), wv);
#pragma unroll
            for (int j = 0; j < UV_ROWS; j++)
#pragma unroll
                for (int c = 0; c < 8; c++) acc[a][j] += ol[j * R + r + c] * wv[c];
        }
    }
    const int rows = min(UV_ROWS, M - m0);  // the same on every lane: warp_sum only for real rows
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int j = 0; j < UV_ROWS; j++) {
            if (j >= rows) break;
            const float s = warp_sum(acc[a][j]);
            if (lane == 0) out[(size_t)(m0 + j) * H * Dv + (size_t)h * Dv + d0 + a] = f2b(s);
        }
}

// Block: one expert, 128 threads; thread t reads the 8 weights at t * 8 + 1024 k (16 bytes each, all of a
// thread's loads independent) and the same 8 of each of RS_ROWS input rows; warp sums, then the 4 warps' in
// shared memory.
extern "C" __global__ void router_scores(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w, int M,
                                         int D, int E, float* __restrict__ scores) {
    __shared__ float red[4][RS_ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, e = blockIdx.x, m0 = blockIdx.y * RS_ROWS;
    const int rows = min(RS_ROWS, M - m0);
    float acc[RS_ROWS];
#pragma unroll
    for (int j = 0; j < RS_ROWS; j++) acc[j] = 0.f;
    const uint16_t* we = w + (size_t)e * D;
#pragma unroll 4
    for (int i = threadIdx.x * 8; i < D; i += 1024) {
        float wv[8];
        unpack8(__ldg(reinterpret_cast<const uint4*>(we + i)), wv);
#pragma unroll
        for (int j = 0; j < RS_ROWS; j++) {
            if (j >= rows) break;
            float xv[8];
            unpack8(__ldg(reinterpret_cast<const uint4*>(x + (size_t)(m0 + j) * D + i)), xv);
#pragma unroll
            for (int c = 0; c < 8; c++) acc[j] += xv[c] * wv[c];
        }
    }
#pragma unroll
    for (int j = 0; j < RS_ROWS; j++) {
        const float s = warp_sum(acc[j]);
        if (lane == 0) red[warp][j] = s;
    }
    __syncthreads();
    if (threadIdx.x < rows) {
        const int j = threadIdx.x;
        const float s = (red[0][j] + red[1][j]) + (red[2][j] + red[3][j]);
        scores[(size_t)(m0 + j) * E + e] = 1.f / (1.f + expf(-s));
    }
}

// The warp's best (value, id) of all lanes': larger value, ties to the lower id; lanes with no candidate
// carry (-inf, INT_MAX).
__device__ __forceinline__ void warp_argmax(float& v, int& id) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oid = __shfl_xor_sync(0xffffffffu, id, o);
        if (ov > v || (ov == v && oid < id)) { v = ov; id = oid; }
    }
}

// One row a warp, lane l holding experts l + 32 j for j < J (E <= 32 J).
template <int J>
__device__ __forceinline__ void router_select_body(const float* __restrict__ scores, const void* __restrict__ bias,
        int bias_bf16, int M, int E, int n_group, int topk_group, int k, int norm, float scale,
        float* __restrict__ w_out, int* __restrict__ ids) {
    const int lane = threadIdx.x & 31, m = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (m >= M) return;
    const float* sc = scores + (size_t)m * E;
    float c[J];
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int e = lane + 32 * j;
        const float b = e >= E ? 0.f : bias_bf16 ? b2f(static_cast<const uint16_t*>(bias)[e])
                                                  : static_cast<const float*>(bias)[e];
        c[j] = e < E ? sc[e] + b : NEG_INF;
    }
    if (n_group > 1) {  // keep the topk_group groups whose two best choices sum highest
        const int gs = E / n_group;
        float gscore = NEG_INF;  // lane g holds group g's score
        for (int g = 0; g < n_group; g++) {
            float best[2];
            int taken = 0x7fffffff;
            for (int r = 0; r < 2; r++) {
                float v = NEG_INF;
                int id = 0x7fffffff;
#pragma unroll
                for (int j = 0; j < J; j++) {
                    const int e = lane + 32 * j;
                    if (e < E && e / gs == g && e != taken && (c[j] > v || (c[j] == v && e < id))) {
                        v = c[j];
                        id = e;
                    }
                }
                warp_argmax(v, id);
                best[r] = v;
                taken = id;
            }
            if (lane == g) gscore = best[0] + best[1];
        }
        unsigned keep = 0;
        for (int r = 0; r < topk_group; r++) {
            float v = lane < n_group && !((keep >> lane) & 1u) ? gscore : NEG_INF;
            int id = lane < n_group && !((keep >> lane) & 1u) ? lane : 0x7fffffff;
            warp_argmax(v, id);
            if (id < n_group) keep |= 1u << id;
        }
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int e = lane + 32 * j;
            if (e < E && !((keep >> (e / gs)) & 1u)) c[j] = NEG_INF;
        }
    }
    float wsel = 0.f, sum = 0.f;
    int mine = -1;  // lane r < k keeps the r-th choice
    for (int r = 0; r < k; r++) {
        float v = NEG_INF;
        int id = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int e = lane + 32 * j;
            if (e < E && (c[j] > v || (c[j] == v && e < id))) { v = c[j]; id = e; }
        }
        warp_argmax(v, id);
        if (id >= E) id = 0;  // fewer than k selectable experts (non-finite scores): expert 0, as topk's order
#pragma unroll
        for (int j = 0; j < J; j++)
            if (lane + 32 * j == id) c[j] = NEG_INF;
        const float s = sc[id];
        sum += s;  // the same order on every lane: the sum of the first r + 1 choices
        if (lane == r) { mine = id; wsel = s; }
    }
    if (lane < k) {
        float v = wsel;
        if (norm) v = v / (sum + 1e-20f);
        w_out[(size_t)m * k + lane] = v * scale;
        ids[(size_t)m * k + lane] = mine;
    }
}

// router_select_jJ: the body built for J experts a lane (ops.decode.SEL_JS)
#define ROUTER_SELECT(J)                                                                                 \
    extern "C" __global__ void router_select_j##J(                                                       \
        const float* __restrict__ scores, const void* __restrict__ bias, int bias_bf16, int M, int E,    \
        int n_group, int topk_group, int k, int norm, float scale, float* __restrict__ w_out,            \
        int* __restrict__ ids) {                                                                         \
        router_select_body<J>(scores, bias, bias_bf16, M, E, n_group, topk_group, k, norm, scale, w_out, \
                              ids);                                                                      \
    }
ROUTER_SELECT(4)
ROUTER_SELECT(8)
ROUTER_SELECT(12)
ROUTER_SELECT(16)
ROUTER_SELECT(32)

extern "C" __global__ void silu_mul(const uint16_t* __restrict__ g, const uint16_t* __restrict__ u, int M, int I,
                                    int ld, uint16_t* __restrict__ out) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= (size_t)M * I) return;
    const size_t m = i / I, c = i % I;
    float a[8], b[8];
    unpack8(*reinterpret_cast<const uint4*>(g + m * ld + c), a);
    unpack8(*reinterpret_cast<const uint4*>(u + m * ld + c), b);
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] = rb(a[j] / (1.f + expf(-a[j]))) * b[j];
    *reinterpret_cast<uint4*>(out + i) = pack8(a);
}
