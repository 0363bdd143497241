// kdtree_capi.cpp: libkdtree.so, the C ABI of include/kdtree.h over the kernels in cuda/*.cu.
//
// The kernels are embedded as fatbins (Makefile `lib`: each .cu built by nvcc for sm_90a and for sm_80 + PTX,
// verify_attn.cu's sm_90a build with the warpgroup-MMA kernels) and loaded with the CUDA driver API, which is
// opened with dlopen at the first launch: the library loads on machines without CUDA, where every argument
// check still runs. The launch choices (top-K chunking, tree kernel, context splits, MoE tiles and the fused
// path) are those of kdtree/ops/, written again here; tests/test_capi.py checks both agree.
#include <dlfcn.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <initializer_list>
#include <mutex>
#include <vector>

#include "kdtree.h"

#include "fatbin_moe_int4.h"
#include "fatbin_moe_int4_sm90a.h"
#include "fatbin_tree_build.h"
#include "fatbin_tree_build_sm90a.h"
#include "fatbin_tree_walk.h"
#include "fatbin_tree_walk_sm90a.h"
#include "fatbin_verify_attn.h"
#include "fatbin_verify_attn_sm90a.h"

namespace {

// ---------------------------------------------------------------- errors
thread_local char g_msg[512];

int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_msg, sizeof g_msg, fmt, ap);
    va_end(ap);
    return code;
}

int ok() {
    g_msg[0] = 0;
    return KDTREE_OK;
}

#define CHECK(expr)                       \
    do {                                  \
        int _rc = (expr);                 \
        if (_rc != KDTREE_OK) return _rc; \
    } while (0)

int need_ptr(const char *fn, const char *name, const void *p, size_t align) {
    if (!p) return fail(KDTREE_ERR_NULL, "%s: %s is NULL", fn, name);
    if ((uintptr_t)p % align)
        return fail(KDTREE_ERR_ALIGN, "%s: %s=%p is not %zu-byte aligned", fn, name, p, align);
    return KDTREE_OK;
}

struct Ptr {
    const char *name;
    const void *p;
};

// need_ptr for each of `ptrs` in turn: the first NULL or misaligned one fails the call.
int need_ptrs(const char *fn, size_t align, std::initializer_list<Ptr> ptrs) {
    for (const Ptr &q : ptrs) CHECK(need_ptr(fn, q.name, q.p, align));
    return KDTREE_OK;
}

int need_range(const char *fn, const char *name, long long v, long long lo, long long hi) {
    if (v < lo || v > hi) {
        int code = v < 1 && lo >= 1 ? KDTREE_ERR_SIZE : KDTREE_ERR_LIMIT;
        return fail(code, "%s: %s=%lld, expected %lld..%lld", fn, name, v, lo, hi);
    }
    return KDTREE_OK;
}

// ---------------------------------------------------------------- the driver API, opened at first use
typedef int CUresult_t;
typedef int CUdevice_t;
typedef void *CUcontext_t;
typedef void *CUmodule_t;
typedef void *CUfunction_t;
enum { ATTR_SM_COUNT = 16, ATTR_CC_MAJOR = 75, ATTR_CC_MINOR = 76, ATTR_SMEM_OPTIN = 97 };
enum { FUNC_SHARED_SIZE = 1, FUNC_MAX_DYN_SHARED = 8 };

struct Driver {
    CUresult_t (*Init)(unsigned);
    CUresult_t (*CtxGetCurrent)(CUcontext_t *);
    CUresult_t (*CtxGetDevice)(CUdevice_t *);
    CUresult_t (*DeviceGetAttribute)(int *, int, CUdevice_t);
    CUresult_t (*ModuleLoadData)(CUmodule_t *, const void *);
    CUresult_t (*ModuleGetFunction)(CUfunction_t *, CUmodule_t, const char *);
    CUresult_t (*FuncGetAttribute)(int *, int, CUfunction_t);
    CUresult_t (*FuncSetAttribute)(CUfunction_t, int, int);
    CUresult_t (*LaunchKernel)(CUfunction_t, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, kdtree_stream_t, void **, void **);
    CUresult_t (*MemsetD32Async)(unsigned long long, unsigned, size_t, kdtree_stream_t);
    CUresult_t (*GetErrorString)(CUresult_t, const char **);
    bool loaded = false;
};

Driver g_drv;
std::mutex g_lock;

int cuda_fail(const char *fn, const char *what, CUresult_t r) {
    const char *s = "unknown error";
    if (g_drv.GetErrorString) g_drv.GetErrorString(r, &s);
    return fail(KDTREE_ERR_CUDA, "%s: %s failed: %s (CUresult %d)", fn, what, s, r);
}

