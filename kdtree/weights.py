"""Checkpoints in the HF hub layout: config.json + model.safetensors (or sharded with an index).

`load(dir)` reads a checkpoint written by transformers' `DeepseekV3ForCausalLM.save_pretrained` (or by
`save` below) into a `kdtree.model.Transformer`. Every tensor is checked by name and shape first; a
mismatch raises `CheckpointError` listing the missing, unexpected and mis-shaped tensors.
Before any model is built, the config is checked against the tensors' names: the layers they hold must be
num_hidden_layers, plus at most the config's `num_nextn_predict_layers` trailing ones (the
multi-token-prediction layers real checkpoints ship: skipped and reported in `Transformer.skipped_tensors`),
and each MoE layer must hold n_routed_experts experts. Floating-point weights must come from floating
tensors and be finite (`allow_nonfinite=True` lets NaN / inf through, for debugging); shard files named by an
index must lie inside the checkpoint folder. Every failure is a `CheckpointError` naming the file or tensor.

Routed experts stored INT4 (compressed-tensors `pack-quantized`, as K2 checkpoints store them:
`...experts.{j}.{gate,up,down}_proj.weight_packed / weight_scale / weight_shape`) load into
`Int4Experts` for that layer, packed as they are; `save` writes a quantized model back the same way.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import checks, quant
from .config import ModelArgs
from .model import ATTN_IMPLS, Int4Experts, MoE, Transformer, check_attn_impl
from .weight_checks import (CheckpointError, check_layout, check_state_dict, check_values,  # noqa: F401
                            take_int4_experts)

def _read_json(path: Path, what: str) -> dict:
    """A JSON object from path, or CheckpointError naming the file."""
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"load: no {what} at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"load: {path} is not a readable JSON file ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"load: {path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _inside(d: Path, name) -> Path:
    """The regular file `name` of folder d; CheckpointError for a path that leaves d or is not a file."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"load: the shard name {name!r} is not a file name inside {d}")
    f = d / name
    if not f.resolve().is_relative_to(d.resolve()):
        raise CheckpointError(f"load: the shard {name!r} resolves outside {d} (a link?)")
    if not f.is_file():
        raise CheckpointError(f"load: the index names {name!r}, which is not a file in {d}")
    return f


