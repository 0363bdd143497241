"""The SGLang bridge: our verify blocks (kernels.TreeBatch) as sgl-kernel's build_tree_kernel_efficient
outputs, and its verify_tree_greedy over them (golden.SglangTree states the layouts). CUDA tensors run
cuda/sglang_tree.cu (the whole batch in one launch), CPU tensors the golden twins (golden.sglang_tree,
golden.sglang_verify_greedy).

    to_sglang(tree, mode, tree_mask=None) -> SglangTensors
    sglang_verify_greedy(sg, target_predict [b, N], num_spec_steps)
        -> (predicts, accept_index, accept_token_num)
  sgl-kernel cannot be installed here, so these follow its source (golden.py names the commit read), not a run
  of it: an integration should compare one batch of its own build_tree_kernel_efficient outputs with
  to_sglang's before switching (docs/bridges.md lists what to check).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import checks, golden, kernels
from ..kernels import TreeBatch


@dataclass
class SglangTensors:
    """golden.SglangTree's arrays as torch tensors on the tree's device (same names, dtypes and layouts)."""
    draft_tokens: torch.Tensor          # int64 [b, N]
    positions: torch.Tensor             # int64 [b * N]
    tree_mask: torch.Tensor             # bool (full, qlen_only); uint8 [b * N, nbytes] (bit-packed)
    retrive_index: torch.Tensor         # int64 [b, N]
    retrive_next_token: torch.Tensor    # int64 [b, N]
    retrive_next_sibling: torch.Tensor  # int64 [b, N]
    mode: str


_MODE_ID = {m: i for i, m in enumerate(golden.SGLANG_MODES)}
SGLANG_MAX_N = 2047  # cuda/sglang_tree.cu sorts (parent + 1) << 11 | row


def _mask_size(tree: TreeBatch, mode: str) -> int:
    b, N = tree.tokens.shape
    if mode == "full":
        return int(tree.positions[:, 0].long().sum()) * N + b * N * N  # a host read (pass tree_mask)
    return b * N * N if mode == "qlen_only" else b * N * golden.sglang_mask_bytes(N)


def to_sglang(tree: TreeBatch, mode: str = "qlen_only",
              tree_mask: torch.Tensor | None = None) -> SglangTensors:
    """Our verify blocks (kernels.TreeBatch: root row 0 at position seq_len) -> SGLang's tree arrays, the
    whole batch in one launch on the GPU. tree_mask: the caller's buffer (SGLang allocates it; in "full" mode
    only the tree columns are written, the prefix columns are the caller's, true in SGLang); without one,
    a buffer is made ("full" then reads the lengths on the host, and fills the prefix with true)."""
    mode = checks.one_of("mode", mode, golden.SGLANG_MODES)
    checks.tensor("tree.tokens", tree.tokens, (torch.int32,), ndim=2)
    b, N = tree.tokens.shape
    if not 1 <= N <= SGLANG_MAX_N:
        raise ValueError(f"tree: {N} rows a request; to_sglang takes 1 to {SGLANG_MAX_N}")
    for name in ("parents", "positions"):
        checks.tensor(f"tree.{name}", getattr(tree, name), (torch.int32,), shape=(b, N))
    W = (N + 31) // 32
    checks.tensor("tree.mask", tree.mask, (torch.int32,), shape=(b, N, W))
    nbytes = golden.sglang_mask_bytes(N) if mode == "qlen_only_bitpacking" else 1
    dt = torch.uint8 if mode == "qlen_only_bitpacking" else torch.bool
    dev = tree.tokens.device
    if tree_mask is not None:
        want = (b * N, nbytes) if mode == "qlen_only_bitpacking" else None
        checks.tensor("tree_mask", tree_mask, (dt,), ndim=2 if want else 1, shape=want, contiguous=True,
                      device=dev)
        if want is None and tree_mask.numel() < b * N * N:  # full: the lengths' part is the caller's to size
            raise ValueError(f"tree_mask: holds {tree_mask.numel()}, expected at least {b * N * N}")
    if not tree.tokens.is_cuda:
        g = golden.sglang_tree(tree.tokens.numpy(), tree.parents.numpy(), tree.positions[:, 0].numpy(), mode)
        out = SglangTensors(*(torch.from_numpy(a) for a in (g.draft_tokens, g.positions, g.tree_mask,
                                                               g.retrive_index, g.retrive_next_token,
                                                               g.retrive_next_sibling)), mode)
        if tree_mask is not None:
            _copy_mask(tree_mask, out.tree_mask, tree, mode)
            out.tree_mask = tree_mask
        return out
    kernels._on_one_gpu(tokens=tree.tokens, parents=tree.parents, positions=tree.positions, mask=tree.mask)
    if tree_mask is None:
        size = _mask_size(tree, mode)
        if mode == "full":
            tree_mask = torch.ones(size, dtype=dt, device=dev)
        elif mode == "qlen_only":
            tree_mask = kernels._empty(size, dtype=dt, device=dev)
        else:
            tree_mask = kernels._empty(b * N, nbytes, dtype=dt, device=dev)
    out = SglangTensors(kernels._empty(b, N, dtype=torch.int64, device=dev),
                        kernels._empty(b * N, dtype=torch.int64, device=dev), tree_mask,
                        *(kernels._empty(b, N, dtype=torch.int64, device=dev) for _ in range(3)), mode)
    p = kernels._p
    kernels._launch("sglang_tree", "sglang_tree", (b,), (1024,),
                    (p(tree.tokens), p(tree.parents), p(tree.mask), p(tree.positions), kernels._i(N),
                     kernels._i(_MODE_ID[mode]), kernels._i(nbytes), p(out.draft_tokens), p(out.positions),
                     p(out.retrive_index), p(out.retrive_next_token), p(out.retrive_next_sibling),
                     p(tree_mask)))
    return out


def _copy_mask(dst: torch.Tensor, src: torch.Tensor, tree: TreeBatch, mode: str) -> None:
    """The CPU path into a caller's buffer, writing what the kernel writes (full: the tree columns only)."""
    if mode != "full":
        dst[:src.numel() if src.dim() == 1 else None].copy_(src)
        return
    b, N = tree.tokens.shape
    at = 0
    for i in range(b):
        s = int(tree.positions[i, 0])
        blk = src[at:at + N * (s + N)].view(N, s + N)
        dst[at:at + N * (s + N)].view(N, s + N)[:, s:].copy_(blk[:, s:])
        at += N * (s + N)


