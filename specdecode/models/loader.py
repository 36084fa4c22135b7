"""load_model(spec) -> LoadedModel: an alias, a local Hugging Face directory, or a hub id.

Contract:
* `spec` is resolved in this order: an alias of `specdecode.assets.MODELS` (installed on first
  use by `ensure_model`), an existing local directory (config.json + safetensors, sharded or
  not, or pytorch_model.bin), a path-like string that does not exist (SpecDecodeError listing
  the aliases), else a hub id handed to huggingface_hub (which finds it in the local HF cache or
  downloads it); failure is a SpecDecodeError that lists the aliases.
* llama / qwen2 / qwen3 / mistral checkpoints become a `NativeDecoder` with weights read
  straight from the safetensors files; every other causal LM is wrapped in `HFAdapter`.
* `dtype`: `auto` (the default) runs a native model's products in the formats measured fastest
  on this machine (models/formats.py, cached per machine; bf16 on CUDA); `bf16` / `fp32` force
  one format; `int8` / `int4` quantize the weights (weight-only: another, smaller model).
  A non-native model runs in fp32 on CPU and bf16 on CUDA under `auto`.
* `kv_cache_dtype`: `auto` (the default) keeps keys and values in the activations' dtype;
  `bf16` / `fp32` set it (native models only), e.g. a bf16 cache under fp32 activations: half
  the cache memory and bandwidth, keys and values rounded once as they are written.
* `LoadedModel.vocab_size` is the tokenizer's size (what sampling may emit); the model's head
  may have more rows (`model.info.vocab_size`). `eos_token_ids` merges the tokenizer's,
  config's and generation config's end-of-sequence ids.
* A model on the CPU sets the process's malloc to keep freed buffers (`host_memory`).
* Fingerprints: `tokenizer_fingerprint` hashes the sorted vocabulary and the special tokens;
  `model_fingerprint(config, tokenizer)` adds the architecture fields, so a trained drafter
  can check that it is paired with the target it was trained for.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from specdecode import assets
from specdecode.errors import SpecDecodeError
from specdecode.models import formats
from specdecode.models.hf_adapter import HFAdapter
from specdecode.models.host_memory import keep_freed_memory
from specdecode.models.native import NativeDecoder
from specdecode.models.native_spec import NATIVE_MODEL_TYPES

NATIVE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
FORMATS = ("auto", "int8", "int4")  # dtype values that pick weight formats (NativeDecoder only)
DTYPE_CHOICES = ("auto", "bf16", "fp32", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "bf16", "fp32")  # auto: the activations' dtype
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_ARCH_FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


@dataclass
class LoadedModel:
    """A ready model: the `CausalLM`, its tokenizer and identity."""

    model: object  # CausalLM: NativeDecoder or HFAdapter
    tokenizer: object  # transformers tokenizer
    path: Path  # the Hugging Face directory the weights came from
    name: str  # the alias, hub id or directory as given
    fingerprint: str  # model_fingerprint(config, tokenizer)
    vocab_size: int  # tokenizer size: ids >= this are never sampled
    eos_token_ids: tuple[int, ...] = ()
    config: object = None  # transformers config
    tokenizer_fingerprint: str = ""
    extra: dict = field(default_factory=dict)


# ---- public API ---------------------------------------------------------------------------------
def load_model(
    spec: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: str | None = None,
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    """Load `spec` (alias, local HF directory or hub id) as a `LoadedModel` (see module docstring)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SpecDecodeError(
            f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of: {', '.join(KV_CACHE_DTYPES)}"
        )
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        keep_freed_memory()  # per-step buffers stay in the heap (models/host_memory.py)
    fmt = dtype if isinstance(dtype, str) and dtype in FORMATS else None
    if fmt == "auto" and dev.type != "cpu":
        fmt, dtype = None, "bf16"
    torch_dtype = torch.float32 if fmt else resolve_dtype(dtype)
    name = str(spec)
    path = resolve_path(name)
    from transformers import AutoConfig  # deferred: importing transformers takes seconds

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise SpecDecodeError(
            f"{path} is not a Hugging Face model directory ({e}); it needs a config.json"
        ) from e
    tokenizer = load_tokenizer(path)
    archs = tuple(getattr(config, "architectures", None) or ())
    if any(a in NATIVE_ARCHITECTURES for a in archs) or (
        not archs and config.model_type in NATIVE_MODEL_TYPES
    ):
        model = NativeDecoder.from_hf(config, open_checkpoint(path), torch_dtype, dev)
        if fmt:
            model.use_formats(_plan(fmt, model), keep_masters=fmt != "auto")
        if kv_cache_dtype != "auto":
            model.kv_dtype = DTYPES[kv_cache_dtype]
    else:
        if kv_cache_dtype != "auto":
            raise SpecDecodeError(
                f"--kv-cache-dtype {kv_cache_dtype} sets the native runtime's cache; {path} is a "
                f"{config.model_type} model, which runs through transformers: use --kv-cache-dtype auto"
            )
        if fmt in ("int8", "int4"):
            raise SpecDecodeError(
                f"--dtype {fmt} quantizes the native runtime's weights; {path} is a {config.model_type} "
                "model, which runs through transformers: use --dtype auto, fp32 or bf16"
            )
        model = _load_hf(path, config, torch_dtype, dev)
    tok_fp = tokenizer_fingerprint(tokenizer)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        name=name,
        fingerprint=_model_fingerprint(config, tok_fp),
        vocab_size=min(len(tokenizer), model.info.vocab_size),
        eos_token_ids=eos_token_ids(path, config, tokenizer),
        config=config,
        tokenizer_fingerprint=tok_fp,
    )


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPE_CHOICES)}, fp16")
    return DTYPES[dtype]