def _tensor_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"load: {index}: expected a non-empty 'weight_map' object")
        return [_inside(d, f) for f in sorted(set(map(str, weight_map.values())))]
    files = [_inside(d, f.name) for f in sorted(d.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"load: no *.safetensors (or model.safetensors.index.json) in {d}")
    return files


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by name."""
    d = _path_arg("read_state_dict", path)
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f in _tensor_files(d):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    if k in out:
                        raise CheckpointError(f"load: tensor {k} is in both {where[k]} and {f.name} ({d})")
                    out[k], where[k] = fh.get_tensor(k), f.name
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types (header, dtype, truncation)
            raise CheckpointError(f"load: {f} is not a readable safetensors file ({type(e).__name__}: {e})") \
                from None
    return out


def _config(d: Path) -> tuple[dict, int]:
    """config.json of d (Kimi's text_config unwrapped) and its num_nextn_predict_layers (0 when absent)."""
    cfg = _read_json(d / "config.json", "config.json")
    inner = cfg.get("text_config", cfg)
    nextn = inner.get("num_nextn_predict_layers", 0) if isinstance(inner, dict) else 0
    if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
        raise CheckpointError(f"load: {d / 'config.json'}: num_nextn_predict_layers={nextn!r}: expected an "
                              "int >= 0")
    return cfg, nextn


def _path_arg(fn: str, path) -> Path:
    """A checkpoint folder argument as a Path: a non-empty str or os.PathLike, else ValueError naming it."""
    if not isinstance(path, (str, os.PathLike)) or not str(os.fspath(path)).strip():
        raise ValueError(f"{fn}: path={path!r}: expected a checkpoint folder (a non-empty str or "
                         "os.PathLike)")
    return Path(path)


def _dtype_arg(fn: str, dtype, allow_none: bool = False) -> torch.dtype | None:
    """A floating torch dtype or its name (checks.float_dtype); None where allowed."""
    return None if dtype is None and allow_none else checks.float_dtype(f"{fn}: dtype", dtype)


def _device_arg(fn: str, device) -> torch.device:
    """'cpu', or a CUDA device this machine has (checks.device)."""
    return checks.device(f"{fn}: device", device)


def _args_arg(fn: str, args) -> ModelArgs | None:
    if args is not None and not isinstance(args, ModelArgs):
        raise ValueError(f"{fn}: args: expected a kdtree ModelArgs (or None: the checkpoint's config.json), "
                         f"got {type(args).__name__}")
    return args


def checkpoint_kind(folder: Path) -> str | None:
    """'drafter' or 'target' for a folder whose config.json says which (a DFlash drafter's carries
    block_size and target_layer_ids), None without a readable config.json."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    dflash = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else cfg
    return "drafter" if "block_size" in dflash and "target_layer_ids" in dflash else "target"


def _writable(fn: str, path, kind: str) -> Path:
    """The folder `fn` may write a `kind` checkpoint into: refused (ValueError, nothing written) when it is
    a file, holds the other kind of checkpoint, or holds safetensors files other than model.safetensors
    (stale shards the loader would read)."""
    d = _path_arg(fn, path)
    if d.exists() and not d.is_dir():
        raise ValueError(f"{fn}: {d} is a file, not a folder")
    if d.is_dir():
        if (d / "model.safetensors.index.json").exists():
            raise ValueError(f"{fn}: {d} holds a sharded checkpoint (model.safetensors.index.json), which a "
                             "load would read instead of the file written here: write into an empty folder")
        other = checkpoint_kind(d)
        if other is not None and other != kind:
            raise ValueError(f"{fn}: {d} holds a {other} checkpoint (its config.json); write the {kind} into "
                             "another folder")
        stray = sorted(p.name for p in d.iterdir()
                       if p.suffix == ".safetensors" and p.name != "model.safetensors")
        if stray:
            raise ValueError(f"{fn}: {d} holds other checkpoint files ({', '.join(stray)}) that a load would "
                             "read: write into an empty folder, or remove them")
    return d


def _commit(d: Path, files: dict) -> None:
    """Write files {name: writer(path)} into a temporary folder beside d, then move each into d (each move
    atomic): a failed write leaves d's earlier files as they were."""
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", dir=d.parent))
    try:
        for name, write in files.items():
            write(tmp / name)
        d.mkdir(exist_ok=True)
        for name in files:
            os.replace(tmp / name, d / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(path: str | os.PathLike, dtype=torch.float32, device="cpu", attn_impl: str = "absorb",
         args: ModelArgs | None = None, allow_nonfinite: bool = False) -> Transformer:
    """Load a hub-layout checkpoint directory into a Transformer (config from its config.json unless given).
    INT4 routed experts stay packed (Int4Experts); `dtype` (a floating torch dtype or its name, 'bfloat16')
    applies to the floating-point weights; `device`: 'cpu' or a CUDA device this machine has. Every argument
    is checked (ValueError naming it) before any tensor is read, the checkpoint as the module docstring says
    before anything is built; allow_nonfinite: accept NaN / inf weights."""
    allow_nonfinite = checks.flag("allow_nonfinite", allow_nonfinite)
    d = _path_arg("load", path)
    dtype = _dtype_arg("load", dtype)
    device = _device_arg("load", device)
    args = _args_arg("load", args)
    checks.one_of("load: attn_impl", attn_impl, ATTN_IMPLS)
    if not d.is_dir():
        raise CheckpointError(f"load: {d} is not a directory")
    nextn = 0
    if args is None or (d / "config.json").exists():
        cfg, nextn = _config(d)
        if args is None:
            try:
                args = ModelArgs.from_hf_config(cfg)
            except ValueError as e:
                raise CheckpointError(f"load: {d / 'config.json'}: {e}") from None
    check_attn_impl(args, attn_impl, "load: ")
    found = read_state_dict(d)
    check_layout(found, args, nextn, where=f"checkpoint {d}")
    int4 = take_int4_experts(found, args, allow_nonfinite)
    with torch.device("meta"):
        skeleton = Transformer(args, attn_impl)
        for i, ex in int4.items():
            skeleton.model.layers[i].mlp.experts = Int4Experts(*(torch.empty_like(t, device="meta") for t in (
                ex.w13_packed, ex.w13_scale, ex.w2_packed, ex.w2_scale)))
    expected = {k: v.shape for k, v in skeleton.state_dict().items() if ".mlp.experts.w" not in k}
    skipped = check_state_dict(expected, found, args, where=f"checkpoint {d}")
    check_values({k: v for k, v in skeleton.state_dict().items() if k in expected}, found, allow_nonfinite,
                 where=f"checkpoint {d}")
    model = Transformer(args, attn_impl)
    for i, ex in int4.items():
        model.model.layers[i].mlp.experts = ex
    model.load_state_dict({k: found[k] for k in expected} | {k: v for k, v in model.state_dict().items()
                                                              if ".mlp.experts.w" in k}, strict=True)
    model.skipped_tensors = skipped
    model = model.to(device=device)
    for name, p in model.named_parameters():
        p.data = p.data.to(dtype)
    for name, b in model.named_buffers():
        if b.is_floating_point() and ".mlp.experts.w" not in name:
            b.data = b.data.to(dtype)
    return model.eval()


def save(model: Transformer, path: str | os.PathLike, dtype=None) -> Path:
    """Write config.json + model.safetensors in the hub layout (INT4 routed experts as pack-quantized
    tensors per expert, the way compressed-tensors writes them). Refuses (before writing) a folder that holds
    a drafter checkpoint or stray shards (`_writable`); the files are written beside it and moved in whole.
    dtype: the floating tensors' dtype on disk (a floating torch dtype or its name; None: as held)."""
    if not isinstance(model, Transformer):
        raise ValueError(f"save: model: expected a kdtree Transformer, got {type(model).__name__} (a "
                         "drafter: save_drafter)")
    dtype = _dtype_arg("save", dtype, allow_none=True)
    released = [i for i, layer in enumerate(model.model.layers)
                if getattr(getattr(layer.mlp, "experts", None), "released", False)]
    if released:
        raise ValueError(f"save: layer {released[0]}'s INT4 experts keep only the kernel-format copy "
                         "(Int4Experts.keep_kernel_only): there are no release-format weights to write")
    d = _writable("save", path, "target")
    sd = {}
    for k, v in model.state_dict().items():
        if ".mlp.experts.w" in k:
            continue
        sd[k] = (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu() \
            .contiguous()
    quantized = False
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts if isinstance(layer.mlp, MoE) else None
        if not isinstance(ex, Int4Experts):
            continue
        quantized = True
        I, D = ex.w13_packed.shape[1] // 2, ex.w13_packed.shape[2] * 8
        for j in range(ex.w13_packed.shape[0]):
            pre = f"model.layers.{i}.mlp.experts.{j}"
            p13, s13 = ex.w13_packed[j].cpu(), ex.w13_scale[j].cpu()
            for n, rows in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
                sd.update(quant.Int4Weight(p13[rows].contiguous(), s13[rows].contiguous(), (I, D)).state_dict(
                    f"{pre}.{n}_proj"))
            sd.update(quant.Int4Weight(ex.w2_packed[j].cpu(), ex.w2_scale[j].cpu(), (D, I)).state_dict(
                f"{pre}.down_proj"))
    cfg = model.args.to_hf_config()
    if quantized:
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                          "num_bits": 4, "type": "int", "symmetric": True,
                                          "strategy": "group", "group_size": quant.GROUP}}}}
    _commit(d, {"model.safetensors": lambda p: save_file(sd, str(p), metadata={"format": "pt"}),
                "config.json": lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n")})
    return d


def save_drafter(drafter, path: str | os.PathLike, dtype=None) -> Path:
    """A DFlash drafter as config.json (DFlashDraftModel keys) + model.safetensors (its own weights: the
    embedding and lm_head are the target's and are not written). A calibration table already in the folder
    is removed: it was measured on other weights (python -m kdtree.bench.calibrate measures it again). Refuses
    (before writing) a folder that holds a target checkpoint or stray shards (`_writable`); the files are
    written beside it and moved in whole."""
    from .calibration import FILE
    from .drafter import DFlashDrafter
    if not isinstance(drafter, DFlashDrafter):
        raise ValueError(f"save_drafter: drafter: expected a DFlashDrafter, got {type(drafter).__name__} (a "
                         "target: save)")
    dtype = _dtype_arg("save_drafter", dtype, allow_none=True)
    d = _writable("save_drafter", path, "drafter")
    sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
          for k, v in drafter.state_dict().items()}
    cfg = drafter.args.to_hf_config()
    _commit(d, {"model.safetensors": lambda p: save_file(sd, str(p), metadata={"format": "pt"}),
                "config.json": lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n")})
    (d / FILE).unlink(missing_ok=True)
    return d


def load_drafter(path: str | os.PathLike, target: Transformer, dtype=torch.float32,
                 allow_nonfinite: bool = False):
    """The drafter saved by save_drafter, attached to `target` (checked like load: names, shapes, dtypes,
    finite values; the arguments before any tensor is read, dtype as load takes it); `drafter.calibration`
    is the folder's calibration table (kdtree.calibration) or None."""
    from .drafter import DFlashDrafter, DrafterArgs
    d = _path_arg("load_drafter", path)
    if not isinstance(target, Transformer):
        raise ValueError(f"load_drafter: target: expected the kdtree Transformer the drafter serves, got "
                         f"{type(target).__name__}")
    dtype = _dtype_arg("load_drafter", dtype)
    allow_nonfinite = checks.flag("allow_nonfinite", allow_nonfinite)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"load_drafter: no config.json in {d}")
    try:
        args = DrafterArgs.from_hf_config(_read_json(d / "config.json", "config.json"))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"load_drafter: {d / 'config.json'}: {e}") from None
    found = read_state_dict(d)
    drafter = DFlashDrafter(args)
    expected = {k: v.shape for k, v in drafter.state_dict().items()}
    check_state_dict(expected, found, ModelArgs(), where=f"drafter checkpoint {d}")
    check_values(drafter.state_dict(), found, allow_nonfinite, where=f"drafter checkpoint {d}")
    drafter.load_state_dict({k: found[k] for k in expected}, strict=True)
    from .calibration import Calibration
    try:  # the acceptance calibration measured on held-out data (kdtree.calibration), when stored
        drafter.calibration = Calibration.load(d)
    except ValueError as e:
        raise CheckpointError(f"load_drafter: {e}") from None
    return drafter.to(device=target.device, dtype=dtype).eval().attach(target)