int open_driver(const char *fn) {
    if (g_drv.loaded) return KDTREE_OK;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return fail(KDTREE_ERR_NO_CUDA, "%s: cannot load libcuda.so.1 (%s)", fn, dlerror());
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&g_drv.Init, "cuInit"},
        {(void **)&g_drv.CtxGetCurrent, "cuCtxGetCurrent"},
        {(void **)&g_drv.CtxGetDevice, "cuCtxGetDevice"},
        {(void **)&g_drv.DeviceGetAttribute, "cuDeviceGetAttribute"},
        {(void **)&g_drv.ModuleLoadData, "cuModuleLoadData"},
        {(void **)&g_drv.ModuleGetFunction, "cuModuleGetFunction"},
        {(void **)&g_drv.FuncGetAttribute, "cuFuncGetAttribute"},
        {(void **)&g_drv.FuncSetAttribute, "cuFuncSetAttribute"},
        {(void **)&g_drv.LaunchKernel, "cuLaunchKernel"},
        {(void **)&g_drv.MemsetD32Async, "cuMemsetD32Async"},
        {(void **)&g_drv.GetErrorString, "cuGetErrorString"},
    };
    for (auto &s : syms) {
        *s.slot = dlsym(h, s.name);
        if (!*s.slot) return fail(KDTREE_ERR_NO_CUDA, "%s: libcuda.so.1 lacks %s", fn, s.name);
    }
    CUresult_t r = g_drv.Init(0);
    if (r) return cuda_fail(fn, "cuInit", r);
    g_drv.loaded = true;
    return KDTREE_OK;
}

// ---------------------------------------------------------------- modules, per device
enum Mod { M_TREE_BUILD, M_TREE_WALK, M_VERIFY, M_MOE, N_MODS };
const char *kModNames[N_MODS] = {"tree_build", "tree_walk", "verify_attn", "moe_int4"};
struct Image {
    const unsigned char *data;
    size_t size;
};
#define IMG(x) {x, sizeof(x)}
const Image kImages[N_MODS][2] = {
    // [generic, sm_90a]
    {IMG(fb_tree_build), IMG(fb_tree_build_sm90a)},
    {IMG(fb_tree_walk), IMG(fb_tree_walk_sm90a)},
    {IMG(fb_verify_attn), IMG(fb_verify_attn_sm90a)},
    {IMG(fb_moe_int4), IMG(fb_moe_int4_sm90a)},
};
#undef IMG
// the generic builds' architecture (moe_int4.cu needs sm_90's bf16x2 arithmetic)
const int kMinMajor[N_MODS] = {8, 8, 8, 9};

constexpr int kMaxDevices = 64;
struct DeviceState {
    bool init = false;
    int major = 0, sm90 = 0, sms = 0, smem_optin = 0;
    CUmodule_t mods[N_MODS] = {};
};
DeviceState g_dev[kMaxDevices];

struct Ctx {
    DeviceState *d;
};

// The current context's device, its properties, and the module (loaded on first use).
int device(const char *fn, Ctx *out) {
    std::lock_guard<std::mutex> guard(g_lock);
    CHECK(open_driver(fn));
    CUcontext_t ctx = nullptr;
    CUresult_t r = g_drv.CtxGetCurrent(&ctx);
    if (r) return cuda_fail(fn, "cuCtxGetCurrent", r);
    if (!ctx)
        return fail(KDTREE_ERR_NO_CUDA,
                    "%s: no CUDA context is current on this thread (create one, e.g. with "
                    "cudaSetDevice and a first runtime call, or torch.cuda.init())",
                    fn);
    CUdevice_t dev;
    if ((r = g_drv.CtxGetDevice(&dev))) return cuda_fail(fn, "cuCtxGetDevice", r);
    if (dev < 0 || dev >= kMaxDevices)
        return fail(KDTREE_ERR_LIMIT, "%s: device %d >= %d", fn, dev, kMaxDevices);
    DeviceState &d = g_dev[dev];
    if (!d.init) {
        int major = 0, minor = 0;
        if ((r = g_drv.DeviceGetAttribute(&major, ATTR_CC_MAJOR, dev)) ||
            (r = g_drv.DeviceGetAttribute(&minor, ATTR_CC_MINOR, dev)) ||
            (r = g_drv.DeviceGetAttribute(&d.sms, ATTR_SM_COUNT, dev)) ||
            (r = g_drv.DeviceGetAttribute(&d.smem_optin, ATTR_SMEM_OPTIN, dev)))
            return cuda_fail(fn, "cuDeviceGetAttribute", r);
        d.major = major;
        d.sm90 = major == 9 && minor == 0;
        d.init = true;
    }
    out->d = &d;
    return KDTREE_OK;
}

int module(const char *fn, Ctx &c, Mod m, CUmodule_t *out) {
    std::lock_guard<std::mutex> guard(g_lock);
    if (c.d->major < kMinMajor[m])
        return fail(KDTREE_ERR_ARCH, "%s: %s's kernels need compute capability %d.0 or newer", fn,
                    kModNames[m], kMinMajor[m]);
    if (!c.d->mods[m]) {
        const Image &img = kImages[m][c.d->sm90];
        std::vector<uint64_t> copy((img.size + 7) / 8);  // the driver reads the image 8-byte aligned
        memcpy(copy.data(), img.data, img.size);
        CUresult_t r = g_drv.ModuleLoadData(&c.d->mods[m], copy.data());
        if (r) {
            c.d->mods[m] = nullptr;
            char what[96];
            snprintf(what, sizeof what, "cuModuleLoadData(%s%s)", kModNames[m], c.d->sm90 ? ", sm_90a" : "");
            return cuda_fail(fn, what, r);
        }
    }
    *out = c.d->mods[m];
    return KDTREE_OK;
}

