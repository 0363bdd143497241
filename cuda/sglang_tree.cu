// sglang_tree.cu: our verify blocks -> SGLang's EAGLE tree arrays, and the greedy accept over them.
//
// Golden twin: kdtree/ops/sglang_golden.py  sglang_tree + sglang_verify_greedy (the contract, with the
// layouts of sgl-kernel's build_tree_kernel_efficient outputs and verify_tree_greedy; that module names the
// commit read). Wrappers: kdtree/bridge.py.
//
// sglang_tree        grid batch, block 1024, static smem 8 KB (the sort keys)
//   tokens int32 [batch, N], parents int32 [batch, N] (row 0 the root, -1 for the root and padding rows,
//   else < row), mask uint32 [batch, N, W] (W = ceil(N / 32), ancestor-or-self bits, tree_build's layout),
//   positions int32 [batch, N] (positions[b, 0] = seq_len[b], the root's position = the committed length).
//   N <= 2047 (the sort holds (parent + 1) << 11 | row in 2048 keys).
//   Writes draft int64 [batch, N] (= tokens), pos int64 [batch * N] (= positions), ridx int64 [batch, N]
//   (= b * N + row), next_tok / next_sib int64 [batch, N]: first child (smallest child row) and next larger
//   row with the same parent, -1 none (padding rows and the root are on no sibling list), and the mask:
//     mode 0 (full)     bool [sum(seq_len) * N + batch * N * N]: request b's block [N, seq_len[b] + N] at
//                       sum(seq_len[:b]) * N + b * N * N; only its tree columns [seq_len[b], seq_len[b] + N)
//                       are written (the caller fills the prefix columns with true, as SGLang does);
//     mode 1 (qlen)     bool [batch, N, N];
//     mode 2 (packed)   uint8 [batch * N, nbytes], nbytes 1 / 2 / 4 for N <= 8 / 16 / 32 (N <= 32),
//                       bit c % 8 of byte c / 8 = column c.
//   Column c of the tree part is row c; column 0 (the root) is true on every row.
//   Children are found by sorting the keys (parent + 1) << 11 | row (bitonic, in shared memory): equal
//   parents end up adjacent in row order, so each list is one pass over the sorted keys.
//
// sglang_verify_greedy  grid batch, block 1 (the sibling list is a chain)
//   candidates, ridx, next_tok, next_sib, target int64 [batch, N]; num_spec S >= 1.
//   From row 0, at most S - 1 times: walk the current row's child list for a draft token equal to the
//   target's choice at the last accepted row; stop at none. Writes accept int32 [batch, S] (flat rows, root
//   first, -1 padded), n_acc int32 [batch] (draft rows accepted), predicts int32 [batch * N] at each
//   accepted row (the target's choice there; other entries are left as they were).
#include "common.cuh"

#define SORT_KEYS 2048
#define SORT_THREADS 1024

extern "C" __global__ void sglang_tree(
    const int32_t* __restrict__ tokens, const int32_t* __restrict__ parents,
    const uint32_t* __restrict__ mask, const int32_t* __restrict__ positions, int N, int mode, int nbytes,
    int64_t* __restrict__ draft,
    int64_t* __restrict__ pos, int64_t* __restrict__ ridx, int64_t* __restrict__ next_tok,
    int64_t* __restrict__ next_sib, uint8_t* __restrict__ tree_mask) {
    __shared__ uint32_t keys[SORT_KEYS];
    const int b = blockIdx.x, t = threadIdx.x;
    const int W = (N + 31) / 32;
    const size_t row0 = (size_t)b * N;
    const int32_t* pa = parents + row0;
    int P = 1;
    while (P < N) P <<= 1;
    for (int i = t; i < P; i += SORT_THREADS)
        keys[i] = i < N ? ((uint32_t)(pa[i] + 1) << 11) | (uint32_t)i : 0xffffffffu;
    for (int i = t; i < N; i += SORT_THREADS) {
        draft[row0 + i] = tokens[row0 + i];
        pos[row0 + i] = positions[row0 + i];
        ridx[row0 + i] = (int64_t)(row0 + i);
        next_tok[row0 + i] = -1;
    }
    __syncthreads();
    for (int k = 2; k <= P; k <<= 1) {  // bitonic sort, ascending
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = t; i < P; i += SORT_THREADS) {
                const int l = i ^ j;
                if (l > i) {
                    const uint32_t a = keys[i], c = keys[l];
                    const bool up = (i & k) == 0;
                    if ((a > c) == up) { keys[i] = c; keys[l] = a; }
                }
            }
            __syncthreads();
        }
    }
    // sorted keys: parent-major, row-minor. keys of parent -1 (the root, padding rows) head the order.
    for (int s = t; s < N; s += SORT_THREADS) {
        const uint32_t k = keys[s];
        const int row = (int)(k & 2047u), par = (int)(k >> 11) - 1;
        int64_t sib = -1;
        if (par >= 0) {
            if (s + 1 < N && (keys[s + 1] >> 11) == (k >> 11)) sib = (int64_t)(keys[s + 1] & 2047u);
            if (s == 0 || (keys[s - 1] >> 11) != (k >> 11)) next_tok[row0 + par] = row;
        }
        next_sib[row0 + row] = sib;
    }
    // the mask
    const uint32_t* mrow = mask + row0 * W;
    if (mode == 2) {
        for (int i = t; i < N; i += SORT_THREADS) {
            const uint32_t bits = mrow[(size_t)i * W] | 1u;  // N <= 32: one word
            for (int y = 0; y < nbytes; ++y) tree_mask[(row0 + i) * nbytes + y] = (uint8_t)(bits >> (8 * y));
        }
        return;
    }
    size_t base = (size_t)b * N * N, width = N;
    if (mode == 0) {
        long long before = 0;
        for (int i = 0; i < b; ++i) before += positions[(size_t)i * N];
        const int seq = positions[row0];
        base += (size_t)before * N + seq;
        width = (size_t)seq + N;
    }
    for (int e = t; e < N * N; e += SORT_THREADS) {
        const int i = e / N, c = e - i * N;
        const bool on = c == 0 || ((mrow[(size_t)i * W + c / 32] >> (c % 32)) & 1u);
        tree_mask[base + (size_t)i * width + c] = on;
    }
}

extern "C" __global__ void sglang_verify_greedy(
    const int64_t* __restrict__ candidates, const int64_t* __restrict__ ridx,
    const int64_t* __restrict__ next_tok, const int64_t* __restrict__ next_sib,
    const int64_t* __restrict__ target, int N, int S,
    int32_t* __restrict__ predicts, int32_t* __restrict__ accept, int32_t* __restrict__ n_acc) {
    const int b = blockIdx.x;
    const size_t row0 = (size_t)b * N;
    int64_t last = ridx[row0];
    int32_t* acc = accept + (size_t)b * S;
    acc[0] = (int32_t)last;
    int n = 0;
    int64_t cur = 0;
    for (int j = 1; j < S; ++j) {
        cur = next_tok[row0 + cur];
        const int64_t want = target[last];
        while (cur != -1 && candidates[row0 + cur] != want) cur = next_sib[row0 + cur];
        if (cur == -1) break;
        predicts[last] = (int32_t)want;
        acc[++n] = (int32_t)ridx[row0 + cur];
        last = ridx[row0 + cur];
    }
    for (int j = n + 1; j < S; ++j) acc[j] = -1;
    n_acc[b] = n;
    predicts[last] = (int32_t)target[last];
}
