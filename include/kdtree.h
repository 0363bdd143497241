/* kdtree.h: the C ABI of libkdtree.so (`make lib`), the lab's CUDA kernels for serving engines.
 *
 * Every entry point takes device pointers, sizes and a stream (a cudaStream_t or CUstream; NULL is the legacy
 * default stream), launches on that stream and returns at once (no host synchronisation): a status code,
 * KDTREE_OK or an error, with a message from kdtree_last_error() (per thread). Arguments are all checked
 * before anything is launched: a rejected call launches nothing and writes nothing. Pointers are never read
 * on the host; they must be device memory of the current CUDA context's device, aligned to 16 bytes where the
 * kernels load vectors (logits, q, cache, x, the repacked experts, every workspace) and to their element size
 * elsewhere (torch's and cudaMalloc's allocations are 256-byte aligned). Nothing allocates: the calls that
 * need scratch memory take a workspace whose size comes from the matching *_workspace query (0 = bad sizes,
 * see kdtree_last_error). The library loads on any machine; CUDA (the driver, libcuda.so.1) is needed from
 * the first launch on, and kernels are loaded once per device: sm_90a builds on compute capability 9.0 (the
 * warpgroup-MMA attention among them), generic sm_80 builds (and PTX) elsewhere.
 *
 * The kernels' contracts are stated in each cuda/<family>.cu header; the golden twins are in
 * kdtree/ops/<family>_golden.py. bf16 tensors are passed as uint16_t. Shapes below: b requests,
 * N = budget + 1 verify rows a request.
 */
#ifndef KDTREE_H
#define KDTREE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KDTREE_ABI_VERSION 1

/* limits, shared with kdtree/ops/ and the .cu sources (a test checks them equal) */
#define KDTREE_MAX_BUDGET 1024  /* draft nodes a tree */
#define KDTREE_MAX_VOCAB 262144 /* top-K vocabulary */
#define KDTREE_MAX_DEPTH 63     /* draft depth L */
#define KDTREE_MAX_ACCEPT 1024  /* tree_walk's accepted rows a request */
#define KDTREE_D_QK 576         /* MLA latent 512 + rope 64 */
#define KDTREE_D_V 512
#define KDTREE_MAX_SPLITS 128         /* verify_attn's context splits */
#define KDTREE_MAX_GROUP_EXPERTS 4096 /* moe_int4: experts the grouping kernel holds */
#define KDTREE_FUSED_MAX_PAIRS 64     /* moe_int4's one-launch path: token-expert pairs */
#define KDTREE_MAX_GROUP_PAIRS 16777215 /* moe_int4: token-expert pairs (T * k) of one call */

typedef struct CUstream_st *kdtree_stream_t;

enum kdtree_status {
    KDTREE_OK = 0,
    KDTREE_ERR_NULL = 1,      /* a required pointer is NULL */
    KDTREE_ERR_ALIGN = 2,     /* a pointer is not 16-byte aligned */
    KDTREE_ERR_SIZE = 3,      /* a size is zero, negative or inconsistent with another */
    KDTREE_ERR_LIMIT = 4,     /* a size or option is past a stated limit */
    KDTREE_ERR_WORKSPACE = 5, /* the workspace is smaller than the query said */
    KDTREE_ERR_NO_CUDA = 6,   /* libcuda.so.1 could not be loaded, or no CUDA context is current */
    KDTREE_ERR_ARCH = 7,      /* the kernel asked for does not run on this device */
    KDTREE_ERR_CUDA = 8       /* a CUDA driver call failed (the message names it) */
};

enum kdtree_dtype { KDTREE_F32 = 0, KDTREE_BF16 = 1, KDTREE_I32 = 2, KDTREE_I64 = 3 };

/* verify_attn's kernels: AUTO = WGMMA on compute capability 9.0, else MMA */
enum kdtree_verify_impl {
    KDTREE_VERIFY_AUTO = 0,
    KDTREE_VERIFY_WGMMA = 1,
    KDTREE_VERIFY_WS = 2,
    KDTREE_VERIFY_MMA = 3
};

int kdtree_abi_version(void);
/* the launch choices, exposed so that they can be checked against those of kdtree/ops/ (sms: the SM count) */
int kdtree_topk_chunking(int rows, int V, int K, int sms, int *n_chunks, int *chunk);
int kdtree_default_splits(int batch, int NH, int max_keys, int sms, int tile);
const char *kdtree_error_string(int code); /* the code's name and meaning; never NULL */
const char *kdtree_last_error(void);       /* this thread's last failing call's message ("" after success) */

/* ------------------------------------------------------------------ tree build (cuda/tree_build.cu)
 * logits [b, L, V] (KDTREE_F32, or KDTREE_BF16 as uint16), 1 <= L <= 63, 1 <= V <= 262144, 1 <= budget <=
 * 1024; root_tokens, start_pos int32 [b]. Writes, N = budget + 1 rows a request (root first): tokens,
 * positions, parents, depths int32 [b, N]; scores float [b, N]; mask uint32 [b, N, ceil(N / 32)]
 * (ancestor-or-self bits); n_nodes int32 [b]. Same contract as kdtree.ops.tree.tree_build. */
