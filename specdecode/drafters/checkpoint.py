"""Drafter checkpoints: a directory with `config.json` and `model.safetensors`.

Contract:
- `save_checkpoint(out_dir, method, arch, state_dict, target, training=None, dtype=bf16,
  storage="bf16")` writes config.json = {"format": 1, "method", "arch": {architecture fields},
  "target": {"name", "fingerprint", "hidden_size", "num_layers", "vocab_size"}, "training": {...},
  "storage"} and the weights (temp files, then rename, config.json last), so a killed save never
  leaves a loadable half. `write_checkpoint(out_dir, cfg, state_dict, dtype, storage)` is the same
  write for a config already made (re-storing a checkpoint: `specdecode export --format specdecode`).
- Storage: "bf16" keeps every floating tensor in `dtype`; "int8" stores each floating matrix of at
  least `INT8_MIN_NUMEL` elements as int8 rows with one fp32 scale per row (`name` + `SCALE`,
  symmetric: scale = max|row| / 127), about half of bf16's bytes; the rest stays in `dtype`. A
  drafter only proposes tokens, so its storage never touches losslessness, only its acceptance.
- `read_weights(dir, int8_as=None)` -> the state dict with int8 matrices dequantized (into
  `int8_as`, by default the file's float format): what every reader of the weights uses, except
  code that rewrites the stored file as it is (calibration).
  `float_dtype(state, default)` -> the format of a state dict's floating tensors (scales aside).
- `load_checkpoint(path, method, target, int8_as=None)` -> (arch dict, state dict). It refuses,
  with the reason and what to do: a missing directory or file, another method's checkpoint, and
  a checkpoint trained for another target (fingerprint = target config + tokenizer hash).
- `load_net(path, method, target, build, defaults)` -> the checkpoint's network built by
  `build(arch)`, weights loaded (`defaults(net)` fills tensors older checkpoints lack), moved to the
  target's device in `drafter_dtype(target)`, in eval mode, its linear layers running in the
  target's measured formats on CPU (`layers.use_formats`; inference only), and an int8-stored
  checkpoint's in its own int8 weights where `int8w` is measured faster (`formats.
  int8_drafter_plan`; its matrices load as fp32 q * scale, which re-quantize to the stored
  integers; a bf16 drafter's rounded ones may move a few by one): what every learned drafter's
  loader starts with. The plan is kept as `net.formats_plan`; `in_target_formats()` (a context)
  loads them in the target's plan instead. Products of the target's own weights that a drafter
  reads (the DSpark/DFlash and MTP heads' rows) follow the target's plan, never this one.
- `shipped_drafter(method, target)` -> the directory of the drafter shipped with the package for
  that target and method, or None; `checkpoint_path(kind, target, spec)` -> `spec` or that
  shipped directory, refusing with what to do when there is neither.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specdecode.drafters.layers import cpu_plan, use_formats
from specdecode.errors import SpecDecodeError
from specdecode.models.formats import BUCKETS, int8_drafter_plan, int8_quantize

FORMAT = 1
CONFIG, WEIGHTS = "config.json", "model.safetensors"
STORAGES = ("bf16", "int8")
INT8_MIN_NUMEL = 1 << 16  # smaller tensors (norms, biases, calibration) keep the float format
SCALE = ".int8_scale"
SHIPPED_ROOT = Path(__file__).resolve().parent.parent / "data" / "drafters"


def _target_meta(target) -> dict:
    info = target.model.info
    return {
        "name": target.name,
        "fingerprint": target.fingerprint,
        "hidden_size": info.hidden_size,
        "num_layers": info.num_layers,
        "vocab_size": info.vocab_size,
    }


quantize_int8 = int8_quantize  # w [R, C] -> (q int8 [R, C], scale fp32 [R]): the int8 storage


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]  # [R, C] fp32


def _stored(state: dict[str, torch.Tensor], dtype: torch.dtype, storage: str) -> dict[str, torch.Tensor]:
    if storage not in STORAGES:
        raise SpecDecodeError(f"unknown weight storage {storage!r}; choose one of {', '.join(STORAGES)}")
    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        if not v.is_floating_point():
            out[k] = v.contiguous()
        elif storage == "int8" and v.dim() == 2 and v.numel() >= INT8_MIN_NUMEL:
            out[k], out[k + SCALE] = quantize_int8(v)
        else:
            out[k] = v.to(dtype).contiguous()
    return out


def float_dtype(state: dict[str, torch.Tensor], default: torch.dtype) -> torch.dtype:
    """The dtype of the first floating tensor of `state` (int8 scales aside), else `default`."""
    floats = (v.dtype for k, v in state.items() if v.is_floating_point() and not k.endswith(SCALE))
    return next(floats, default)


def unpack_weights(
    stored: dict[str, torch.Tensor], int8_as: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """A stored state dict with its int8 matrices dequantized into `int8_as`, by default the format
    of the file's other floating tensors (fp32 when there are none); other tensors as stored."""
    dtype = int8_as or float_dtype(stored, torch.float32)
    return {
        k: dequantize_int8(v, stored[k + SCALE]).to(dtype) if k + SCALE in stored else v
        for k, v in stored.items()
        if not k.endswith(SCALE)
    }


def read_weights(path: str | Path, int8_as: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        raise SpecDecodeError(f"{path} has no {WEIGHTS}")
    return unpack_weights(load_file(str(weights)), int8_as)


def write_checkpoint(
    out_dir: str | Path,
    cfg: dict,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    storage: str = "bf16",
) -> Path:
    out = Path(out_dir)
    tensors = _stored(state_dict, dtype, storage)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "storage": storage}
    (out / CONFIG).unlink(missing_ok=True)  # loadable only once both files are complete
    save_file(tensors, str(out / (WEIGHTS + ".tmp")))
    os.replace(out / (WEIGHTS + ".tmp"), out / WEIGHTS)
    (out / (CONFIG + ".tmp")).write_text(json.dumps(cfg, indent=2))
    os.replace(out / (CONFIG + ".tmp"), out / CONFIG)
    return out


