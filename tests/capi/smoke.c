/* smoke.c: a C program on libkdtree.so alone (run by tests/test_capi.py on a GPU).
 *
 * Builds one tree from random logits, checks its invariants, walks it along a planted path, checks verify
 * attention (both kernels where the GPU has them) and the INT4 MoE (repacked; grouped and fused paths)
 * against float64 references computed here, checks that a bad call fails with a message, and times the
 * library's host cost: calls enqueued behind a GPU spin (so the GPU never throttles the host), against the
 * same number of launches of an empty kernel. Prints "smoke: ok" and, where KDTREE_SMOKE_JSON names a file,
 * writes the timings there. CUDA's driver API is opened with dlopen, as the library does, so the program
 * links against libkdtree.so, libdl and libm only.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>

#include "kdtree.h"

static void *cu;
#define CU(name) ((int (*)())dlsym(cu, #name))

static int failures;
#define EXPECT(cond, ...)                   \
    do {                                    \
        if (!(cond)) {                      \
            printf("FAILED: " __VA_ARGS__); \
            printf("\n");                   \
            ++failures;                     \
        }                                   \
    } while (0)

static const char *kPtx =
    ".version 7.0\n.target sm_80\n.address_size 64\n"
    ".visible .entry empty(.param .u64 a) { ret; }\n"
    ".visible .entry spin(.param .u64 cycles) {\n"
    "  .reg .u64 %r<4>; .reg .pred %p;\n"
    "  ld.param.u64 %r1, [cycles];\n  mov.u64 %r2, %clock64;\n"
    "LOOP:\n  mov.u64 %r3, %clock64;\n  sub.u64 %r3, %r3, %r2;\n  setp.lt.u64 %p, %r3, %r1;\n  @%p bra "
    "LOOP;\n"
    "  ret;\n}\n";

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static unsigned s_rng = 987654321u;
static float uniform(void) { /* in [-1, 1) */
    s_rng = s_rng * 1664525u + 1013904223u;
    return (float)((s_rng >> 8) & 0xffffff) / 8388608.0f - 1.0f;
}

