"""Does the draft vocabulary limit tau? Coverage of the target's greedy answers, and re-indexing.

Every learned drafter predicts over a reduced draft vocabulary (`d2t`, picked from the training
data's most frequent response tokens when the drafter was first trained; warm starts keep it).
A target token outside it can never be drafted, so coverage caps the acceptance of every draft
position. This measures, on the target's own greedy answers to the benchmark's held-out prompts
(`--sources`, chat template, `--max-new-tokens`):
- the share of answer tokens each shipped drafter's vocabulary covers;
- the share the `--sizes` most frequent response tokens of `--data` would cover;
- with `--reindex METHOD,...`: the served tau (real speculative loop, fixed K, greedy and T = 1;
  `scaling_curve.served`) of each shipped drafter against the same weights re-indexed to the
  top-V vocabulary of `--data` for each size, with no training: a token in both keeps its
  trained rows, a new token starts from the target's LM-head row (EAGLE-3 / Medusa own a head:
  scaled to the trained rows' median norm) or, for DSpark's Markov table, from the row that
  stood for every token outside the vocabulary (W1) and zeros (W2). DFlash and DSpark read
  the target's head rows, so their re-indexed logits are the target head's own.
Writes OUT.md and OUT.json.

    python benchmarks/draft_vocab.py --target smollm2-135m --data DIR1,DIR2 \
        --reindex dflash,eagle --sizes 8192,16384 --out benchmarks/results/draft-vocab-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from bench_train import cpu_kind  # benchmarks/ is the script's directory
from scaling_curve import served

from specdecode.build import LoadOptions, build
from specdecode.config import SamplingParams
from specdecode.datasets import load_category
from specdecode.drafters import DEFAULT_NUM_DRAFT, build_drafter
from specdecode.drafters.checkpoint import read_config, read_weights, shipped_drafter, write_checkpoint
from specdecode.errors import SpecDecodeError
from specdecode.request import GenerationRequest
from specdecode.training.data import regen_dirs
from specdecode.training.regen import prompt_ids
from specdecode.training.vocab import vocabulary_of

METHODS = ("eagle", "dspark", "dflash", "mtp", "medusa")


def remap_rows(
    rows: torch.Tensor, old_d2t: torch.Tensor, new_d2t: torch.Tensor, fill: torch.Tensor
) -> torch.Tensor:
    """Rows indexed by draft id ([Vd_old (+1), ...]; a last extra row stands for every token
    outside the vocabulary and is kept last) re-indexed to `new_d2t`: a token in both keeps its
    row, a new one takes `fill`'s row ([Vd_new (+1), ...])."""
    extra = rows.shape[0] - len(old_d2t)
    if extra not in (0, 1) or fill.shape != (len(new_d2t) + extra, *rows.shape[1:]):
        raise SpecDecodeError(f"cannot re-index rows {tuple(rows.shape)} with fill {tuple(fill.shape)}")
    where = {t: i for i, t in enumerate(old_d2t.tolist())}
    out = fill.clone().to(rows.dtype)
    kept = [(i, where[t]) for i, t in enumerate(new_d2t.tolist()) if t in where]
    if kept:
        new_i, old_i = (torch.tensor(c) for c in zip(*kept, strict=True))
        out[new_i] = rows[old_i]
    if extra:
        out[-1] = rows[-1]
    return out


def reindexed(state: dict, new_d2t: torch.Tensor, target_head: torch.Tensor) -> dict:
    """A drafter's weights re-indexed to the draft vocabulary `new_d2t` (see the module text)."""
    st = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    old = st["d2t"].long()
    st["d2t"] = new_d2t
    if "head.weight" in st:  # a head of its own (EAGLE-3, Medusa): new rows from the target's
        w, shared = st["head.weight"], torch.isin(old, new_d2t)
        scale = (w[shared].norm(dim=1) / target_head[old[shared]].norm(dim=1)).median()
        st["head.weight"] = remap_rows(w, old, new_d2t, target_head[new_d2t] * scale)
    if "W1.weight" in st:  # DSpark's Markov head
        W1, W2 = st["W1.weight"], st["W2.weight"]
        st["W1.weight"] = remap_rows(W1, old, new_d2t, W1[-1].expand(len(new_d2t) + 1, -1))
        st["W2.weight"] = remap_rows(W2, old, new_d2t, torch.zeros(len(new_d2t), W2.shape[1]))
    return st


def response_counts(data: str) -> Counter:
    counts = Counter()
    for d in regen_dirs(data):
        for line in open(Path(d) / "train.jsonl"):
            r = json.loads(line)
            counts.update(t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m)
    return counts