// One launch: the function by name (looked up each time: a hash lookup in the driver), shared memory opted
// in.
int launch(const char *fn, Ctx &c, Mod m, const char *name, unsigned gx, unsigned gy, unsigned gz,
           unsigned block, unsigned smem, kdtree_stream_t stream, void **args) {
    CUmodule_t mod = nullptr;
    CHECK(module(fn, c, m, &mod));
    CUfunction_t f;
    CUresult_t r = g_drv.ModuleGetFunction(&f, mod, name);
    if (r) return cuda_fail(fn, name, r);
    if (smem > 48 * 1024) {
        int stat = 0;
        if ((r = g_drv.FuncGetAttribute(&stat, FUNC_SHARED_SIZE, f)))
            return cuda_fail(fn, "cuFuncGetAttribute", r);
        if ((int)smem + stat > c.d->smem_optin)
            return fail(KDTREE_ERR_LIMIT, "%s: %s needs %u bytes of shared memory, the device allows %d", fn,
                        name, smem + stat, c.d->smem_optin);
        if ((r = g_drv.FuncSetAttribute(f, FUNC_MAX_DYN_SHARED, c.d->smem_optin - stat)))
            return cuda_fail(fn, "cuFuncSetAttribute", r);
    }
    if ((r = g_drv.LaunchKernel(f, gx, gy, gz, block, 1, 1, smem, stream, args, nullptr)))
        return cuda_fail(fn, name, r);
    return KDTREE_OK;
}

size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

// ---------------------------------------------------------------- launch choices (kdtree/ops/)
constexpr int MAX_CHUNK = 16384, MAX_CANDIDATES = 16384, TOPK_SMALL_K = 16, TREE_SMEM_LIMIT = 200 * 1024;
constexpr double TOPK_BLOCK_FIXED_S = 12.9e-6, TOPK_COLUMN_S = 0.34e-9;
constexpr int FUSED_BLOCKS_PER_SM = 4;

long long cdiv(long long a, long long b) { return (a + b - 1) / b; }

void chunking(int R, int V, int K, int sms, int *n_chunks, int *chunk) {
    const long long lo = cdiv(V, MAX_CHUNK);
    long long hi = MAX_CANDIDATES / K < cdiv(V, 256) ? MAX_CANDIDATES / K : cdiv(V, 256);
    if (hi < lo) hi = lo;
    double best = -1;
    for (long long nch = lo; nch <= hi; ++nch) {
        const long long ch = cdiv(cdiv(V, nch), 8) * 8, n = cdiv(V, ch);
        const double cost = (double)cdiv(R * n, sms) * (TOPK_BLOCK_FIXED_S + TOPK_COLUMN_S * (double)ch);
        if (best < 0 || cost < best) {
            best = cost;
            *n_chunks = (int)n;
            *chunk = (int)ch;
        }
    }
}

int max_chunks(int V, int K) {  // the most chunks chunking() can choose: sizes the workspace
    const long long lo = cdiv(V, MAX_CHUNK);
    long long hi = MAX_CANDIDATES / K < cdiv(V, 256) ? MAX_CANDIDATES / K : cdiv(V, 256);
    return (int)(hi < lo ? lo : hi);
}

size_t tree_smem(int B, int L, int K) {
    return 8 * (size_t)B + 256 * cdiv(B + 1, 32) + 4 * (size_t)(B + 1) + 4 * (size_t)L * K +
           2 * (size_t)(B + 1);
}

int splits(int b, int NH, int max_keys, int sms, int tile) {
    const long long blocks = (long long)b * cdiv(NH, 64), tiles = cdiv(max_keys, tile);
    const long long top = tiles < KDTREE_MAX_SPLITS ? tiles : KDTREE_MAX_SPLITS;
    double best = -1;
    int out = 1;
    for (long long s = 1; s <= top; ++s) {
        double cost = (double)(cdiv(blocks * s, sms) * (cdiv(tiles, s) + 1));
        if (s > 1) cost += (double)(s * b * NH) * 2048.0 / ((double)sms * 73728.0);
        if (best < 0 || cost < best) {
            best = cost;
            out = (int)s;
        }
    }
    return out;
}

// verify_attn's kernels: name, dynamic shared memory, keys a tile (ops.verify_attn._VERIFY_KERNELS)
struct VerifyKernel {
    const char *name;
    unsigned smem;
    int tile;
};
const VerifyKernel kVerify[4] = {
    {nullptr, 0, 0},
    {"verify_attn_wg", 1024 + 3 * 9 * 8192 + 8192 + 3 * 64 * 4, 64},
    {"verify_attn_ws", 1024 + 9 * 8192 + 4 * 9 * 4096 + 8192 + 64 * 4 + 16 * 8, 32},
    {"verify_attn_partial", 64 * 584 * 2 + 2 * 32 * 584 * 2 + 64 * 40 * 2 + 4 * 64 * 4, 32},
};

int verify_impl(const char *fn, Ctx &c, int impl, int *out) {
    CHECK(need_range(fn, "impl", impl, 0, 3));
    if (impl == KDTREE_VERIFY_AUTO) impl = c.d->sm90 ? KDTREE_VERIFY_WGMMA : KDTREE_VERIFY_MMA;
    if (impl != KDTREE_VERIFY_MMA && !c.d->sm90)
        return fail(KDTREE_ERR_ARCH,
                    "%s: impl=%d (warpgroup MMA) needs a compute capability 9.0 GPU; use "
                    "KDTREE_VERIFY_MMA",
                    fn, impl);
    *out = impl;
    return KDTREE_OK;
}