size_t kdtree_tree_build_workspace(int batch, int L, int V, int budget);
int kdtree_tree_build(const void *logits, int dtype, int batch, int L, int V, int budget,
                      const int32_t *root_tokens, const int32_t *start_pos, int32_t *tokens,
                      int32_t *positions, int32_t *parents, int32_t *depths, float *scores, uint32_t *mask,
                      int32_t *n_nodes, void *workspace, size_t workspace_bytes, kdtree_stream_t stream);

/* ------------------------------------------------------------------ walk + compaction (cuda/tree_walk.cu)
 * tree_walk: tokens, parents, choice int32 [b, N]; 1 <= max_accept <= 1024. Writes accepted int32
 * [b, max_accept] (rows, root first, -1 padded), acc_len int32 [b], bonus int32 [b].
 * kv_compact: cache: n_layers slabs of `rows` rows of row_bytes bytes (row_bytes % 16 == 0, rows a multiple
 * of page_size), page_table int32 [b, max_pages], block_start int32 [b], accepted int32 [b, max_accept]
 * (strictly increasing rows below the request's pages), acc_len int32 [b] in [0, max_accept]. In place. */
int kdtree_tree_walk(const int32_t *tokens, const int32_t *parents, const int32_t *choice, int batch, int N,
                     int max_accept, int32_t *accepted, int32_t *acc_len, int32_t *bonus,
                     kdtree_stream_t stream);
int kdtree_kv_compact(void *cache, int n_layers, int64_t rows, int row_bytes, const int32_t *page_table,
                      int batch, int max_pages, int page_size, const int32_t *block_start,
                      const int32_t *accepted, int max_accept, const int32_t *acc_len,
                      kdtree_stream_t stream);

/* ------------------------------------------------------------------ MLA tree-verify attention
 * (cuda/verify_attn.cu) q bf16 [b, N, H, 576]; cache bf16 [cache_rows, 576] (one layer, paged, cache_rows a
 * multiple of page_size); page_table int32 [b, max_pages]; seq_len int32 [b] in [N, max_seq_len] (cached
 * rows, the N appended included); mask uint32 [b, N, ceil(N / 32)] over the appended block; scale > 0
 * (softmax scale); max_seq_len in [N, max_pages * page_size] sizes the context splits; n_splits 0 = the
 * default (kdtree_verify_attn_splits), else 1..128. Writes out bf16 [b, N, H, 512], lse float [b, N, H]. */
int kdtree_verify_attn_splits(int batch, int N, int H, int max_seq_len, int impl);
size_t kdtree_verify_attn_workspace(int batch, int N, int H, int max_seq_len, int impl, int n_splits);
int kdtree_verify_attn(const uint16_t *q, const uint16_t *cache, int64_t cache_rows,
                       const int32_t *page_table, int max_pages, int page_size, const int32_t *seq_len,
                       const uint32_t *mask, int batch, int N, int H, float scale, int max_seq_len, int impl,
                       int n_splits, uint16_t *out, float *lse, void *workspace, size_t workspace_bytes,
                       kdtree_stream_t stream);

/* ------------------------------------------------------------------ INT4 MoE experts (cuda/moe_int4.cu)
 * moe_repack: `mats` checkpoint-format matrices [R, K] (packed int32 [mats, R, K/8], scale bf16 [mats, R,
 * K/32]; R % 16 == 0, K % 32 == 0) -> the kernels' fragment order (w_out int32 [mats, R/16, K/32, 32, 2],
 * s_out bf16 [mats, R/16, K/32, 8, 2]); w13 is [E] x [2I, D], w2 is [E] x [D, I]. Run once at load. moe_int4:
 * x bf16 [T, D]; topk_ids [T, k] (KDTREE_I32 or KDTREE_I64; ids outside [0, E) are dropped, as under expert
 * parallelism); topk_weights float [T, k]; repacked w13 / s13 / w2 / s2; D, I multiples of 32, E <= 4096.
 * Writes out float [T, D]. tile_tokens 0 (auto), 8 or 16; fused -1 (auto: T == 1), 0 or 1 (T * k <= 64). The
 * workspace (kdtree_moe_workspace) must be zero-filled once when allocated (its counters are left zero by
 * every call); one workspace per stream in flight. */
int kdtree_moe_repack(const int32_t *packed, const uint16_t *scale, int64_t mats, int R, int K,
                      int32_t *w_out, uint16_t *s_out, kdtree_stream_t stream);
size_t kdtree_moe_workspace(int T, int k, int E, int D, int I);
int kdtree_moe_int4(const uint16_t *x, const void *topk_ids, int ids_dtype, const float *topk_weights, int T,
                    int k, const int32_t *w13, const uint16_t *s13, const int32_t *w2, const uint16_t *s2,
                    int E, int D, int I, int tile_tokens, int fused, float *out, void *workspace,
                    size_t workspace_bytes, kdtree_stream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_H */
