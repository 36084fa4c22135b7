"""Step-cost profile of the native runtime on a device, with random weights of real shapes.

No checkpoint has to travel: the weights are random, the shapes are SmolLM2-135M's and a 7B
llama's. For each shape and dtype it prints T(N) (median ms of one forward of N new tokens over a
256-token cache, batch 1 and batch 8) and T(8)/T(1), the price of verifying 7 drafts, and writes
`<out>/device-profile.json` and `.md`. Used by scripts/device_check.sh on a lent GPU.

    python benchmarks/bench_device_profile.py --device cuda --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from specdecode.models.native import NativeDecoder

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
}  # fmt: skip
BLOCKS = (1, 2, 4, 8, 16)


def random_model(shape: dict, dtype: torch.dtype, device: str) -> NativeDecoder:
    cfg = LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5)
    d, inter, H, Hk = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    D = d // H
    g = torch.Generator(device=device).manual_seed(0)

    def w(*s):  # drawn on the device: 7B values drawn on one CPU thread outlast a device call
        return (torch.randn(*s, generator=g, device=device) * 0.02).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    t = {"model.embed_tokens.weight": w(cfg.vocab_size, d), "model.norm.weight": ones(d)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = w(cfg.vocab_size, d)
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        t.update({a + "q_proj.weight": w(H * D, d), a + "k_proj.weight": w(Hk * D, d),
                  a + "v_proj.weight": w(Hk * D, d), a + "o_proj.weight": w(d, H * D),
                  m + "gate_proj.weight": w(inter, d), m + "up_proj.weight": w(inter, d),
                  m + "down_proj.weight": w(d, inter),
                  f"model.layers.{i}.input_layernorm.weight": ones(d),
                  f"model.layers.{i}.post_attention_layernorm.weight": ones(d),
                  })  # fmt: skip
    return NativeDecoder.from_hf(cfg, t, dtype, device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def profile(model, device: str, batch: int, repeats: int = 20) -> dict[int, float]:
    ctx = 256
    cache = model.new_cache(batch, ctx + max(BLOCKS) + 2)
    ids = torch.randint(0, 1000, (batch, ctx + max(BLOCKS)), device=device)
    model.forward(ids[:, :ctx], None, cache, list(range(batch)), logits=False)
    for s in range(batch):
        cache.commit(s, ctx)
    out = {}
    for n in BLOCKS:
        x = ids[:, ctx : ctx + n]
        times = []
        for r in range(repeats + 3):
            _sync(device)
            t0 = time.perf_counter()
            model.forward(x, None, cache, list(range(batch)))
            _sync(device)
            if r >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        out[n] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="smollm2-135m,llama-7b")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    rows = []
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    for shape in a.shapes.split(","):
        for dt in a.dtypes.split(","):
            model = random_model(SHAPES[shape], dtypes[dt], a.device)
            for batch in (1, 8):
                t = profile(model, a.device, batch)
                rows.append({"shape": shape, "dtype": dt, "batch": batch, "ms": t, "t8_over_t1": t[8] / t[1]})
                print(rows[-1], flush=True)
                write(Path(a.out), name, rows)  # after every row: a call cut short keeps what it measured
            del model
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()


def write(out: Path, name: str, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "device-profile.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    lines = [f"# Native runtime step costs on {name} (random weights, 256-token cache)", "",
             "| shape | dtype | batch | " + " | ".join(f"T({n}) ms" for n in BLOCKS) + " | T(8)/T(1) |",
             "|---|---|---|" + "---|" * (len(BLOCKS) + 1)]  # fmt: skip
    for r in rows:
        ms = " | ".join(f"{r['ms'][n]:.2f}" for n in BLOCKS)
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['batch']} | {ms} | {r['t8_over_t1']:.2f} |")
    (out / "device-profile.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