def sglang_verify_greedy(sg: SglangTensors, target_predict: torch.Tensor, num_spec_steps: int):
    """verify_tree_greedy over to_sglang's arrays: target_predict int64 [b, N] (the target's token at every
    row). Returns predicts int32 [b * N] (the target's token at each accepted row, -1 elsewhere),
    accept_index int32 [b, num_spec_steps] (flat rows, root first, -1 padded), accept_token_num int32 [b]."""
    b, N = sg.draft_tokens.shape
    checks.tensor("target_predict", target_predict, (torch.int64,), shape=(b, N))
    S = checks.int_in("num_spec_steps", num_spec_steps, 1, 1024)
    if not sg.draft_tokens.is_cuda:
        arrays = (sg.draft_tokens, sg.positions, sg.tree_mask, sg.retrive_index, sg.retrive_next_token,
                  sg.retrive_next_sibling)
        g = golden.SglangTree(*(t.numpy() for t in arrays), sg.mode)
        return tuple(torch.from_numpy(a) for a in golden.sglang_verify_greedy(g, target_predict.numpy(), S))
    dev = sg.draft_tokens.device
    tp = target_predict.contiguous()
    kernels._on_one_gpu(draft_tokens=sg.draft_tokens, target_predict=tp)
    predicts = torch.full((b * N,), -1, dtype=torch.int32, device=dev)
    accept = kernels._empty(b, S, dtype=torch.int32, device=dev)
    n_acc = kernels._empty(b, dtype=torch.int32, device=dev)
    p = kernels._p
    kernels._launch("sglang_tree", "sglang_verify_greedy", (b,), (1,),
                    (p(sg.draft_tokens), p(sg.retrive_index), p(sg.retrive_next_token),
                     p(sg.retrive_next_sibling), p(tp), kernels._i(N), kernels._i(S), p(predicts), p(accept),
                     p(n_acc)))
    return predicts, accept, n_acc
