"""Engines kept for the generate_* wrappers (`kdtree.decode`): one batch-1 engine per model, drafter, mode,
budget, backend and context bucket, so that repeated calls replay the graphs captured once."""
from __future__ import annotations

import math
from collections import OrderedDict

from ..model import Transformer
from .engine import Engine

_ENGINES: "OrderedDict[tuple, Engine]" = OrderedDict()
MAX_CACHED_ENGINES = 4


def engine_for(model: Transformer, drafter, mode: str, budget, need: int, backend: str | None = None,
               graphs: bool = True) -> Engine:
    """A batch-1 engine for the generate_* wrappers, kept per (model, drafter, mode, budget, backend, context
    bucket) so that repeated calls replay the graphs captured once (at most MAX_CACHED_ENGINES kept)."""
    mpe = model.args.max_position_embeddings
    max_len = min(mpe, max(256, 1 << max(0, math.ceil(math.log2(max(need, 1))))))
    key = (id(model), id(drafter), mode, budget, backend, max_len, graphs, model.attn_impl, model.dtype,
           str(model.device))
    e = _ENGINES.get(key)
    if e is None or e.model is not model or e.drafter is not drafter:
        e = Engine(model, drafter, mode=mode, budget=budget, max_batch=1, max_len=max_len, backend=backend,
                   graphs=graphs)
        _ENGINES[key] = e
        while len(_ENGINES) > MAX_CACHED_ENGINES:
            _ENGINES.popitem(last=False)
    _ENGINES.move_to_end(key)
    return e
