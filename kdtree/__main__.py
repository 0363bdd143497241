"""Command line: `python -m kdtree lab ...` runs notebooks; `python -m kdtree bench` the kernel benchmarks;
`python -m kdtree tp --world 8` the tensor-parallel dry-run; `python -m kdtree report` writes docs/results.md
from the records; `python -m kdtree info` prints the setup."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m kdtree {lab,bench,tp,report,info} ...  (python -m kdtree lab --help)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "report":
        from .report import main as main_report
        return main_report(rest)
    if cmd == "lab":
        from .lab import main_lab
        return main_lab(rest)
    commands = {"bench": _bench, "tp": _tp, "info": _info}
    if cmd in commands:
        return commands[cmd](rest)
    print(f"unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


def _bench(rest: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kdtree bench", description="GPU kernel benchmarks")
    ap.add_argument("--out", default=None, help="output folder (default: outputs/<gpu>/)")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--bridge", action="store_true", help="the bridges' benchmark (bridge.json) instead")
    a = ap.parse_args(rest)
    import torch
    if not torch.cuda.is_available():
        print("error: the kernel benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    from . import bench
    from .lab import output_dir
    if a.bridge:
        from .bench import bridge as bench_bridge
        rec = bench_bridge.run(a.out or output_dir("cuda"))
        print(bench_bridge.summary(rec))
        return 0
    rec = bench.run(a.out or output_dir("cuda"), quick=a.quick)
    print(bench.summary(rec))
    return 0


def _tp(rest: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kdtree tp",
                                 description="tensor-parallel dry-run: `world` local ranks shard a tiny "
                                 "model and check it against the unsharded one")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--backend", default="gloo", help="gloo (CPU, default) or nccl (one GPU per rank)")
    ap.add_argument("--int4", action="store_true", help="routed experts in the INT4 release format")
    a = ap.parse_args(rest)
    from .tp import DRY_ARGS, check_shardable, dryrun
    try:
        check_shardable(DRY_ARGS, a.world)
        print(f"tp dry-run: {a.world} local ranks over {a.backend} (each shards, decodes, serves a "
              "batch) ...", flush=True)
        ranks = dryrun(a.world, a.backend, int4=a.int4)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok = True
    for r in ranks:
        good = r["logits_rel_err"] < 1e-4 and r["ddtree_equals_ar"] and r["ar_equals_unsharded"]
        ok &= good
        print(f"rank {r['rank']}/{r['world']} ({r['backend']}): "
              f"logits rel err {r['logits_rel_err']:.1e}, "
              f"DDTree == AR {r['ddtree_equals_ar']}, AR == unsharded {r['ar_equals_unsharded']}, "
              f"oracle tau {r['tau_oracle']:.2f}, {r['params_on_rank']:,} of {r['params_unsharded']:,} "
              f"parameters {'ok' if good else 'FAILED'}")
    return 0 if ok else 1


def _info(rest: list[str]) -> int:
    import platform

    if rest:
        print(f"error: python -m kdtree info takes no arguments, got {rest}", file=sys.stderr)
        return 2
    import numpy
    import torch

    from . import __version__
    from .lab import output_dir, pick_device
    dev = pick_device("auto")
    print(f"kdtree {__version__}  python {platform.python_version()}  torch {torch.__version__}  "
          f"numpy {numpy.__version__}")
    print(f"device: {dev}" + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else ""))
    print(f"lab outputs: {output_dir(dev)}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
