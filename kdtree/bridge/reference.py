"""Reference-typed bridges: drop-ins for the public DDTree release's tree functions (its ddtree.py; same
signatures and return types, so an integration switches by changing one import). CUDA tensors run the kernels,
CPU tensors the golden twins (golden.py).

    build_ddtree_tree(draft_logits [L, V], budget)
        -> (node_token_ids long [n], node_depths long [n], parents list[int] (n + 1, parents[0] = -1),
            child_maps list[dict[token, row]] (n + 1, row 0 the root), visibility bool [n + 1, n + 1],
            subtimes)
    compile_ddtree_tree(root_token_id, start, node_token_ids, node_depths, visibility_cpu, past_length, dtype,
                        device, <4 buffers>, previous_tree_start, previous_tree_length)
        -> (input_ids [1, n + 1], position_ids [1, n + 1], attention_mask [1, 1, n + 1, past + n + 1],
            past_length, n + 1)
    follow_verified_tree(child_maps, posterior [1, n + 1]) -> (accepted rows list[int] from 0, next token)
    compact_dynamic_cache(past_key_values, past_length, keep_current_indices) -> None
  compact_dynamic_cache also takes a 1-D long tensor of rows on the cache's device (no host copy of them).
  Where the reference and this module differ (golden.py's module docstring states the order):
    - equal scores: the reference breaks ties by the rank path, kdtree by (depth, parent row, rank), so under
      exact ties at the budget's edge the two may keep different (equally likely) nodes; scores are float32
      sums root-down here, float64 there, so nodes whose scores differ by float32 rounding may swap rows;
    - tokens of probability 0 (-inf logits) are never nodes here: with fewer finite prefixes than the budget
      the tree is smaller (the reference pads with -inf-scored nodes); NaN and +inf logits are refused;
    - the budget is at most kernels.MAX_BUDGET (1024) and L at most kernels.MAX_DEPTH on the GPU;
    - subtimes has the reference's keys: tree_build_copy (kernels and the one copy to the host),
      tree_build_heap (the child maps), tree_build_visibility (unpacking the mask bits).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import checks, kernels
from .native import _INT_DTYPES, _LOGIT_DTYPES, build_trees

REFERENCE_SUBTIMES = ("tree_build_copy", "tree_build_heap", "tree_build_visibility")


def _empty_tree(subtimes: dict):
    vis = torch.ones(1, 1, dtype=torch.bool)
    return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), [-1], [dict()], vis, subtimes


def _bad_values(x: torch.Tensor) -> torch.Tensor:
    """int32 [1]: bit 0 a NaN, bit 1 a +inf, bit 2 a row of -inf only (kernels.check_logit_values on the
    device)."""
    return (torch.isnan(x).any().int() | (torch.isposinf(x).any().int() << 1)
            | (torch.isneginf(x).all(-1).any().int() << 2)).view(1)


def _refuse(bad: int) -> None:
    for bit, what in ((1, "NaN present; expected finite values or -inf"),
                      (2, "+inf present; expected finite values or -inf"),
                      (4, "a row is all -inf; expected at least one finite logit per depth")):
        if bad & bit:
            raise ValueError(f"draft_logits: {what}")


class _GraphedBuild:
    """build_ddtree_tree's device work for one (device, L, V, budget, dtype), captured once in a CUDA graph:
    the logits copied into a static buffer, the value scan, the tree kernels, and everything the host reads
    packed into one int32 buffer [bad, n_nodes, tokens (N), parents (N), depths (N), mask words (N * W)]."""

    def __init__(self, logits: torch.Tensor, budget: int):
        dev = logits.device
        dt = logits.dtype if logits.dtype == torch.bfloat16 else torch.float32
        self.x = torch.empty(logits.shape, dtype=dt, device=dev)
        self.x.normal_()  # the warm-up's values (kernels compile, modules load)
        zero = torch.zeros(1, dtype=torch.int32, device=dev)

        def work():
            tb = kernels.tree_build(self.x[None], budget, zero, zero, check_values=False)
            return torch.cat([_bad_values(self.x), tb.n_nodes, tb.tokens[0], tb.parents[0], tb.depths[0],
                              tb.mask[0].reshape(-1)])
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            work()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = work()

    def __call__(self, logits: torch.Tensor) -> np.ndarray:
        self.x.copy_(logits)
        self.graph.replay()
        return self.out.cpu().numpy()  # the one copy to the host


_GRAPHS: dict = {}
_GRAPHS_KEPT = 8  # shapes whose graphs are kept (each holds a copy of its logits' size)


def _device_build(x: torch.Tensor, budget: int, check_values: bool, graph: bool) -> np.ndarray:
    """The packed host buffer of _GraphedBuild, from a graph replay or (graph=False, or inside someone's
    capture) eagerly."""
    if graph and not torch.cuda.is_current_stream_capturing():
        key = (x.device.index, *x.shape, budget, x.dtype)
        g = _GRAPHS.pop(key, None) or _GraphedBuild(x, budget)
        _GRAPHS[key] = g  # most recent last
        while len(_GRAPHS) > _GRAPHS_KEPT:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        h = g(x)
        if check_values:
            _refuse(int(h[0]))
        return h
    zero = torch.zeros(1, dtype=torch.int32, device=x.device)
    tb = build_trees(x[None], budget, zero, zero, check_values=check_values)
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    flat = torch.cat([bad, tb.n_nodes, tb.tokens[0], tb.parents[0], tb.depths[0], tb.mask[0].reshape(-1)])
    return flat.cpu().numpy()


def build_ddtree_tree(draft_logits: torch.Tensor, budget: int, *, check_values: bool = True,
                      graph: bool = True):
    """The reference's build_ddtree_tree: draft logits [L, V] of one request -> the best-first tree of at most
    `budget` nodes, on the host as the reference returns it (module docstring). budget <= 0 or L = 0 gives the
    root alone, as in the reference. On the GPU the device work is one CUDA graph per shape (graph=False:
    eager launches), its value scan included, and one copy to the host."""
    checks.tensor("draft_logits", draft_logits, _LOGIT_DTYPES, ndim=2)
    if isinstance(budget, bool) or not checks.is_int(budget):
        raise ValueError(f"budget={budget!r}: expected an integer")
    subtimes = {k: 0.0 for k in REFERENCE_SUBTIMES}
    L, V = draft_logits.shape
    if budget <= 0 or L == 0:
        return _empty_tree(subtimes)
    budget = checks.int_in("budget", budget, 1, kernels.MAX_BUDGET)
    if V == 0:
        raise ValueError("draft_logits: expected a vocabulary of at least one token, got V=0")
    t0 = time.perf_counter()
    if draft_logits.is_cuda:
        kernels._on_one_gpu(draft_logits=draft_logits)
        h = _device_build(draft_logits, budget, check_values, graph)
    else:
        zero = torch.zeros(1, dtype=torch.int32)
        tb = build_trees(draft_logits[None], budget, zero, zero, check_values=check_values)
        h = torch.cat([zero, tb.n_nodes, tb.tokens[0], tb.parents[0], tb.depths[0],
                       tb.mask[0].reshape(-1)]).numpy()
    N = budget + 1
    h = h[1:]  # past the value flags
    t1 = time.perf_counter()
    n = int(h[0])
    tok, par, dep = h[1:1 + N], h[1 + N:1 + 2 * N], h[1 + 2 * N:1 + 3 * N]
    parents = par[:n + 1].tolist()
    tokens = tok[1:n + 1].tolist()
    child_maps: list[dict[int, int]] = [dict() for _ in range(n + 1)]
    for row in range(1, n + 1):
        child_maps[parents[row]][tokens[row - 1]] = row
    t2 = time.perf_counter()
    words = np.ascontiguousarray(h[1 + 3 * N:]).view(np.uint32).reshape(N, -1)
    bits = np.unpackbits(words.view(np.uint8).reshape(N, -1), axis=1, bitorder="little")
    visibility = torch.from_numpy(bits[:n + 1, :n + 1].astype(bool))
    t3 = time.perf_counter()
    subtimes.update(tree_build_copy=t1 - t0, tree_build_heap=t2 - t1, tree_build_visibility=t3 - t2)
    return (torch.tensor(tokens, dtype=torch.long), torch.from_numpy(dep[1:n + 1].astype(np.int64)), parents,
            child_maps, visibility, subtimes)


def compile_ddtree_tree(root_token_id, start: int, node_token_ids: torch.Tensor, node_depths: torch.Tensor,
                        visibility_cpu: torch.Tensor, past_length: int, dtype: torch.dtype, device,
                        verify_input_ids_buffer: torch.Tensor, verify_position_ids_buffer: torch.Tensor,
                        attention_mask_buffer: torch.Tensor, tree_visibility_buffer: torch.Tensor,
                        previous_tree_start: int, previous_tree_length: int):
    """The reference's compile_ddtree_tree: writes the verify block into the caller's buffers and returns
    views of them. The previous round's tree block of the additive mask is first cleared to 0 (those columns
    are now past); the new block holds 0 where visibility is true and dtype's most negative value
    elsewhere."""
    n1 = 1 + checks.tensor("node_token_ids", node_token_ids, (torch.int64, torch.int32), ndim=1).numel()
    checks.tensor("node_depths", node_depths, (torch.int64, torch.int32), shape=(n1 - 1,))
    checks.tensor("visibility_cpu", visibility_cpu, (torch.bool,), shape=(n1, n1))
    start = checks.int_in("start", start, 0)
    past_length = checks.int_in("past_length", past_length, 0)
    prev_start = checks.int_in("previous_tree_start", previous_tree_start, 0)
    prev_len = checks.int_in("previous_tree_length", previous_tree_length, 0)
    checks.tensor("verify_input_ids_buffer", verify_input_ids_buffer, ndim=2)
    checks.tensor("verify_position_ids_buffer", verify_position_ids_buffer, ndim=2)
    checks.tensor("attention_mask_buffer", attention_mask_buffer, ndim=4)
    checks.tensor("tree_visibility_buffer", tree_visibility_buffer, (torch.bool,), ndim=2)
    rows, cols = attention_mask_buffer.shape[2:]
    for name, have, need in (("verify_input_ids_buffer", verify_input_ids_buffer.shape[1], n1),
                             ("verify_position_ids_buffer", verify_position_ids_buffer.shape[1], n1),
                             ("tree_visibility_buffer", min(tree_visibility_buffer.shape), n1),
                             ("attention_mask_buffer rows", rows, max(n1, prev_len)),
                             ("attention_mask_buffer columns", cols,
                              max(past_length + n1, prev_start + prev_len))):
        if have < need:
            raise ValueError(f"{name}: holds {have}, the tree needs {need}")
    m = attention_mask_buffer
    if prev_len:
        m[0, 0, :prev_len, prev_start:prev_start + prev_len] = 0
    ids = verify_input_ids_buffer[:, :n1]
    ids[0, 0] = root_token_id
    ids[0, 1:].copy_(node_token_ids)
    pos = verify_position_ids_buffer[:, :n1]
    pos[0, 0] = start
    pos[0, 1:].copy_(node_depths)
    pos[0, 1:] += start
    vis = tree_visibility_buffer[:n1, :n1]
    vis.copy_(visibility_cpu)
    block = m[0, 0, :n1, past_length:past_length + n1]
    block.copy_(torch.where(vis, 0.0, torch.finfo(dtype).min))
    return ids, pos, m[:, :, :n1, :past_length + n1], past_length, n1


def follow_verified_tree(child_maps: list, posterior: torch.Tensor) -> tuple[list[int], int]:
    """The reference's follow_verified_tree: from row 0, move to the child whose token is the target's choice
    (posterior [1, n + 1]: the target's token at every row) while one exists. Returns (accepted rows, starting
    with 0; the target's token at the last of them)."""
    if not isinstance(child_maps, list) or not child_maps or not all(isinstance(c, dict) for c in child_maps):
        raise ValueError("child_maps: expected a non-empty list of dicts (build_ddtree_tree's fourth output)")
    checks.tensor("posterior", posterior, _INT_DTYPES, ndim=2)
    if posterior.shape[1] != len(child_maps):
        raise ValueError(f"posterior: expected [1, {len(child_maps)}] (one token per tree row), got "
                         f"{tuple(posterior.shape)}")
    choice = posterior[0].tolist()
    path = [0]
    while (nxt := child_maps[path[-1]].get(choice[path[-1]])) is not None:
        path.append(nxt)
    return path, int(choice[path[-1]])


def _cache_tensors(past_key_values) -> list[torch.Tensor]:
    """Every key and value tensor [..., seq, D] of a transformers DynamicCache (5.x layers or 4.x lists)."""
    if hasattr(past_key_values, "layers"):
        out = []
        for layer in past_key_values.layers:
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if isinstance(k, torch.Tensor) and k.numel():
                out += [k, v]
        return out
    if hasattr(past_key_values, "key_cache"):
        return [t for pair in zip(past_key_values.key_cache, past_key_values.value_cache) for t in pair]
    raise ValueError("past_key_values: expected a transformers DynamicCache, got "
                     f"{type(past_key_values).__name__}")


def compact_dynamic_cache(past_key_values, past_length: int, keep_current_indices) -> None:
    """The reference's compact_dynamic_cache: the appended rows past_length + keep[j] move to past_length + j
    (gather semantics), then the cache is cut to past_length + len(keep) rows. keep: a list of rows of the
    appended window, or a 1-D int64 tensor of them on the cache's device (then nothing is copied to the host).
    Everything is checked before the cache is touched."""
    tensors = _cache_tensors(past_key_values)
    past_length = checks.int_in("past_length", past_length, 0)
    seq = {t.shape[-2] for t in tensors}
    if len(seq) > 1:
        raise ValueError(f"past_key_values: layers of different lengths {sorted(seq)}")
    seq_len = seq.pop() if seq else past_length
    if past_length > seq_len:
        raise ValueError(f"past_length={past_length}: the cache holds only {seq_len} rows")
    window = seq_len - past_length
    if isinstance(keep_current_indices, torch.Tensor):
        keep = checks.tensor("keep_current_indices", keep_current_indices, (torch.int64,), ndim=1)
        if tensors and keep.device != tensors[0].device:
            raise ValueError(f"keep_current_indices: expected a tensor on {tensors[0].device}, got "
                             f"{keep.device}")
    else:
        rows = [checks.int_in(f"keep_current_indices[{i}]", r, 0, max(window - 1, 0))
                for i, r in enumerate(keep_current_indices)]
        keep = torch.tensor(rows, dtype=torch.long, device=tensors[0].device if tensors else "cpu")
    k = keep.numel()
    if k > window:
        raise ValueError(f"keep_current_indices: {k} rows kept of an appended window of {window}")
    if k and 0 < k < window:
        by_dev = {}
        for t in tensors:
            idx = by_dev.setdefault(t.device, keep.to(t.device))
            tail = t.narrow(-2, past_length, window)
            t.narrow(-2, past_length, k).copy_(tail.index_select(-2, idx))
    if window - k:  # a negative crop removes that many rows under transformers 4.x and 5.x alike
        past_key_values.crop(-(window - k))

