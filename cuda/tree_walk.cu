// tree_walk.cu: accept along the target's choices, then compact the latent KV of the accepted path.
//
// Golden twins: kdtree/ops/walk_golden.py  walk (greedy_walk / sampled_walk) and compact_kv.
// Wrappers: kdtree/ops/walk.py.
//
// tree_walk          grid batch, block 32 (one warp per request)
//   tokens int32 [batch, N], parents int32 [batch, N] (verify-block layout from tree_build: row 0 the root,
//   -1 for the root and padding rows), choice int32 [batch, N]: the target's next token at every row
//   (argmax for greedy, one sample per row at T > 0).
//   From row 0, move to the child whose token equals choice[current] while one exists (siblings carry
//   distinct tokens, so at most one does). Writes accepted int32 [batch, max_acc] (rows, root first,
//   padded with -1), acc_len int32 [batch] (rows accepted, root included) and bonus int32 [batch] =
//   choice at the last accepted row. max_acc >= deepest depth + 1.
//
// kv_compact         grid (batch, n_layers), block 128, dynamic smem = max_acc * row_bytes
//   cache: n_layers slabs (layer_stride 16-byte units apart) of paged rows of row_vec 16-byte units
//   (576 bf16 = 72 units); page_table int32 [batch, max_pages]; row r of request b lives at
//   page_table[b, r / page_size] * page_size + r % page_size.
//   For j < acc_len[b] at once (gather semantics): row block_start[b] + j <- row block_start[b] + accepted[b, j].
//   accepted rows are strictly increasing (the walk emits them so). Other rows are untouched.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(32) tree_walk(
    const int32_t* __restrict__ tokens, const int32_t* __restrict__ parents, const int32_t* __restrict__ choice,
    int N, int max_acc, int32_t* __restrict__ accepted, int32_t* __restrict__ acc_len, int32_t* __restrict__ bonus) {
    const int b = blockIdx.x, lane = threadIdx.x;
    const int32_t* tk = tokens + (size_t)b * N;
    const int32_t* pa = parents + (size_t)b * N;
    const int32_t* ch = choice + (size_t)b * N;
    int32_t* acc = accepted + (size_t)b * max_acc;
    int cur = 0, len = 1;
    if (lane == 0) acc[0] = 0;
    while (true) {
        const int want = ch[cur];
        int found = 0x7fffffff;
        for (int i = 1 + lane; i < N; i += 32)
            if (pa[i] == cur && tk[i] == want) found = min(found, i);
        for (int o = 16; o > 0; o >>= 1) found = min(found, __shfl_xor_sync(0xffffffffu, found, o));
        if (found == 0x7fffffff || len >= max_acc) break;
        cur = found;
        if (lane == 0) acc[len] = cur;
        ++len;
    }
    for (int j = len + lane; j < max_acc; j += 32) acc[j] = -1;
    if (lane == 0) { acc_len[b] = len; bonus[b] = ch[cur]; }
}

extern "C" __global__ void __launch_bounds__(128) kv_compact(
    uint4* __restrict__ cache, long long layer_stride, int row_vec, const int32_t* __restrict__ page_table,
    int max_pages, int page_size, const int32_t* __restrict__ block_start, const int32_t* __restrict__ accepted,
    int max_acc, const int32_t* __restrict__ acc_len) {
    extern __shared__ uint4 rows[];
    const int b = blockIdx.x, layer = blockIdx.y;
    const int len = acc_len[b], start = block_start[b];
    uint4* slab = cache + (size_t)layer * layer_stride;
    const int32_t* pt = page_table + (size_t)b * max_pages;
    for (int t = threadIdx.x; t < len * row_vec; t += blockDim.x) {
        int j = t / row_vec, v = t - j * row_vec;
        int r = start + accepted[(size_t)b * max_acc + j];
        size_t phys = (size_t)pt[r / page_size] * page_size + r % page_size;
        rows[t] = slab[phys * row_vec + v];
    }
    __syncthreads();
    for (int t = threadIdx.x; t < len * row_vec; t += blockDim.x) {
        int j = t / row_vec, v = t - j * row_vec;
        int r = start + j;
        size_t phys = (size_t)pt[r / page_size] * page_size + r % page_size;
        slab[phys * row_vec + v] = rows[t];
    }
}
