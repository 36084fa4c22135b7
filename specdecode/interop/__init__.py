"""Interop: drafters that vLLM and SGLang can serve, and drafters from elsewhere that specdecode uses.

Contract (docs/interop.md has the formats, the conventions and what refuses why):
- `export_drafter(checkpoint_dir, out_dir, fmt="speculators", verifier_name_or_path=None,
  target=None, num_speculative_tokens=None) -> Path` reads one of OUR checkpoints
  (drafters/checkpoint.py) and writes `fmt`: "speculators" (vLLM; speculators.py) or
  "specforge" (SGLang; specforge.py). EAGLE-3 exports to both; DFlash and DSpark trained with
  `qk_norm` and `mask_token_id` export to speculators (dflash_family.py); other DFlash-family
  checkpoints are refused naming the missing option. No target is loaded: `target` (a
  LoadedModel) is optional and only adds the verifier's facts and, for speculators, the embedding
  (EAGLE-3) or the head rows (DFlash family) to the output. "specdecode" writes our own layout
  again with `storage` ("bf16" or "int8", drafters/checkpoint.py): the format drafters ship in.
- `detect_layout(path) -> str | None`: "specdecode", "speculators", "zlab-dflash",
  "specforge-eagle3" or None, from the directory's config.json alone.
- `import_drafter(path, target) -> (method, arch, state)`: our method name ("eagle", "dflash" or
  "dspark" for foreign layouts: speculators eagle3 / dflash / dspark, SpecForge EAGLE-3, z-lab
  DFlash), our config.json
  "arch" and our state dict, ready for the method's builder (`load_net`); a drafter for another
  target (width, vocabulary, layers, fingerprint when recorded) or an unknown layout is refused
  with `SpecDecodeError` saying why.
- `write_native(path, target, out_dir) -> Path`: the imported drafter saved as one of our
  checkpoints (weights in their own dtype), usable as `--drafter out_dir`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.drafters.checkpoint import (
    float_dtype,
    load_checkpoint,
    read_config,
    read_weights,
    save_checkpoint,
    write_checkpoint,
)
from specdecode.errors import SpecDecodeError
from specdecode.interop import common, specforge, speculators, zlab
from specdecode.interop.common import read_json, verifier_facts

__all__ = ["FORMATS", "detect_layout", "export_drafter", "import_drafter", "write_native"]

FORMATS = ("speculators", "specforge", "specdecode")  # export formats


def detect_layout(path) -> str | None:
    p = Path(path)
    try:
        cfg = read_json(p / "config.json")
    except SpecDecodeError:
        return None
    if cfg.get("format") == 1 and "method" in cfg and "arch" in cfg:
        return "specdecode"
    if "speculators_model_type" in cfg:
        return "speculators"
    if zlab.is_zlab(cfg):
        return "zlab-dflash"
    if specforge.is_specforge(cfg):
        return "specforge-eagle3"
    return None


def export_drafter(
    checkpoint_dir,
    out_dir,
    fmt: str = "speculators",
    verifier_name_or_path: str | None = None,
    target=None,  # LoadedModel, optional
    num_speculative_tokens: int | None = None,
    storage: str = "bf16",
) -> Path:
    if fmt not in FORMATS:
        raise SpecDecodeError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    src = Path(checkpoint_dir)
    cfg = read_config(src)
    if target is not None and cfg["target"].get("fingerprint") != target.fingerprint:
        raise SpecDecodeError(f"{src} was trained for {cfg['target'].get('name')!r}, not for {target.name!r}")

    if storage != "bf16" and fmt != "specdecode":
        raise SpecDecodeError(
            f"--storage {storage} is for --format specdecode; vLLM and SGLang read float weights"
        )
    state = read_weights(src)
    out = Path(out_dir)
    if out.resolve() == src.resolve():
        raise SpecDecodeError("the export directory must differ from the checkpoint directory")
    if fmt == "specdecode":
        return write_checkpoint(out, cfg, state, float_dtype(state, torch.bfloat16), storage)
    if fmt == "speculators":
        return speculators.export(cfg, state, out, verifier_name_or_path, target, num_speculative_tokens)
    facts = None
    if target is not None:
        facts = verifier_facts(None, target)
    return specforge.export(cfg, state, out, (facts or {}).get("max_position_embeddings", 4096))


def import_drafter(path, target) -> tuple[str, dict, dict[str, torch.Tensor]]:
    p = Path(path)
    layout = detect_layout(p)
    if layout is None:
        if not (p / "config.json").is_file():
            raise SpecDecodeError(f"{p} has no config.json: not a drafter directory")
        raise SpecDecodeError(
            f"{p} is not a drafter layout specdecode reads: expected a specdecode checkpoint, a "
            "speculators directory (`speculators_model_type`), a z-lab DFlash checkpoint "
            "(`DFlashDraftModel` + `dflash_config`) or a SpecForge EAGLE-3 (`LlamaForCausalLMEagle3`)"
        )
    if layout == "specdecode":
        method = read_config(p)["method"]
        arch, state = load_checkpoint(p, method, target)
        return method, arch, state
    cfg, state = read_json(p / "config.json"), common.read_weights(p)
    module = {"speculators": speculators, "zlab-dflash": zlab, "specforge-eagle3": specforge}[layout]
    return module.import_(p, cfg, state, target)


def write_native(path, target, out_dir) -> Path:
    method, arch, state = import_drafter(path, target)
    training = {"imported_from": {"path": str(Path(path).resolve()), "layout": detect_layout(path)}}
    dtype = float_dtype(state, torch.bfloat16)
    return save_checkpoint(out_dir, method, arch, state, target, training=training, dtype=dtype)