struct MoeLayout {
    size_t sync, h, pair_tok, pair_w, expert_off, active, items, total;
};

// moe_int4's work items (kdtree/ops/moe_int4.py item_rows / item_chunk): pairs an item, rows of items [Y, 2]
const long long kMaxGridY = 65535;
long long item_rows(long long P, long long S, long long chunk) { return (P + chunk - 1) / chunk + S; }
long long item_chunk(long long P, long long S, long long tile) {
    long long room = kMaxGridY - S > 1 ? kMaxGridY - S : 1, m = (P + tile * room - 1) / (tile * room);
    if (m < 1) m = 1;
    while (item_rows(P, S, m * tile) > kMaxGridY) ++m;
    return m * tile;
}

MoeLayout moe_layout(int T, int k, int E, int I) {
    const size_t P = (size_t)T * k, S = P < (size_t)E ? P : (size_t)E;
    const size_t Y = (size_t)item_rows((long long)P, (long long)S, item_chunk((long long)P, (long long)S, 8));
    MoeLayout l;
    l.sync = 0;
    l.h = align16(4 * (4 + KDTREE_FUSED_MAX_PAIRS));
    l.pair_tok = l.h + align16(2 * P * I);
    l.pair_w = l.pair_tok + align16(4 * P);
    l.expert_off = l.pair_w + align16(4 * P);
    l.active = l.expert_off + align16(4 * ((size_t)E + 1));
    l.items = l.active + align16(4 * S);
    l.total = l.items + align16(8 * Y);  // the most rows any tile needs (t8's)
    return l;
}

int moe_sizes(const char *fn, int T, int k, int E, int D, int I) {
    CHECK(need_range(fn, "T", T, 1, 1 << 24));
    CHECK(need_range(fn, "k", k, 1, 1 << 10));
    CHECK(need_range(fn, "E", E, 1, KDTREE_MAX_GROUP_EXPERTS));
    CHECK(need_range(fn, "D", D, 32, 1 << 20));
    CHECK(need_range(fn, "I", I, 32, 1 << 20));
    if (D % 32 || I % 32) return fail(KDTREE_ERR_SIZE, "%s: D=%d and I=%d must be multiples of 32", fn, D, I);
    if ((long long)T * k > KDTREE_MAX_GROUP_PAIRS)
        return fail(KDTREE_ERR_LIMIT, "%s: T * k = %lld token-expert pairs, at most %d", fn, (long long)T * k,
                    KDTREE_MAX_GROUP_PAIRS);
    return KDTREE_OK;
}

int tree_sizes(const char *fn, int batch, int L, int V, int budget) {
    CHECK(need_range(fn, "batch", batch, 1, 65535));
    CHECK(need_range(fn, "L", L, 1, KDTREE_MAX_DEPTH));
    CHECK(need_range(fn, "V", V, 1, KDTREE_MAX_VOCAB));
    CHECK(need_range(fn, "budget", budget, 1, KDTREE_MAX_BUDGET));
    return KDTREE_OK;
}

struct TreeLayout {
    size_t key, tok, max, sum, out_tok, out_lp, total;
};

TreeLayout tree_layout(int batch, int L, int V, int budget) {
    const int K = budget < V ? budget : V, nch = max_chunks(V, K);
    const size_t R = (size_t)batch * L, cand = R * nch * K;
    TreeLayout l;
    l.key = 0;
    l.tok = align16(4 * cand);
    l.max = l.tok + align16(4 * cand);
    l.sum = l.max + align16(4 * R * nch);
    l.out_tok = l.sum + align16(8 * R * nch);
    l.out_lp = l.out_tok + align16(4 * R * K);
    l.total = l.out_lp + align16(4 * R * K);
    return l;
}

}  // namespace