def save_checkpoint(
    out_dir: str | Path,
    method: str,
    arch: dict,
    state_dict: dict[str, torch.Tensor],
    target,  # LoadedModel
    training: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    storage: str = "bf16",
) -> Path:
    cfg = {
        "format": FORMAT,
        "method": method,
        "arch": arch,
        "target": _target_meta(target),
        "training": training or {},
    }
    return write_checkpoint(out_dir, cfg, state_dict, dtype, storage)


def is_checkpoint(path) -> bool:
    """True when `path` is a specdecode drafter checkpoint directory (not a model directory)."""
    p = Path(path)
    if not (p / CONFIG).is_file():
        return False
    try:
        cfg = json.loads((p / CONFIG).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(cfg, dict) and cfg.get("format") == FORMAT and "method" in cfg


def read_config(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_dir():
        raise SpecDecodeError(
            f"drafter checkpoint {str(p)!r} is not a directory; give the directory "
            f"written by `specdecode train` (it holds {CONFIG} and {WEIGHTS})"
        )
    if not (p / CONFIG).is_file():
        raise SpecDecodeError(f"{p} has no {CONFIG}: not a drafter checkpoint (or an interrupted save)")
    try:
        cfg = json.loads((p / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise SpecDecodeError(f"{p / CONFIG} is not valid JSON ({e.msg})") from None
    if cfg.get("format") != FORMAT or "method" not in cfg or "target" not in cfg:
        raise SpecDecodeError(f"{p / CONFIG} is not a specdecode drafter config (format {FORMAT})")
    return cfg


def check_target(cfg: dict, target, where: str) -> None:
    want = cfg["target"].get("fingerprint")
    if want != target.fingerprint:
        raise SpecDecodeError(
            f"drafter {where} was trained for target {cfg['target'].get('name')!r} "
            f"(fingerprint {want}), not for {target.name!r} (fingerprint {target.fingerprint}); "
            "a drafter only works with the target it was trained on: train one for this target "
            "with `specdecode train`"
        )


def load_checkpoint(
    path: str | Path, method: str, target, int8_as: torch.dtype | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = read_config(path)
    if cfg["method"] != method:
        raise SpecDecodeError(
            f"{path} holds a {cfg['method']!r} drafter, not {method!r}; use --method {cfg['method']}"
        )
    check_target(cfg, target, str(path))
    return cfg["arch"], read_weights(path, int8_as)


def shipped_drafter(method: str, target) -> Path | None:
    """The drafter shipped in the package for (method, target), matched by fingerprint."""
    if not SHIPPED_ROOT.is_dir():
        return None
    for d in sorted(SHIPPED_ROOT.iterdir()):
        if (d / CONFIG).is_file():
            cfg = json.loads((d / CONFIG).read_text())
            if cfg.get("method") == method and cfg["target"].get("fingerprint") == target.fingerprint:
                return d
    return None


def checkpoint_path(kind: str, target, spec) -> Path:
    """`--drafter DIR`, else the drafter shipped for (kind, target); refuses when neither exists."""
    path = spec or shipped_drafter(kind, target)
    if path is None:
        raise SpecDecodeError(
            f"no {kind} drafter ships for target {target.name!r}; train one with "
            f"`specdecode train {kind} --target {target.name} --data DIR --out DIR` and pass --drafter DIR"
        )
    return Path(path)


def drafter_dtype(target) -> torch.dtype:
    """The format a drafter network runs in: on CPU, bf16 only where the target's formats (measured
    by `--dtype auto`, or forced) run products of a few rows in bf16, else fp32; drafters multiply
    blocks of rows (a draft block, a tree level), so the format that wins at 8 rows is theirs.
    Decided from the target's format plan, never from CPU flags. Elsewhere: the target's dtype."""
    info = target.model.info
    plan = getattr(target.model, "plan", None)
    if info.device.type != "cpu" or info.dtype != torch.bfloat16 or plan is None:
        return info.dtype
    return torch.bfloat16 if plan.kernels[BUCKETS.index(8)].startswith("bf16") else torch.float32


_OWN_INT8 = [True]  # load_net gives int8-stored drafters their own int8 plan (`in_target_formats`)


@contextlib.contextmanager
def in_target_formats():
    """Drafters loaded inside run in the target's formats, not their own int8 plan: the other side
    of the A/B benchmarks that measure that plan."""
    before, _OWN_INT8[0] = _OWN_INT8[0], False
    try:
        yield
    finally:
        _OWN_INT8[0] = before  # nested: the outer context's setting again


def load_net(path, method: str, target, build, defaults=None) -> torch.nn.Module:
    arch, state = load_checkpoint(path, method, target, int8_as=torch.float32)  # q * scale, unrounded
    net = build(arch)
    for k, v in (defaults(net) if defaults else {}).items():
        state.setdefault(k, v)
    net.load_state_dict(state)
    net = net.to(device=target.model.info.device, dtype=drafter_dtype(target)).eval()
    plan = cpu_plan(target)
    if plan is not None:
        if _OWN_INT8[0] and read_config(path).get("storage") == "int8":  # its own integers where they win
            linears = (m for m in net.modules() if isinstance(m, nn.Linear))
            shapes = list(dict.fromkeys(tuple(m.weight.shape) for m in linears))
            plan, _ = int8_drafter_plan(plan, shapes, target.model.info.device)
        use_formats(net, plan)  # the products in the formats measured fastest here
    return net