def _plan(fmt: str, model):
    """The weight-format plan for `--dtype fmt` on a NativeDecoder (measured for `auto`, and
    among the quantized format's kernels for `int8` / `int4`)."""
    if fmt not in FORMATS:
        return formats.forced_plan(fmt, model.info.device)
    s = model.spec
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    shapes = [
        (qkv, s.hidden_size),
        (s.hidden_size, s.num_heads * s.head_dim),
        (2 * s.intermediate_size, s.hidden_size),
        (s.hidden_size, s.intermediate_size),
    ]
    head = tuple(model.lm_head_weight().shape)
    args = (shapes, head, s.num_layers, model.info.device)
    if fmt == "auto":
        plan, model.format_record = formats.auto_plan(*args)
    else:
        plan, model.format_record = formats.quantized_plan(fmt, *args)
    return plan


def resolve_path(spec: str) -> Path:
    """Alias -> installed directory; local directory as is; hub id -> snapshot directory."""
    aliases = _aliases()
    if not spec.strip():
        raise SpecDecodeError(f"no model given; {_alias_hint(aliases)}")
    if aliases is not None and spec in aliases:
        return Path(assets.ensure_model(spec))
    local = Path(spec).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise SpecDecodeError(f"{local} is not a Hugging Face model directory: it has no config.json")
        return local
    if not _HUB_ID.match(spec) or spec.startswith((".", "~")):
        raise SpecDecodeError(f"model path {spec!r} does not exist; {_alias_hint(aliases)}")
    try:
        from huggingface_hub import snapshot_download  # deferred: only for hub ids

        patterns = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
        return Path(snapshot_download(repo_id=spec, allow_patterns=patterns))
    except Exception as e:
        raise SpecDecodeError(
            f"model {spec!r} could not be found locally or on the Hugging Face hub "
            f"({type(e).__name__}); {_alias_hint(aliases)}, or pass a local model directory"
        ) from None


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise SpecDecodeError(
            f"could not load a tokenizer from {path} ({e}); the directory needs its tokenizer files"
        ) from e


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the sorted vocabulary (token, id) and the special tokens."""
    h = hashlib.sha256()
    for tok, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{idx}\t{tok}\n".encode())
    specials = {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
    h.update(json.dumps(specials, sort_keys=True).encode())
    return h.hexdigest()


def same_tokenizer(a, b) -> bool:
    """True when two tokenizers map the same strings to the same ids (same fingerprint)."""
    return a is b or tokenizer_fingerprint(a) == tokenizer_fingerprint(b)


def model_fingerprint(config, tokenizer) -> str:
    """sha256 over the architecture fields of `config` and the tokenizer fingerprint."""
    return _model_fingerprint(config, tokenizer_fingerprint(tokenizer))


def _model_fingerprint(config, tok_fp: str) -> str:
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    arch = {k: cfg.get(k) for k in _ARCH_FIELDS}
    blob = json.dumps(arch, sort_keys=True, default=str) + tok_fp
    return hashlib.sha256(blob.encode()).hexdigest()


def eos_token_ids(path: Path, config, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids from the tokenizer, the config and generation_config.json."""
    ids: list[int] = []

    def add(v) -> None:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and x >= 0 and x not in ids:
                ids.append(x)

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(config, "eos_token_id", None))
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError):
            pass
    return tuple(ids)


# ---- internals ----------------------------------------------------------------------------------
def _aliases() -> list[str] | None:
    """Alias names of the embedded models (specdecode.assets)."""
    return [str(getattr(m, "alias", m)) for m in assets.MODELS]


def _alias_hint(aliases: list[str] | None) -> str:
    if not aliases:
        return "give a local Hugging Face model directory"
    return "known aliases: " + ", ".join(aliases)


class _Tensors(Mapping):
    """Lazy name -> tensor view of a checkpoint's safetensors files (read on access)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._handles = {f: safe_open(str(f), framework="pt", device="cpu") for f in set(files.values())}
        self._where = files

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def open_checkpoint(p: Path) -> Mapping[str, torch.Tensor]:
    """A directory's weights as a name -> tensor mapping (safetensors read lazily; .bin mmapped)."""
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return _Tensors({k: p / v for k, v in weight_map.items()})
    files = sorted(p.glob("*.safetensors"))
    if files:
        where = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                where.update(dict.fromkeys(h.keys(), f))
        return _Tensors(where)
    bins = sorted(p.glob("pytorch_model*.bin"))
    if bins:
        state: dict[str, torch.Tensor] = {}
        for f in bins:
            state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        return state
    raise SpecDecodeError(f"{p} has no weights (model.safetensors, sharded safetensors or pytorch_model.bin)")


def _load_hf(path: Path, config, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM  # deferred: importing transformers takes seconds

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as e:
        raise SpecDecodeError(f"transformers could not load {path} as a causal LM: {e}") from e
    return HFAdapter(model.to(device))