// ================================================================ the ABI
extern "C" {

int kdtree_abi_version(void) { return KDTREE_ABI_VERSION; }

const char *kdtree_error_string(int code) {
    switch (code) {
        case KDTREE_OK:
            return "KDTREE_OK: success";
        case KDTREE_ERR_NULL:
            return "KDTREE_ERR_NULL: a required pointer is NULL";
        case KDTREE_ERR_ALIGN:
            return "KDTREE_ERR_ALIGN: a pointer is not aligned as the contract states";
        case KDTREE_ERR_SIZE:
            return "KDTREE_ERR_SIZE: a size is zero, negative or inconsistent";
        case KDTREE_ERR_LIMIT:
            return "KDTREE_ERR_LIMIT: a size or option is past a stated limit";
        case KDTREE_ERR_WORKSPACE:
            return "KDTREE_ERR_WORKSPACE: the workspace is smaller than its query said";
        case KDTREE_ERR_NO_CUDA:
            return "KDTREE_ERR_NO_CUDA: no CUDA driver or no current context";
        case KDTREE_ERR_ARCH:
            return "KDTREE_ERR_ARCH: the kernel asked for does not run on this device";
        case KDTREE_ERR_CUDA:
            return "KDTREE_ERR_CUDA: a CUDA driver call failed";
        default:
            return "unknown kdtree status code";
    }
}

const char *kdtree_last_error(void) { return g_msg; }

int kdtree_topk_chunking(int rows, int V, int K, int sms, int *n_chunks, int *chunk) {
    const char *fn = "kdtree_topk_chunking";
    CHECK(need_range(fn, "rows", rows, 1, 1 << 30));
    CHECK(need_range(fn, "V", V, 1, KDTREE_MAX_VOCAB));
    CHECK(need_range(fn, "K", K, 1, KDTREE_MAX_BUDGET));
    CHECK(need_range(fn, "sms", sms, 1, 1 << 16));
    CHECK(need_ptr(fn, "n_chunks", n_chunks, 4));
    CHECK(need_ptr(fn, "chunk", chunk, 4));
    chunking(rows, V, K < V ? K : V, sms, n_chunks, chunk);
    return ok();
}

int kdtree_default_splits(int batch, int NH, int max_keys, int sms, int tile) {
    if (batch < 1 || NH < 1 || max_keys < 1 || sms < 1 || tile < 1)
        return -fail(KDTREE_ERR_SIZE, "kdtree_default_splits: every argument must be >= 1");
    return splits(batch, NH, max_keys, sms, tile);
}

// ---------------------------------------------------------------- tree build
size_t kdtree_tree_build_workspace(int batch, int L, int V, int budget) {
    if (tree_sizes("kdtree_tree_build_workspace", batch, L, V, budget)) return 0;
    ok();
    return tree_layout(batch, L, V, budget).total;
}

int kdtree_tree_build(const void *logits, int dtype, int batch, int L, int V, int budget,
                      const int32_t *root_tokens, const int32_t *start_pos, int32_t *tokens,
                      int32_t *positions, int32_t *parents, int32_t *depths, float *scores, uint32_t *mask,
                      int32_t *n_nodes, void *workspace, size_t workspace_bytes, kdtree_stream_t stream) {
    const char *fn = "kdtree_tree_build";
    CHECK(tree_sizes(fn, batch, L, V, budget));
    if (dtype != KDTREE_F32 && dtype != KDTREE_BF16)
        return fail(KDTREE_ERR_SIZE, "%s: dtype=%d, expected KDTREE_F32 (0) or KDTREE_BF16 (1)", fn, dtype);
    CHECK(need_ptr(fn, "logits", logits, 16));
    CHECK(need_ptrs(fn, 4,
                    {{"root_tokens", root_tokens},
                     {"start_pos", start_pos},
                     {"tokens", tokens},
                     {"positions", positions},
                     {"parents", parents},
                     {"depths", depths},
                     {"scores", scores},
                     {"mask", mask},
                     {"n_nodes", n_nodes}}));
    CHECK(need_ptr(fn, "workspace", workspace, 16));
    const TreeLayout lay = tree_layout(batch, L, V, budget);
    if (workspace_bytes < lay.total)
        return fail(KDTREE_ERR_WORKSPACE, "%s: workspace of %zu bytes, kdtree_tree_build_workspace says %zu",
                    fn, workspace_bytes, lay.total);
    Ctx c;
    CHECK(device(fn, &c));
    int R = batch * L, K = budget < V ? budget : V, nch = 0, chunk = 0;
    chunking(R, V, K, c.d->sms, &nch, &chunk);
    char *ws = (char *)workspace;
    void *key = ws + lay.key, *tok = ws + lay.tok, *pmax = ws + lay.max, *psum = ws + lay.sum;
    void *otok = ws + lay.out_tok, *olp = ws + lay.out_lp;
    const bool small = K <= TOPK_SMALL_K;
    char name[48];
    snprintf(name, sizeof name, "topk_partial%s_%s", small ? "_small" : "",
             dtype == KDTREE_BF16 ? "bf16" : "f32");
    void *a1[] = {(void *)&logits, &V, &K, &chunk, &key, &tok, &pmax, &psum};
    CHECK(launch(fn, c, M_TREE_BUILD, name, nch, R, 1, 512, 0, stream, a1));
    int Kp = 1;
    while (Kp < K) Kp <<= 1;
    void *a2[] = {&key, &tok, &pmax, &psum, &nch, &K, &Kp, &otok, &olp};
    CHECK(
        launch(fn, c, M_TREE_BUILD, small ? "topk_merge_small" : "topk_merge", R, 1, 1, 1024, 0, stream, a2));
    const int need = (int)cdiv(budget + 1, 32);
    const char *tree = need <= 1   ? "tree_build_c1"
                       : need <= 2 ? "tree_build_c2"
                       : need <= 4 ? "tree_build_c4"
                                   : "tree_build_groups";
    int stage = tree_smem(budget, L, K) <= (size_t)TREE_SMEM_LIMIT;
    const unsigned smem = (unsigned)(stage ? tree_smem(budget, L, K) : tree_smem(budget, 0, 0));
    void *a3[] = {&otok,
                  &olp,
                  &L,
                  &K,
                  &budget,
                  &stage,
                  (void *)&root_tokens,
                  (void *)&start_pos,
                  &tokens,
                  &positions,
                  &parents,
                  &depths,
                  &scores,
                  &mask,
                  &n_nodes};
    CHECK(launch(fn, c, M_TREE_BUILD, tree, batch, 1, 1, 256, smem, stream, a3));
    return ok();
}

// ---------------------------------------------------------------- walk + compaction
int kdtree_tree_walk(const int32_t *tokens, const int32_t *parents, const int32_t *choice, int batch, int N,
                     int max_accept, int32_t *accepted, int32_t *acc_len, int32_t *bonus,
                     kdtree_stream_t stream) {
    const char *fn = "kdtree_tree_walk";
    CHECK(need_range(fn, "batch", batch, 1, 1 << 30));
    CHECK(need_range(fn, "N", N, 1, KDTREE_MAX_BUDGET + 1));
    CHECK(need_range(fn, "max_accept", max_accept, 1, KDTREE_MAX_ACCEPT));
    CHECK(need_ptrs(fn, 4,
                    {{"tokens", tokens},
                     {"parents", parents},
                     {"choice", choice},
                     {"accepted", accepted},
                     {"acc_len", acc_len},
                     {"bonus", bonus}}));
    Ctx c;
    CHECK(device(fn, &c));
    void *a[] = {(void *)&tokens, (void *)&parents, (void *)&choice, &N,
                 &max_accept,     &accepted,        &acc_len,        &bonus};
    CHECK(launch(fn, c, M_TREE_WALK, "tree_walk", batch, 1, 1, 32, 0, stream, a));
    return ok();
}

int kdtree_kv_compact(void *cache, int n_layers, int64_t rows, int row_bytes, const int32_t *page_table,
                      int batch, int max_pages, int page_size, const int32_t *block_start,
                      const int32_t *accepted, int max_accept, const int32_t *acc_len,
                      kdtree_stream_t stream) {
    const char *fn = "kdtree_kv_compact";
    CHECK(need_range(fn, "n_layers", n_layers, 1, 65535));
    CHECK(need_range(fn, "batch", batch, 1, 1 << 30));
    CHECK(need_range(fn, "page_size", page_size, 1, 1 << 20));
    CHECK(need_range(fn, "rows", rows, page_size, 1LL << 40));
    CHECK(need_range(fn, "row_bytes", row_bytes, 16, 1 << 16));
    CHECK(need_range(fn, "max_pages", max_pages, 1, 1 << 30));
    CHECK(need_range(fn, "max_accept", max_accept, 1, KDTREE_MAX_ACCEPT));
    if (row_bytes % 16)
        return fail(KDTREE_ERR_SIZE, "%s: row_bytes=%d is not a multiple of 16", fn, row_bytes);
    if (rows % page_size)
        return fail(KDTREE_ERR_SIZE, "%s: rows=%lld is not a whole number of pages of %d", fn,
                    (long long)rows, page_size);
    CHECK(need_ptr(fn, "cache", cache, 16));
    CHECK(need_ptrs(fn, 4,
                    {{"page_table", page_table},
                     {"block_start", block_start},
                     {"accepted", accepted},
                     {"acc_len", acc_len}}));
    Ctx c;
    CHECK(device(fn, &c));
    long long stride = rows * row_bytes / 16;
    int vec = row_bytes / 16;
    void *a[] = {&cache,
                 &stride,
                 &vec,
                 (void *)&page_table,
                 &max_pages,
                 &page_size,
                 (void *)&block_start,
                 (void *)&accepted,
                 &max_accept,
                 (void *)&acc_len};
    CHECK(launch(fn, c, M_TREE_WALK, "kv_compact", batch, n_layers, 1, 128, (unsigned)max_accept * row_bytes,
                 stream, a));
    return ok();
}

// ---------------------------------------------------------------- verify attention
static int verify_sizes(const char *fn, int batch, int N, int H, int max_seq_len) {
    CHECK(need_range(fn, "batch", batch, 1, 65535));
    CHECK(need_range(fn, "N", N, 1, 4096));
    CHECK(need_range(fn, "H", H, 1, 1024));
    CHECK(need_range(fn, "max_seq_len", max_seq_len, N, 1 << 30));
    return KDTREE_OK;
}

int kdtree_verify_attn_splits(int batch, int N, int H, int max_seq_len, int impl) {
    const char *fn = "kdtree_verify_attn_splits";
    int rc = verify_sizes(fn, batch, N, H, max_seq_len);
    Ctx c;
    if (!rc) rc = device(fn, &c);
    if (!rc) rc = verify_impl(fn, c, impl, &impl);
    if (rc) return -rc;
    ok();
    return splits(batch, N * H, max_seq_len, c.d->sms, kVerify[impl].tile);
}

size_t kdtree_verify_attn_workspace(int batch, int N, int H, int max_seq_len, int impl, int n_splits) {
    const char *fn = "kdtree_verify_attn_workspace";
    if (verify_sizes(fn, batch, N, H, max_seq_len) ||
        need_range(fn, "n_splits", n_splits, 0, KDTREE_MAX_SPLITS))
        return 0;
    if (n_splits == 0) {
        n_splits = kdtree_verify_attn_splits(batch, N, H, max_seq_len, impl);
        if (n_splits <= 0) return 0;
    }
    ok();
    const size_t rowsq = (size_t)n_splits * batch * N * H;
    return align16(rowsq * KDTREE_D_V * 4) + align16(rowsq * 8);
}

int kdtree_verify_attn(const uint16_t *q, const uint16_t *cache, int64_t cache_rows,
                       const int32_t *page_table, int max_pages, int page_size, const int32_t *seq_len,
                       const uint32_t *mask, int batch, int N, int H, float scale, int max_seq_len, int impl,
                       int n_splits, uint16_t *out, float *lse, void *workspace, size_t workspace_bytes,
                       kdtree_stream_t stream) {
    const char *fn = "kdtree_verify_attn";
    CHECK(verify_sizes(fn, batch, N, H, max_seq_len));
    CHECK(need_range(fn, "page_size", page_size, 1, 1 << 20));
    CHECK(need_range(fn, "max_pages", max_pages, 1, 1 << 30));
    CHECK(need_range(fn, "cache_rows", cache_rows, page_size, 1LL << 40));
    CHECK(need_range(fn, "n_splits", n_splits, 0, KDTREE_MAX_SPLITS));
    CHECK(need_range(fn, "impl", impl, 0, 3));
    if (cache_rows % page_size)
        return fail(KDTREE_ERR_SIZE, "%s: cache_rows=%lld is not a whole number of pages of %d", fn,
                    (long long)cache_rows, page_size);
    if ((long long)max_seq_len > (long long)max_pages * page_size)
        return fail(KDTREE_ERR_LIMIT, "%s: max_seq_len=%d exceeds max_pages x page_size = %lld", fn,
                    max_seq_len, (long long)max_pages * page_size);
    if (!(scale > 0.0f) || !isfinite(scale))
        return fail(KDTREE_ERR_SIZE, "%s: scale=%g, expected a positive finite float", fn, (double)scale);
    CHECK(need_ptr(fn, "q", q, 16));
    CHECK(need_ptr(fn, "cache", cache, 16));
    CHECK(need_ptr(fn, "workspace", workspace, 16));
    CHECK(need_ptrs(
        fn, 4,
        {{"page_table", page_table}, {"seq_len", seq_len}, {"mask", mask}, {"out", out}, {"lse", lse}}));
    Ctx c;
    CHECK(device(fn, &c));
    CHECK(verify_impl(fn, c, impl, &impl));
    const VerifyKernel &k = kVerify[impl];
    int NH = N * H;
    if (n_splits == 0) n_splits = splits(batch, NH, max_seq_len, c.d->sms, k.tile);
    const size_t rowsq = (size_t)n_splits * batch * NH,
                 need = align16(rowsq * KDTREE_D_V * 4) + align16(rowsq * 8);
    if (workspace_bytes < need)
        return fail(KDTREE_ERR_WORKSPACE, "%s: workspace of %zu bytes, %d splits need %zu", fn,
                    workspace_bytes, n_splits, need);
    void *ws_o = workspace, *ws_ml = (char *)workspace + align16(rowsq * KDTREE_D_V * 4);
    float scale2 = (float)((double)scale * 1.4426950408889634);
    int mp = max_pages;
    void *a1[] = {(void *)&q,
                  (void *)&cache,
                  (void *)&page_table,
                  &mp,
                  &page_size,
                  (void *)&seq_len,
                  (void *)&mask,
                  &N,
                  &H,
                  &scale2,
                  &ws_o,
                  &ws_ml};
    CHECK(launch(fn, c, M_VERIFY, k.name, n_splits, (unsigned)cdiv(NH, 64), batch, 256, k.smem, stream, a1));
    void *a2[] = {&ws_o, &ws_ml, &n_splits, &NH, &out, &lse};
    CHECK(launch(fn, c, M_VERIFY, "verify_attn_combine", NH, batch, 1, 128, 0, stream, a2));
    return ok();
}

// ---------------------------------------------------------------- INT4 MoE
int kdtree_moe_repack(const int32_t *packed, const uint16_t *scale, int64_t mats, int R, int K,
                      int32_t *w_out, uint16_t *s_out, kdtree_stream_t stream) {
    const char *fn = "kdtree_moe_repack";
    CHECK(need_range(fn, "mats", mats, 1, 1LL << 20));
    CHECK(need_range(fn, "R", R, 16, 1 << 20));
    CHECK(need_range(fn, "K", K, 32, 1 << 20));
    if (R % 16 || K % 32)
        return fail(KDTREE_ERR_SIZE, "%s: R=%d must be a multiple of 16, K=%d of 32", fn, R, K);
    CHECK(need_ptr(fn, "packed", packed, 16));
    CHECK(need_ptr(fn, "scale", scale, 2));
    CHECK(need_ptr(fn, "w_out", w_out, 16));
    CHECK(need_ptr(fn, "s_out", s_out, 16));
    Ctx c;
    CHECK(device(fn, &c));
    long long m = mats;
    const long long words = m * R * (K / 8), scales = m * R * (K / 32);
    void *a1[] = {(void *)&packed, &m, &R, &K, &w_out};
    CHECK(launch(fn, c, M_MOE, "moe_repack_words", (unsigned)cdiv(words, 256), 1, 1, 256, 0, stream, a1));
    void *a2[] = {(void *)&scale, &m, &R, &K, &s_out};
    CHECK(launch(fn, c, M_MOE, "moe_repack_scales", (unsigned)cdiv(scales, 256), 1, 1, 256, 0, stream, a2));
    return ok();
}

size_t kdtree_moe_workspace(int T, int k, int E, int D, int I) {
    if (moe_sizes("kdtree_moe_workspace", T, k, E, D, I)) return 0;
    ok();
    return moe_layout(T, k, E, I).total;
}

int kdtree_moe_int4(const uint16_t *x, const void *topk_ids, int ids_dtype, const float *topk_weights, int T,
                    int k, const int32_t *w13, const uint16_t *s13, const int32_t *w2, const uint16_t *s2,
                    int E, int D, int I, int tile_tokens, int fused, float *out, void *workspace,
                    size_t workspace_bytes, kdtree_stream_t stream) {
    const char *fn = "kdtree_moe_int4";
    CHECK(moe_sizes(fn, T, k, E, D, I));
    if (ids_dtype != KDTREE_I32 && ids_dtype != KDTREE_I64)
        return fail(KDTREE_ERR_SIZE, "%s: ids_dtype=%d, expected KDTREE_I32 (2) or KDTREE_I64 (3)", fn,
                    ids_dtype);
    if (tile_tokens != 0 && tile_tokens != 8 && tile_tokens != 16)
        return fail(KDTREE_ERR_LIMIT, "%s: tile_tokens=%d, expected 0 (auto), 8 or 16", fn, tile_tokens);
    CHECK(need_range(fn, "fused", fused, -1, 1));
    int P = T * k;
    if (fused == 1 && tile_tokens == 16)
        return fail(KDTREE_ERR_LIMIT, "%s: fused=1 runs 8-pair passes: expected tile_tokens 0 or 8", fn);
    if (fused == 1 && P > KDTREE_FUSED_MAX_PAIRS)
        return fail(KDTREE_ERR_LIMIT, "%s: fused=1 takes T * k <= %d pairs, got %d", fn,
                    KDTREE_FUSED_MAX_PAIRS, P);
    CHECK(need_ptr(fn, "x", x, 16));
    CHECK(need_ptr(fn, "topk_ids", topk_ids, ids_dtype == KDTREE_I64 ? 8 : 4));
    CHECK(need_ptr(fn, "topk_weights", topk_weights, 4));
    CHECK(need_ptrs(fn, 16, {{"w13", w13}, {"s13", s13}, {"w2", w2}, {"s2", s2}, {"workspace", workspace}}));
    CHECK(need_ptr(fn, "out", out, 16));
    const MoeLayout lay = moe_layout(T, k, E, I);
    if (workspace_bytes < lay.total)
        return fail(KDTREE_ERR_WORKSPACE, "%s: workspace of %zu bytes, kdtree_moe_workspace says %zu", fn,
                    workspace_bytes, lay.total);
    Ctx c;
    CHECK(device(fn, &c));
    char *w = (char *)workspace;
    void *sync = w + lay.sync, *h = w + lay.h, *ptok = w + lay.pair_tok, *pw = w + lay.pair_w;
    void *off = w + lay.expert_off, *act = w + lay.active;
    const bool i64 = ids_dtype == KDTREE_I64;
    if (fused == -1) fused = T == 1 && P <= KDTREE_FUSED_MAX_PAIRS && tile_tokens != 16;
    if (fused) {
        void *a[] = {(void *)&x,
                     (void *)&topk_ids,
                     (void *)&topk_weights,
                     &P,
                     &k,
                     &E,
                     (void *)&w13,
                     (void *)&s13,
                     (void *)&w2,
                     (void *)&s2,
                     &D,
                     &I,
                     &T,
                     &h,
                     &out,
                     &sync};
        CHECK(launch(fn, c, M_MOE, i64 ? "moe_fused_t8_i64" : "moe_fused_t8_i32",
                     FUSED_BLOCKS_PER_SM * c.d->sms, 1, 1, 256, 0, stream, a));
        return ok();
    }
    int S = P < E ? P : E;
    if (tile_tokens == 0) tile_tokens = T <= 8 || P <= 8 * E ? 8 : 16;
    const bool t8 = tile_tokens == 8;
    int chunk = (int)item_chunk(P, S, tile_tokens), Y = (int)item_rows(P, S, chunk);
    void *items = w + lay.items;
    void *ag[] = {(void *)&topk_ids, (void *)&topk_weights, &P, &k, &E, &S, &chunk, &Y, &ptok, &pw, &off, &act,
                  &items};
    CHECK(launch(fn, c, M_MOE, i64 ? "moe_group_i64" : "moe_group_i32", 1, 1, 1, 1024, 8 * (unsigned)E,
                 stream, ag));
    CUresult_t r = g_drv.MemsetD32Async((unsigned long long)(uintptr_t)out, 0, (size_t)T * D, stream);
    if (r) return cuda_fail(fn, "cuMemsetD32Async", r);
    void *a1[] = {(void *)&x, &ptok, &off, &items, &chunk, (void *)&w13, (void *)&s13, &D, &I, &h};
    CHECK(launch(fn, c, M_MOE, t8 ? "moe_gate_up_t8" : "moe_gate_up_t16", I / 16, Y, 1, 256, 0, stream, a1));
    void *a2[] = {&h, &ptok, &pw, &off, &items, &chunk, (void *)&w2, (void *)&s2, &D, &I, &out};
    CHECK(launch(fn, c, M_MOE, t8 ? "moe_down_t8" : "moe_down_t16", D / 32, Y, 1, 256, 0, stream, a2));
    return ok();
}

}  // extern "C"
