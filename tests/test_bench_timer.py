"""kdtree.bench.timer: the one timer of every benchmark (wall mode anywhere, the CUDA modes on a GPU)."""
import time

import pytest
import torch

from kdtree.bench.timer import L2_BYTES, input_sets, measure, mode_for


def test_wall_times_each_repeat_and_rotates_the_input_sets():
    calls = []
    fns = [lambda i=i: (calls.append(i), time.sleep(0.002)) for i in range(3)]
    t = measure(fns, 7, "wall", warmup=2)
    assert t.mode == "wall" and len(t.times) == 7
    assert calls == [0, 1, 2, 0, 1, 2, 0, 1, 2]          # 2 warm-up calls, then 7 timed ones in turn
    assert t.min >= 0.002 and t.median >= t.min
    order = []
    measure(lambda: order.append("call"), 2, "wall", warmup=3, before=lambda: order.append("before"))
    assert order == ["call"] * 3 + ["before"] + ["call"] * 2   # before() right before the timed repeats
    fast = measure(lambda: None, 5, "wall")
    assert fast.median < 0.002                           # the same check fails for a call that does not sleep


def test_bad_arguments_are_named_before_anything_runs():
    calls = []
    f = lambda: calls.append(1)
    with pytest.raises(ValueError, match="mode='cycles'"):
        measure(f, 3, "cycles")
    with pytest.raises(ValueError, match="repeats=0"):
        measure(f, 0, "wall")
    with pytest.raises(ValueError, match="warmup=-1"):
        measure(f, 3, "wall", warmup=-1)
    with pytest.raises(ValueError, match="fn: expected a callable"):
        measure([], 3, "wall")
    with pytest.raises(ValueError, match="fn: expected a callable"):
        measure(3, 3, "wall")
    with pytest.raises(ValueError, match="queue_cycles=-1"):
        measure(f, 3, "wall", queue_cycles=-1)
    for kw in ({"calls": 4}, {"queued": True}, {"warm_s": 1.0}):   # options of the other modes
        with pytest.raises(ValueError, match="calls is for mode 'host'"):
            measure(f, 3, "wall", **kw)
    if not torch.cuda.is_available():
        for mode in ("graph", "events", "host"):
            with pytest.raises(RuntimeError, match=f"mode='{mode}'.*needs a CUDA device"):
                measure(f, 3, mode)
    assert calls == []


def test_input_sets_rotate_past_l2():
    assert input_sets(L2_BYTES) == 3 and input_sets(3 * L2_BYTES) == 1
    assert input_sets(1, hi=8) == 8 and input_sets(4 * L2_BYTES, lo=2) == 2
    with pytest.raises(ValueError, match="set_bytes=0"):
        input_sets(0)
    with pytest.raises(ValueError, match="lo=3, hi=2"):
        input_sets(100, lo=3, hi=2)
    assert mode_for("cpu") == "wall" and mode_for("cuda") == "events"


@pytest.mark.gpu
def test_graph_replays_rotate_their_captures_and_time_the_gpu():
    xs = [torch.zeros(4, device="cuda") for _ in range(2)]
    t = measure([lambda x=x: x.add_(1) for x in xs], 10, "graph")
    torch.cuda.synchronize()
    # one eager warm-up call each, then 2 warm-up replays and 10 timed ones alternating
    assert [float(x[0]) for x in xs] == [7.0, 7.0] and len(t.times) == 10 and t.mode == "graph"
    cycles = 2_000_000
    ev = measure(lambda: torch.cuda._sleep(cycles), 10, "events")
    gr = measure(lambda: torch.cuda._sleep(cycles), 10, "graph")
    assert 0.7 < gr.median / ev.median < 1.3               # the same GPU work, either way
    host = measure(lambda: torch.cuda._sleep(cycles), 5, "host", calls=20)
    assert host.median < 0.2 * ev.median                   # launches only: the GPU never held the host
    with pytest.raises(RuntimeError, match="the GPU finished before 3 calls"):   # work outlasting the spin
        measure(lambda: (torch.cuda._sleep(cycles), torch.cuda.synchronize()), 1, "host", calls=3)