static double rel_err(const float *got, const double *want, int n) {
    double num = 0, den = 0;
    for (int i = 0; i < n; ++i) {
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* Device buffers: every one is freed by dfree_all() before main returns (the sanitizer's leak check). */
static unsigned long long allocs[64];
static int n_allocs;

static unsigned long long dalloc(size_t n) {
    unsigned long long p = 0;
    if (n_allocs == 64 || CU(cuMemAlloc_v2)(&p, n)) {
        printf("FAILED: cuMemAlloc(%zu)\n", n);
        exit(1);
    }
    allocs[n_allocs++] = p;
    return p;
}

static void dfree_all(void) {
    while (n_allocs) CU(cuMemFree_v2)(allocs[--n_allocs]);
}

int main(void) {
    cu = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cu) {
        printf("no libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    int dev = 0;
    void *ctx = NULL, *mod = NULL, *f_empty = NULL, *f_spin = NULL, *stream = NULL;
    if (CU(cuInit)(0) || CU(cuDeviceGet)(&dev, 0) || CU(cuDevicePrimaryCtxRetain)(&ctx, dev) ||
        CU(cuCtxSetCurrent)(ctx) || CU(cuStreamCreate)(&stream, 0) || CU(cuModuleLoadData)(&mod, kPtx) ||
        CU(cuModuleGetFunction)(&f_empty, mod, "empty") || CU(cuModuleGetFunction)(&f_spin, mod, "spin")) {
        printf("FAILED: CUDA set-up\n");
        return 1;
    }
    EXPECT(kdtree_abi_version() == KDTREE_ABI_VERSION, "abi version");

    /* one tree: batch 1, depth 8, vocabulary 1000, budget 64, float32 logits */
    enum { L = 8, V = 1000, B = 64, N = B + 1, W = (N + 31) / 32 };
    static float logits[L * V];
    unsigned s = 12345;
    for (int i = 0; i < L * V; ++i) {
        s = s * 1664525u + 1013904223u;
        logits[i] = (float)((s >> 8) & 0xffff) / 4096.0f;
    }
    int32_t root = 7, start = 100;
    unsigned long long d_logits = dalloc(sizeof logits), d_root = dalloc(4), d_start = dalloc(4);
    unsigned long long d_tok = dalloc(4 * N), d_pos = dalloc(4 * N), d_par = dalloc(4 * N),
                       d_dep = dalloc(4 * N);
    unsigned long long d_sc = dalloc(4 * N), d_mask = dalloc(4 * N * W), d_n = dalloc(4);
    CU(cuMemcpyHtoD_v2)(d_logits, logits, sizeof logits);
    CU(cuMemcpyHtoD_v2)(d_root, &root, 4);
    CU(cuMemcpyHtoD_v2)(d_start, &start, 4);
    size_t ws_bytes = kdtree_tree_build_workspace(1, L, V, B);
    EXPECT(ws_bytes > 0, "workspace query: %s", kdtree_last_error());
    unsigned long long d_ws = dalloc(ws_bytes);
    int rc =
        kdtree_tree_build((void *)d_logits, KDTREE_F32, 1, L, V, B, (int32_t *)d_root, (int32_t *)d_start,
                          (int32_t *)d_tok, (int32_t *)d_pos, (int32_t *)d_par, (int32_t *)d_dep,
                          (float *)d_sc, (uint32_t *)d_mask, (int32_t *)d_n, (void *)d_ws, ws_bytes, stream);
    EXPECT(rc == KDTREE_OK, "tree_build: %s", kdtree_last_error());
    CU(cuStreamSynchronize)(stream);
    int32_t tok[N], pos[N], par[N], dep[N], n_nodes;
    uint32_t mask[N * W];
    CU(cuMemcpyDtoH_v2)(tok, d_tok, sizeof tok);
    CU(cuMemcpyDtoH_v2)(pos, d_pos, sizeof pos);
    CU(cuMemcpyDtoH_v2)(par, d_par, sizeof par);
    CU(cuMemcpyDtoH_v2)(dep, d_dep, sizeof dep);
    CU(cuMemcpyDtoH_v2)(mask, d_mask, sizeof mask);
    CU(cuMemcpyDtoH_v2)(&n_nodes, d_n, 4);
    EXPECT(n_nodes == B, "n_nodes %d", n_nodes);
    EXPECT(tok[0] == root && par[0] == -1 && pos[0] == start, "root row");
    int best = 0;
    for (int v = 1; v < V; ++v)
        if (logits[v] > logits[best]) best = v;
    EXPECT(tok[1] == best && par[1] == 0, "row 1 is depth 1's argmax (%d, got %d)", best, tok[1]);
    for (int i = 1; i < N; ++i) {
        EXPECT(par[i] >= 0 && par[i] < i, "parents[%d] = %d", i, par[i]);
        EXPECT(dep[i] == dep[par[i]] + 1 && pos[i] == start + dep[i], "depth of row %d", i);
        EXPECT((mask[i * W + i / 32] >> (i % 32)) & 1, "row %d sees itself", i);
        EXPECT((mask[i * W + par[i] / 32] >> (par[i] % 32)) & 1, "row %d sees its parent", i);
    }

    /* the walk, along the path to the last row */
    int32_t choice[N];
    for (int i = 0; i < N; ++i) choice[i] = V + 1; /* matches nothing */
    int deep = N - 1, path = 1;
    for (int r = deep; r > 0; r = par[r], ++path) choice[par[r]] = tok[r];
    unsigned long long d_choice = dalloc(4 * N), d_acc = dalloc(4 * 64), d_len = dalloc(4),
                       d_bonus = dalloc(4);
    CU(cuMemcpyHtoD_v2)(d_choice, choice, sizeof choice);
    rc = kdtree_tree_walk((int32_t *)d_tok, (int32_t *)d_par, (int32_t *)d_choice, 1, N, 64, (int32_t *)d_acc,
                          (int32_t *)d_len, (int32_t *)d_bonus, stream);
    EXPECT(rc == KDTREE_OK, "tree_walk: %s", kdtree_last_error());
    CU(cuStreamSynchronize)(stream);
    int32_t acc_len = 0, bonus = 0;
    CU(cuMemcpyDtoH_v2)(&acc_len, d_len, 4);
    CU(cuMemcpyDtoH_v2)(&bonus, d_bonus, 4);
    EXPECT(acc_len == path && bonus == V + 1, "walk: %d rows (want %d), bonus %d", acc_len, path, bonus);

    /* verify attention: 1 request, 4 appended rows (a chain) after 100 context rows, 2 heads, pages of 64 */
    {
        enum { NQ = 4, H = 2, CTX = 100, S = CTX + NQ, PS = 64, PAGES = 2, D = 576, DV = 512 };
        static uint16_t q[NQ * H * D], cache[PAGES * PS * D];
        static float qf[NQ * H * D], kvf[S * D], outf[NQ * H * DV];
        static uint16_t out[NQ * H * DV];
        static double want[NQ * H * DV];
        for (int i = 0; i < NQ * H * D; ++i) qf[i] = from_bf16(q[i] = to_bf16(0.5f * uniform()));
        for (int i = 0; i < PAGES * PS * D; ++i) cache[i] = to_bf16(0.5f * uniform());
        for (int i = 0; i < S * D; ++i) kvf[i] = from_bf16(cache[i]);
        int32_t pt[PAGES] = {0, 1}, seq = S;
        uint32_t mask[NQ];
        for (int i = 0; i < NQ; ++i) mask[i] = (1u << (i + 1)) - 1; /* row i sees block rows 0..i */
        const float scale = 1.0f / 24.0f;                           /* 576 ** -0.5 */
        for (int i = 0; i < NQ; ++i)
            for (int h = 0; h < H; ++h) {
                static double sc[S];
                double m = -1e300, den = 0;
                for (int r = 0; r < S; ++r) {
                    int vis = r < CTX || ((mask[i] >> (r - CTX)) & 1u);
                    double a = 0;
                    for (int c = 0; c < D; ++c) a += (double)qf[(i * H + h) * D + c] * kvf[r * D + c];
                    sc[r] = vis ? a * scale : -1e300;
                    if (sc[r] > m) m = sc[r];
                }
                for (int r = 0; r < S; ++r) den += sc[r] > -1e299 ? exp(sc[r] - m) : 0;
                for (int c = 0; c < DV; ++c) {
                    double a = 0;
                    for (int r = 0; r < S; ++r)
                        if (sc[r] > -1e299) a += exp(sc[r] - m) / den * kvf[r * D + c];
                    want[(i * H + h) * DV + c] = a;
                }
            }
        unsigned long long d_q = dalloc(sizeof q), d_cache = dalloc(sizeof cache), d_pt = dalloc(sizeof pt);
        unsigned long long d_seq = dalloc(4), d_mask = dalloc(sizeof mask), d_out = dalloc(sizeof out);
        unsigned long long d_lse = dalloc(4 * NQ * H);
        CU(cuMemcpyHtoD_v2)(d_q, q, sizeof q);
        CU(cuMemcpyHtoD_v2)(d_cache, cache, sizeof cache);
        CU(cuMemcpyHtoD_v2)(d_pt, pt, sizeof pt);
        CU(cuMemcpyHtoD_v2)(d_seq, &seq, 4);
        CU(cuMemcpyHtoD_v2)(d_mask, mask, sizeof mask);
        for (int impl = KDTREE_VERIFY_AUTO; impl <= KDTREE_VERIFY_MMA; impl += KDTREE_VERIFY_MMA) {
            size_t wsb = kdtree_verify_attn_workspace(1, NQ, H, PAGES * PS, impl, 0);
            EXPECT(wsb > 0, "verify workspace: %s", kdtree_last_error());
            unsigned long long d_ws2 = dalloc(wsb);
            rc = kdtree_verify_attn((uint16_t *)d_q, (uint16_t *)d_cache, PAGES * PS, (int32_t *)d_pt, PAGES,
                                    PS, (int32_t *)d_seq, (uint32_t *)d_mask, 1, NQ, H, scale, PAGES * PS,
                                    impl, 0, (uint16_t *)d_out, (float *)d_lse, (void *)d_ws2, wsb, stream);
            EXPECT(rc == KDTREE_OK, "verify_attn impl %d: %s", impl, kdtree_last_error());
            CU(cuStreamSynchronize)(stream);
            CU(cuMemcpyDtoH_v2)(out, d_out, sizeof out);
            for (int i = 0; i < NQ * H * DV; ++i) outf[i] = from_bf16(out[i]);
            double e = rel_err(outf, want, NQ * H * DV);
            EXPECT(e <= 1e-2, "verify_attn impl %d: relative error %.2e", impl, e);
        }
    }

    /* INT4 MoE: 4 experts, hidden 64, intermediate 32, 3 tokens x 2 experts; the grouped path and the fused
     */
    {
        enum { E = 4, DM = 64, I = 32, T = 3, K = 2 };
        static int32_t w13[E * 2 * I * DM / 8], w2[E * DM * I / 8];
        static uint16_t s13[E * 2 * I * DM / 32], s2[E * DM * I / 32], x[T * DM];
        static float xf[T * DM], outm[T * DM];
        static double wantm[T * DM];
        for (int i = 0; i < E * 2 * I * DM / 8; ++i) {
            s_rng = s_rng * 1664525u + 1013904223u;
            w13[i] = (int32_t)s_rng;
        }
        for (int i = 0; i < E * DM * I / 8; ++i) {
            s_rng = s_rng * 1664525u + 1013904223u;
            w2[i] = (int32_t)s_rng;
        }
        for (int i = 0; i < E * 2 * I * DM / 32; ++i) s13[i] = to_bf16(0.01f + 0.01f * (uniform() + 1));
        for (int i = 0; i < E * DM * I / 32; ++i) s2[i] = to_bf16(0.01f + 0.01f * (uniform() + 1));
        for (int i = 0; i < T * DM; ++i) xf[i] = from_bf16(x[i] = to_bf16(uniform()));
        int32_t ids[T * K] = {0, 2, 1, 3, 2, 0};
        float tw[T * K] = {0.6f, 0.4f, 0.7f, 0.3f, 0.5f, 0.5f};
        for (int t = 0; t < T; ++t) {
            for (int c = 0; c < DM; ++c) wantm[t * DM + c] = 0;
            for (int j = 0; j < K; ++j) {
                int e = ids[t * K + j];
                double h[I];
                for (int f = 0; f < I; ++f) {
                    double g = 0, u = 0;
                    for (int c = 0; c < DM; ++c) {
                        int rg = e * 2 * I + f, ru = e * 2 * I + I + f;
                        int qg = ((uint32_t)w13[rg * DM / 8 + c / 8] >> (4 * (c % 8)) & 0xf) - 8;
                        int qu = ((uint32_t)w13[ru * DM / 8 + c / 8] >> (4 * (c % 8)) & 0xf) - 8;
                        g += qg * (double)from_bf16(s13[rg * DM / 32 + c / 32]) * xf[t * DM + c];
                        u += qu * (double)from_bf16(s13[ru * DM / 32 + c / 32]) * xf[t * DM + c];
                    }
                    h[f] = from_bf16(to_bf16((float)(g / (1 + exp(-g)) * u))); /* the bf16 workspace */
                }
                for (int c = 0; c < DM; ++c) {
                    double a = 0;
                    int r = e * DM + c;
                    for (int f = 0; f < I; ++f) {
                        int q2 = ((uint32_t)w2[r * I / 8 + f / 8] >> (4 * (f % 8)) & 0xf) - 8;
                        a += q2 * (double)from_bf16(s2[r * I / 32 + f / 32]) * h[f];
                    }
                    wantm[t * DM + c] += tw[t * K + j] * a;
                }
            }
        }
        unsigned long long d_w13 = dalloc(sizeof w13), d_s13 = dalloc(sizeof s13), d_w2 = dalloc(sizeof w2);
        unsigned long long d_s2 = dalloc(sizeof s2), d_r13 = dalloc(sizeof w13), d_rs13 = dalloc(sizeof s13);
        unsigned long long d_r2 = dalloc(sizeof w2), d_rs2 = dalloc(sizeof s2), d_x = dalloc(sizeof x);
        unsigned long long d_ids = dalloc(sizeof ids), d_tw = dalloc(sizeof tw), d_outm = dalloc(sizeof outm);
        CU(cuMemcpyHtoD_v2)(d_w13, w13, sizeof w13);
        CU(cuMemcpyHtoD_v2)(d_s13, s13, sizeof s13);
        CU(cuMemcpyHtoD_v2)(d_w2, w2, sizeof w2);
        CU(cuMemcpyHtoD_v2)(d_s2, s2, sizeof s2);
        CU(cuMemcpyHtoD_v2)(d_x, x, sizeof x);
        CU(cuMemcpyHtoD_v2)(d_ids, ids, sizeof ids);
        CU(cuMemcpyHtoD_v2)(d_tw, tw, sizeof tw);
        rc = kdtree_moe_repack((int32_t *)d_w13, (uint16_t *)d_s13, E, 2 * I, DM, (int32_t *)d_r13,
                               (uint16_t *)d_rs13, stream);
        EXPECT(rc == KDTREE_OK, "moe_repack w13: %s", kdtree_last_error());
        rc = kdtree_moe_repack((int32_t *)d_w2, (uint16_t *)d_s2, E, DM, I, (int32_t *)d_r2,
                               (uint16_t *)d_rs2, stream);
        EXPECT(rc == KDTREE_OK, "moe_repack w2: %s", kdtree_last_error());
        size_t wsm = kdtree_moe_workspace(T, K, E, DM, I);
        unsigned long long d_wsm = dalloc(wsm);
        CU(cuMemsetD8_v2)(d_wsm, 0, wsm); /* once, at allocation: the fused path's counters */
        for (int fused = 0; fused <= 1; ++fused) {
            rc = kdtree_moe_int4((uint16_t *)d_x, (void *)d_ids, KDTREE_I32, (float *)d_tw, T, K,
                                 (int32_t *)d_r13, (uint16_t *)d_rs13, (int32_t *)d_r2, (uint16_t *)d_rs2, E,
                                 DM, I, 0, fused, (float *)d_outm, (void *)d_wsm, wsm, stream);
            EXPECT(rc == KDTREE_OK, "moe_int4 fused=%d: %s", fused, kdtree_last_error());
            CU(cuStreamSynchronize)(stream);
            CU(cuMemcpyDtoH_v2)(outm, d_outm, sizeof outm);
            double e = rel_err(outm, wantm, T * DM);
            EXPECT(e <= 1e-2, "moe_int4 fused=%d: relative error %.2e", fused, e);
        }
    }

    /* a bad call */
    rc = kdtree_tree_build((void *)d_logits, KDTREE_F32, 1, L, V, 0, (int32_t *)d_root, (int32_t *)d_start,
                           (int32_t *)d_tok, (int32_t *)d_pos, (int32_t *)d_par, (int32_t *)d_dep,
                           (float *)d_sc, (uint32_t *)d_mask, (int32_t *)d_n, (void *)d_ws, ws_bytes, stream);
    EXPECT(rc == KDTREE_ERR_SIZE && strstr(kdtree_last_error(), "budget=0"), "bad budget: %d %s", rc,
           kdtree_last_error());

    /* host cost: calls enqueued behind a spin of ~50 ms, against empty launches behind another */
    enum { CALLS = 400, REPEATS = 7 };
    double capi_s[REPEATS], empty_s[REPEATS], build_s[REPEATS];
    unsigned long long cycles = 100000000ull;
    void *spin_args[] = {&cycles};
    unsigned long long dummy = 0;
    void *empty_args[] = {&dummy};
    for (int r = 0; r < REPEATS; ++r) {
        CU(cuLaunchKernel)(f_spin, 1, 1, 1, 1, 1, 1, 0, stream, spin_args, NULL);
        double t0 = now();
        for (int i = 0; i < CALLS; ++i)
            kdtree_tree_walk((int32_t *)d_tok, (int32_t *)d_par, (int32_t *)d_choice, 1, N, 64,
                             (int32_t *)d_acc, (int32_t *)d_len, (int32_t *)d_bonus, stream);
        capi_s[r] = (now() - t0) / CALLS;
        CU(cuStreamSynchronize)(stream);
        CU(cuLaunchKernel)(f_spin, 1, 1, 1, 1, 1, 1, 0, stream, spin_args, NULL);
        t0 = now();
        for (int i = 0; i < CALLS; ++i)
            CU(cuLaunchKernel)(f_empty, 1, 1, 1, 32, 1, 1, 0, stream, empty_args, NULL);
        empty_s[r] = (now() - t0) / CALLS;
        CU(cuStreamSynchronize)(stream);
        CU(cuLaunchKernel)(f_spin, 1, 1, 1, 1, 1, 1, 0, stream, spin_args, NULL);
        t0 = now();
        for (int i = 0; i < CALLS / 4; ++i) /* three launches a call */
            kdtree_tree_build((void *)d_logits, KDTREE_F32, 1, L, V, B, (int32_t *)d_root, (int32_t *)d_start,
                              (int32_t *)d_tok, (int32_t *)d_pos, (int32_t *)d_par, (int32_t *)d_dep,
                              (float *)d_sc, (uint32_t *)d_mask, (int32_t *)d_n, (void *)d_ws, ws_bytes,
                              stream);
        build_s[r] = (now() - t0) / (CALLS / 4);
        CU(cuStreamSynchronize)(stream);
    }
    /* medians */
    for (int i = 0; i < REPEATS; ++i)
        for (int j = i + 1; j < REPEATS; ++j) {
            double *arrs[3] = {capi_s, empty_s, build_s};
            for (int a = 0; a < 3; ++a)
                if (arrs[a][j] < arrs[a][i]) {
                    double t = arrs[a][i];
                    arrs[a][i] = arrs[a][j];
                    arrs[a][j] = t;
                }
        }
    double walk = capi_s[REPEATS / 2], empty = empty_s[REPEATS / 2], build = build_s[REPEATS / 2];
    printf(
        "host cost per call: tree_walk %.2f us (1 launch), empty launch %.2f us, tree_build %.2f us "
        "(3 launches); beyond the launches: walk %.2f us, build %.2f us\n",
        walk * 1e6, empty * 1e6, build * 1e6, (walk - empty) * 1e6, (build - 3 * empty) * 1e6);
    const char *json = getenv("KDTREE_SMOKE_JSON");
    if (json) {
        FILE *fp = fopen(json, "w");
        if (fp) {
            fprintf(fp,
                    "{\"calls\": %d, \"repeats\": %d, \"tree_walk_call_s\": %.9g, \"empty_launch_s\": %.9g, "
                    "\"tree_build_call_s\": %.9g, \"tree_walk_beyond_launch_s\": %.9g, "
                    "\"tree_build_beyond_launches_s\": %.9g}\n",
                    CALLS, REPEATS, walk, empty, build, walk - empty, build - 3 * empty);
            fclose(fp);
        }
    }
    dfree_all();
    if (failures) {
        printf("smoke: %d failures\n", failures);
        return 1;
    }
    printf("smoke: ok\n");
    return 0;
}
