"""Block verification against token-wise rejection on the drafters' own proposals (sampled chains).

The real speculative loop (fixed K, `--verify-mode rejection`, held-out chat and code prompts,
chat template) runs each drafter at the given temperature; at every verify step, for each
request's sampled chain, the exact expected number of kept drafts over the uniforms is computed
under both rules on the same drafts and target distributions:
- token-wise rejection: sum_k prod_{j<=k} min(1, p_j(x_j) / q_j(x_j));
- block verification (`verify_rules.verify_chain_block`): with its stop probabilities h_i
  (h_n = w_n) drawn independently, P(A >= i) = 1 - prod_{j>=i} (1 - h_j), E[A] = sum_i P(A >= i).
A paired comparison, free of sampling noise in the verdicts (the proposals are those a
token-wise loop sees). Timing plays no part.

Usage: python benchmarks/block_verify.py --target smollm2-135m --drafters dspark:7,eagle:4 \
           --sources chat,code --num-prompts 24 --temperature 1 --out benchmarks/results/block-verify
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_train import cpu_kind  # benchmarks/ is the script's directory
from served_tau import parse_drafter, prompts_of

import specdecode.step as step_mod
from specdecode.config import SamplingParams
from specdecode.decode import SpeculativeDecoder
from specdecode.drafters import build_drafter
from specdecode.models.loader import load_model
from specdecode.policy.fixed import FixedK
from specdecode.request import GenerationRequest
from specdecode.sampling import process_logits_batch


def expected_kept(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(token-wise, block) expected kept drafts of one chain: p [n+1, V], q [n, V], x [n]."""
    n = x.shape[0]
    rows = torch.arange(n)
    px, qx = p[rows, x], q[rows, x]  # [n]
    ratio = torch.where(qx > 0, px / qx.clamp_min(1e-300), (px > 0).double() * 1e300)
    token = float(torch.cumprod(ratio.clamp(max=1.0), 0).sum())
    w = [1.0]
    for i in range(n):
        w.append(min(1.0, w[-1] * float(ratio[i])))
    h = []
    for i in range(1, n):
        s = float((w[i] * p[i] - q[i]).clamp_min(0).sum())
        h.append(s / (s + 1 - w[i]) if s > 0 else 0.0)
    h.append(w[n])
    block, none_after = 0.0, 1.0  # P(no stop at j >= i), built from the last draft down
    for i in range(n, 0, -1):
        none_after *= 1 - h[i - 1]
        block += 1 - none_after
    return token, block


class Tally:
    """Wraps the loop's verify_step: adds both expectations for every sampled chain it verifies."""

    def __init__(self):
        self.token = self.block = 0.0
        self.chains = 0
        self.real = step_mod.verify_step

    def __call__(self, proposal, logits, params, streams, positions, vocab_size, mode="rejection"):
        if proposal.parents is None and proposal.draft_probs is not None:
            p = process_logits_batch(logits, list(params), vocab_size).double()  # [B, K+1, V]
            q = proposal.dense_probs(logits.shape[-1]).double()  # [B, K, V]
            for b, n in enumerate(proposal.num_draft.tolist()):
                if n > 0:
                    t, bl = expected_kept(p[b, : n + 1], q[b, :n], proposal.draft_ids[b, :n].cpu())
                    self.token, self.block, self.chains = self.token + t, self.block + bl, self.chains + 1
        return self.real(proposal, logits, params, streams, positions, vocab_size, mode)


def measure(target, drafter, prompts, k: int, max_new: int, temperature: float) -> dict:
    tally = Tally()
    step_mod.verify_step = tally
    try:
        dec = SpeculativeDecoder(target, drafter, FixedK(k), max_batch=8, verify_mode="rejection")
        params = SamplingParams(temperature=temperature)
        dec.generate(
            [
                GenerationRequest(prompt_ids=p, params=params, max_new_tokens=max_new, seed=i, id=str(i))
                for i, p in enumerate(prompts)
            ]
        )
    finally:
        step_mod.verify_step = tally.real
    n = max(tally.chains, 1)
    kept = {"token_wise": round(tally.token / n, 4), "block": round(tally.block / n, 4)}
    return {"chains": tally.chains, **kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafters", default="dspark:7,eagle:4")
    ap.add_argument("--sources", default="chat,code")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", required=True, help="OUT.md and OUT.json")
    a = ap.parse_args()
    target = load_model(a.target)
    sources = {s: prompts_of(s, target, a.num_prompts, None) for s in a.sources.split(",")}
    cmd = "python benchmarks/block_verify.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"
    )
    rows = []
    for spec in a.drafters.split(","):
        method, k, ckpt = parse_drafter(spec)
        drafter = build_drafter(method, target, ckpt)
        for source, prompts in sources.items():
            r = measure(target, drafter, prompts, k, a.max_new_tokens, a.temperature)
            rows.append({"method": method, "k": k, "source": source, **r})
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"# Block verification vs token-wise rejection on the drafters' proposals: {a.target}",
        "",
        f"Machine: {cpu_kind()}. T = {a.temperature:g}, fixed K, {a.max_new_tokens} new tokens, the first "
        f"{a.num_prompts} prompts of each source (chat: MT-Bench, code: HumanEval), chat template. "
        "Expected kept drafts per sampled chain, exact over the uniforms, on the same proposals "
        "(those of a token-wise loop); tau = 1 + kept.",
        "",
        f"Command: `{cmd}`",
        "",
        "| drafter | K | source | chains | kept, token-wise | kept, block | block / token-wise | tau ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, b = r["token_wise"], r["block"]
        lines.append(
            f"| {r['method']} | {r['k']} | {r['source']} | {r['chains']} | {t:.3f} | {b:.3f} "
            f"| {b / t if t else float('nan'):.3f} | {(1 + b) / (1 + t):.3f} |"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
