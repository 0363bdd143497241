/* smoke.c: a C program on libkdtree.so alone (run by tests/test_capi.py on a GPU).
 *
 * Builds one tree from random logits, checks its invariants, walks it along a planted path, checks that a bad
 * call fails with a message, and times the library's host cost: calls enqueued behind a GPU spin (so the GPU
 * never throttles the host), against the same number of launches of an empty kernel. Prints "smoke: ok" and,
 * where KDTREE_SMOKE_JSON names a file, writes the timings there. CUDA's driver API is opened with dlopen, as
 * the library does, so the program links against libkdtree.so and libdl only.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

static unsigned long long dalloc(size_t n) {
    unsigned long long p = 0;
    if (CU(cuMemAlloc_v2)(&p, n)) {
        printf("FAILED: cuMemAlloc(%zu)\n", n);
        exit(1);
    }
    return p;
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
    if (failures) {
        printf("smoke: %d failures\n", failures);
        return 1;
    }
    printf("smoke: ok\n");
    return 0;
}