def share(tokens: list[int], vocab) -> float:
    v = set(vocab.tolist() if torch.is_tensor(vocab) else vocab)
    return round(sum(t in v for t in tokens) / max(len(tokens), 1), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", required=True, help="regen directories (comma-separated)")
    ap.add_argument("--sources", default="chat,code")
    ap.add_argument("--num-prompts", type=int, default=24, help="per source, for coverage")
    ap.add_argument("--tau-prompts", type=int, default=12, help="per source, for served tau")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sizes", default="8192,16384,32768")
    ap.add_argument("--reindex", default="", help="methods to re-index and serve (e.g. dflash,eagle)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sd = build(LoadOptions(a.target, "ar"))
    target = sd.target
    sources = a.sources.split(",")
    prompts = {s: [prompt_ids(target, r) for r in load_category(s, a.num_prompts)] for s in sources}
    answers = {}
    for s in sources:
        reqs = [
            GenerationRequest(p, SamplingParams(), max_new_tokens=a.max_new_tokens, id=f"{s}{i}")
            for i, p in enumerate(prompts[s])
        ]
        answers[s] = [t for r in sd.decoder.generate(reqs) for t in r.token_ids]
    counts = response_counts(a.data)
    sizes = [int(x) for x in a.sizes.split(",")]
    tops = {v: vocabulary_of(counts, v, target.eos_token_ids, target.model.info.vocab_size)[0] for v in sizes}
    vocabs = [(f"shipped {m}", read_weights(p)["d2t"]) for m in METHODS if (p := shipped_drafter(m, target))]
    vocabs += [(f"top {v} of the data", d2t) for v, d2t in tops.items()]
    coverage = [{"vocabulary": name, **{s: share(answers[s], d2t) for s in sources}} for name, d2t in vocabs]
    head = target.model.lm_head_weight().detach().float().cpu()
    taus = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in [x for x in a.reindex.split(",") if x]:
            ship = shipped_drafter(m, target)
            cfg, state = read_config(ship), read_weights(ship)
            k = DEFAULT_NUM_DRAFT[m]
            variants = [("shipped", ship)]
            for v, d2t in tops.items():
                out = Path(tmp) / f"{m}-{v}"
                cfg_v = {key: val for key, val in cfg.items() if key != "storage"}
                cfg_v["arch"] = {**cfg["arch"], "draft_vocab_size": v}
                write_checkpoint(out, cfg_v, reindexed(state, d2t, head))
                variants.append((f"top {v}", out))
            for label, path in variants:
                drafter = build_drafter(m, target, str(path))
                for s in sources:
                    p = prompts[s][: a.tau_prompts]
                    row = {"method": m, "k": k, "vocabulary": label, "source": s}
                    row["greedy"] = served(target, drafter, p, k, a.max_new_tokens, 0.0)
                    row["t1"] = served(target, drafter, p, k, a.max_new_tokens, 1.0)
                    taus.append(row)
                    print(json.dumps(row), flush=True)
    meta = {
        "target": a.target,
        "machine": cpu_kind(),
        "data": a.data,
        "answer_tokens": {s: len(answers[s]) for s in sources},
        "command": "python benchmarks/draft_vocab.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v not in ("", None)),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"meta": meta, "coverage": coverage, "tau": taus}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    lines = [
        f"# Does the draft vocabulary limit tau? ({a.target}, benchmarks/draft_vocab.py)",
        "",
        f"Machine: {meta['machine']}. Greedy answers of the target to the first {a.num_prompts} "
        f"prompts of each source (chat template, {a.max_new_tokens} new tokens; {meta['answer_tokens']} "
        "tokens): the share of answer tokens each draft vocabulary holds (a token outside it can "
        "never be drafted).",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| vocabulary | " + " | ".join(sources) + " |",
        "|---|" + "---|" * len(sources),
    ]
    lines += [f"| {c['vocabulary']} | " + " | ".join(str(c[s]) for s in sources) + " |" for c in coverage]
    if taus:
        lines += [
            "",
            f"Served tau, the shipped weights against the same weights re-indexed to the data's top-V "
            f"vocabulary (no training), fixed K, first {a.tau_prompts} prompts of each source:",
            "",
            "| method | K | vocabulary | source | tau greedy | acceptance (greedy) | tau T=1 |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['method']} | {r['k']} | {r['vocabulary']} | {r['source']} | {r['greedy']['tau']} "
            f"| {r['greedy']['acceptance']} | {r['t1']['tau']} |"
            for r in taus
        ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
