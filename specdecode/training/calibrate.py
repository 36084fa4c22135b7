"""Sequential temperature scaling (STS) of DSpark's confidence head: `specdecode calibrate`.

Contract:
- `ece(p [N], y [N], bins=20)`: expected calibration error with equal-width bins.
  `ece_floor(p [N], bins)`: the ECE a perfectly calibrated head with these confidences would
  read on N rounds (mean over labels drawn y ~ Bernoulli(p), seeded): the estimator's own
  sampling noise, so a measured ECE near it says "calibrated, as far as N rounds can tell"
  (with 20 bins and ~500 rounds it is several percent).
  `auroc(p, y)`: area under the ROC curve (rank statistic; ties averaged; NaN with one class).
- `fit_sts(z [N, K], drafted [N, K], accepted [N], grid)`: one temperature per position, fit left
  to right: for position k every grid value is tried with positions < k frozen, and the one
  with the lowest ECE of the cumulative product a_k = prod_{i<=k} sigmoid(z_i / t_i) against the
  prefix-accepted label (accepted >= k) over the rounds that drafted position k wins. Opt-in
  (`bias_grid`, `calibrate --bias`, not in the paper): a per-position bias b_k searched jointly,
  sigmoid(z_k / t_k + b_k), for a head whose confidences are off by a constant (a temperature
  alone cannot move a logit's sign; an over-fitted head is over-confident everywhere).
- `survival(z, temps)` -> a [N, K]; `report(z, drafted, accepted, temps)` -> per-position
  {n, rate, ece, ece_floor, auroc}.
- `offline_calibration(task, target, seqs, tokens_per_batch, max_batches)`: the raw confidence
  head teacher-forced on regenerated answers (a DSpark training task holding the drafter's
  weights, `DSparkLoss.terms`): per position {n, confidence (mean sigmoid of the logit), label
  (mean 1 - TV(p_d, p_t), the acceptance probability the head is trained to predict), ece (of
  the confidence against that soft label, equal-width bins)}. The soft label has no sampling
  noise, so this ECE separates the head's own calibration on those contexts from the served
  rounds' floor; run it on answers sampled at two temperatures to see what the contexts do.
  The blocks' anchors come from seed 0 (the global RNG is left as it was); a position without
  labels reads NaN.
- `collect(target, drafter, prompts, ...)`: runs real speculative decoding (fixed K = the
  drafter's block, temperatures set to 1 while recording) and returns, per round and request,
  the raw confidence logits of the drafted positions and the number of drafts accepted.
- `calibrate(target_spec, drafter_dir, data_dir, ...)`: loads the target and the DSpark
  checkpoint, collects labels on held-out prompts (the prompt part of a regenerated held-out
  split, or the `heldout.jsonl` messages of a prompt set), fits STS on the first rounds and
  evaluates on the rest (`--eval-fraction`), writes the temperatures into the checkpoint
  (`sts_temperature` in model.safetensors, a "calibration" record in config.json; atomic),
  and writes calibration.json + reliability.png next to it; prints the table.
  `rounds=FILE`: the collected rounds are saved there (safetensors, with what they were
  collected from: the drafter's weights without its calibration, the target, the settings), and
  a later run with the same FILE refits from them instead of decoding again (`--bias`, another
  `--eval-fraction`); rounds of other weights or settings are refused.
Legend: N rounds x requests, K draft positions.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.dspark import load_dspark
from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.policy import FixedK
from specdecode.training.features import eval_batches
from specdecode.training.regen import META, prompt_ids, read_prompts, read_regen

DEFAULT_GRID = tuple(round(math.exp(x / 20), 4) for x in range(-46, 47))  # 0.1 .. 10, log-spaced
BIAS_GRID = tuple(round(x / 10, 2) for x in range(-40, 21))  # -4 .. 2 (opt-in, not in the paper)


def ece(p: torch.Tensor, y: torch.Tensor, bins: int = 20) -> float:
    if len(p) == 0:
        return float("nan")
    p = p.double().clamp(0, 1)
    idx = (p * bins).long().clamp(max=bins - 1)
    gap = torch.bincount(idx, weights=p, minlength=bins) - torch.bincount(
        idx, weights=y.double(), minlength=bins
    )
    return float(gap.abs().sum()) / len(p)


def ece_floor(p: torch.Tensor, bins: int = 20, draws: int = 200, seed: int = 0) -> float:
    if len(p) == 0:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    p = p.double().clamp(0, 1)
    return sum(ece(p, torch.bernoulli(p, generator=g), bins) for _ in range(draws)) / draws


def auroc(p: torch.Tensor, y: torch.Tensor) -> float:
    y = y.bool()
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    order = torch.argsort(p.double(), stable=True)
    ranks = torch.empty(len(p), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(p) + 1, dtype=torch.float64)
    ps = p.double()
    for v in torch.unique(ps[order]):  # average ranks over ties
        m = ps == v
        if int(m.sum()) > 1:
            ranks[m] = ranks[m].mean()
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def survival(z: torch.Tensor, temps, biases=None) -> torch.Tensor:
    t = torch.as_tensor(temps, dtype=torch.float64)[: z.shape[1]]
    b = torch.zeros_like(t) if biases is None else torch.as_tensor(biases, dtype=torch.float64)[: z.shape[1]]
    return torch.sigmoid(z.double() / t + b).cumprod(dim=1)


def labels(accepted: torch.Tensor, K: int) -> torch.Tensor:
    """[N] accepted counts -> [N, K] prefix-accepted labels (position k: accepted >= k + 1)."""
    return accepted[:, None] >= torch.arange(1, K + 1)[None]


def fit_sts(z, drafted, accepted, grid=DEFAULT_GRID, bins: int = 20, bias_grid=None):
    """-> (temperatures, biases) per position; biases stay 0 unless `bias_grid` is given."""
    K = z.shape[1]
    y = labels(accepted, K)
    temps, biases = [1.0] * K, [0.0] * K
    prefix = torch.ones(z.shape[0], dtype=torch.float64)  # a_{k-1} with earlier positions frozen
    for k in range(K):
        m = drafted[:, k]
        if int(m.sum()) > 0:
            best = (float("inf"), 1.0, 0.0)
            zk, pk, yk = z[m, k].double(), prefix[m], y[m, k]
            for t in grid:
                for b in bias_grid or (0.0,):
                    a = pk * torch.sigmoid(zk / t + b)
                    best = min(best, (ece(a, yk, bins), float(t), float(b)))
            temps[k], biases[k] = best[1], best[2]
        prefix = prefix * torch.sigmoid(z[:, k].double() / temps[k] + biases[k])
    return temps, biases


def report(z, drafted, accepted, temps, biases=None, bins: int = 20) -> list[dict]:
    K = z.shape[1]
    y, a = labels(accepted, K), survival(z, temps, biases)
    rows = []
    for k in range(K):
        m = drafted[:, k]
        rows.append(
            {
                "position": k + 1,
                "n": int(m.sum()),
                "rate": float(y[m, k].float().mean()) if m.any() else float("nan"),
                "ece": ece(a[m, k], y[m, k], bins),
                "ece_floor": ece_floor(a[m, k], bins),
                "auroc": auroc(a[m, k], y[m, k]),
            }
        )
    return rows


def offline_calibration(
    task, target, seqs, tokens_per_batch: int = 4096, max_batches: int = 40, bins: int = 20
):
    """-> [{position, n, confidence, label, ece}] per draft position (see the module contract)."""
    zs, labels_, weights = [], [], []
    # the blocks' anchors are drawn from a fixed seed, away from the global RNG
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for batch, feats in eval_batches(task, target, seqs, tokens_per_batch, max_batches):
            t = task.module.terms(batch, feats)
            zs.append(t["c_logit"].flatten(0, 1))  # [S * A, K]
            labels_.append(t["acc_target"].flatten(0, 1))
            weights.append(t["weight"].flatten(0, 1))
    z, y, w = torch.cat(zs), torch.cat(labels_), torch.cat(weights)
    rows = []
    for k in range(z.shape[1]):
        m = w[:, k] > 0
        c, yk = torch.sigmoid(z[m, k].double()), y[m, k].double()
        rows.append(
            {
                "position": k + 1,
                "n": int(m.sum()),
                "confidence": float(c.mean()),
                "label": float(yk.mean()),
                "ece": ece(c, yk, bins),
            }
        )
    return rows


def collect(
    target, drafter, prompts: list[list[int]], temperature=1.0, max_new_tokens=128, max_batch=8, seed=0
):
    """-> (z [N, K] raw confidence logits, drafted [N, K] bool, accepted [N] long)."""
    K = drafter.net.cfg.num_drafts
    saved = drafter.net.sts_temperature.clone(), drafter.net.sts_bias.clone()
    drafter.net.sts_temperature.fill_(1.0)
    drafter.net.sts_bias.fill_(0.0)
    # Rows are kept as Python numbers, not one small tensor each: thousands of long-lived small
    # tensor storages between the decoder's large short-lived buffers pinned gigabytes of heap.
    rows_z, rows_n, rows_a = [], [], []
    inner = drafter.advance

    def advance(batch, proposal, verdicts, target_out):
        conf = proposal.extras.get("confidences")
        if conf is not None:
            num_draft = proposal.num_draft.tolist()
            logits = torch.special.logit(conf.double(), eps=1e-9).tolist()  # [B, K]
            for b, n in enumerate(num_draft):
                if n > 0:
                    rows_z.append(logits[b][:n] + [0.0] * (K - n))
                    rows_n.append(n)
                    rows_a.append(verdicts[b].num_accepted)
        inner(batch, proposal, verdicts, target_out)

    drafter.advance = advance
    try:
        dec = SpeculativeDecoder(target, drafter, FixedK(K), max_batch=max_batch)
        params = SamplingParams(temperature=temperature)
        reqs = [
            GenerationRequest(p, params, max_new_tokens, seed=seed + i, id=str(i))
            for i, p in enumerate(prompts)
        ]
        dec.generate(reqs)
    finally:
        drafter.advance = inner
        drafter.net.sts_temperature.copy_(saved[0])
        drafter.net.sts_bias.copy_(saved[1])
    if not rows_z:
        raise SpecDecodeError("calibration collected no drafting rounds; use more or longer prompts")
    drafted = torch.arange(K)[None] < torch.tensor(rows_n)[:, None]  # [N, K]
    return torch.tensor(rows_z, dtype=torch.float64), drafted, torch.tensor(rows_a)


def heldout_prompts(data_dir, target, limit: int) -> list[list[int]]:
    """Prompt ids of the held-out split: the prompt part of data regenerated by this target, or
    the records of a prompt set (`specdecode data build`)."""
    d = Path(data_dir)
    if (d / META).exists():
        recs = read_regen(d, "heldout", target.fingerprint)
        out = [r["input_ids"][: r["loss_mask"].index(1)] for r in recs if 1 in r["loss_mask"]]
    else:
        out = [prompt_ids(target, r) for r in read_prompts(d, "heldout")[:limit]]
    if not out:
        raise SpecDecodeError(f"{d} holds no held-out prompts")
    return out[:limit]


def weights_fingerprint(drafter_dir) -> str:
    """sha256 of a checkpoint's tensors without its calibration (sts_*): what rounds depend on."""
    h = hashlib.sha256()
    for name, t in sorted(load_file(str(Path(drafter_dir) / "model.safetensors")).items()):
        if not name.startswith("sts_"):
            h.update(name.encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def load_or_collect(path, source: dict, collect_rounds):
    """(z, drafted, accepted) from `path` when it holds rounds of `source`, else collected and saved
    there (atomic); rounds collected from anything else are refused."""
    path = Path(path)
    if path.exists():
        with safe_open(str(path), "pt") as f:
            saved = json.loads((f.metadata() or {}).get("source", "{}"))
            rounds = tuple(f.get_tensor(k) for k in ("z", "drafted", "accepted"))
        diff = sorted(k for k in source if saved.get(k) != source[k])
        if diff:
            raise SpecDecodeError(
                f"{path} holds rounds collected with another {', '.join(diff)}; "
                "delete it or pass another --rounds file to collect again"
            )
        return rounds
    z, drafted, accepted = collect_rounds()
    tmp = path.with_name(path.name + ".tmp")
    tensors = {"z": z.contiguous(), "drafted": drafted.contiguous(), "accepted": accepted.contiguous()}
    save_file(tensors, str(tmp), metadata={"source": json.dumps(source)})
    os.replace(tmp, path)
    return z, drafted, accepted


def write_temperatures(drafter_dir, temps: list[float], biases: list[float], record: dict) -> None:
    """Store the STS temperatures (and biases) in the checkpoint (atomic: weights, then config)."""
    d = Path(drafter_dir)
    weights = load_file(str(d / "model.safetensors"))
    old = weights["sts_temperature"]
    weights["sts_temperature"] = torch.tensor(temps, dtype=torch.float32).to(old.dtype)
    weights["sts_bias"] = torch.tensor(biases, dtype=torch.float32).to(old.dtype)
    tmp = d / "model.safetensors.tmp"
    save_file(weights, str(tmp))
    os.replace(tmp, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["calibration"] = record
    tmp = d / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, d / "config.json")


def plot(path, z, drafted, accepted, before, after, biases=None, bins: int = 10) -> None:
    import matplotlib  # deferred: optional plotting dependency, slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = z.shape[1]
    y = labels(accepted, K)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    ax = axes[0]
    fitted = "STS + bias" if biases is not None and any(biases) else "STS"
    for name, temps, bias, style in (("raw", before, None, "--"), (fitted, after, biases, "-")):
        a = survival(z, temps, bias)
        m = drafted
        p, t = a[m], y[m].double()
        idx = (p * bins).long().clamp(max=bins - 1)
        xs = [float(p[idx == b].mean()) for b in range(bins) if (idx == b).any()]
        ys = [float(t[idx == b].mean()) for b in range(bins) if (idx == b).any()]
        ax.plot(xs, ys, style, marker="o", label=f"{name} (all positions)")
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
    ax.set_xlabel("predicted prefix survival a_k")
    ax.set_ylabel("observed prefix acceptance")
    ax.set_title("Reliability")
    ax.legend()
    ax = axes[1]
    r0, r1 = report(z, drafted, accepted, before), report(z, drafted, accepted, after, biases)
    ks = [r["position"] for r in r0]
    ax.bar([k - 0.2 for k in ks], [100 * r["ece"] for r in r0], width=0.4, label="raw")
    ax.bar([k + 0.2 for k in ks], [100 * r["ece"] for r in r1], width=0.4, label=fitted)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("ECE of a_k (%)")
    ax.set_title("Per-position ECE (evaluation rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibrate(
    target_spec,
    drafter_dir,
    data_dir,
    *,
    num_prompts: int = 64,
    temperature: float = 1.0,
    max_new_tokens: int = 128,
    eval_fraction: float = 0.33,
    dtype: str = "auto",
    device: str | None = None,
    max_batch: int = 8,
    bias: bool = False,
    write: bool = True,
    rounds=None,
) -> dict:
    if not 0.0 <= eval_fraction < 1.0:
        raise SpecDecodeError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if num_prompts < 1:
        raise SpecDecodeError(f"--num-prompts must be >= 1, got {num_prompts}")
    target = (
        load_model(target_spec, dtype=dtype, device=device) if isinstance(target_spec, str) else target_spec
    )
    drafter = load_dspark(drafter_dir, target)
    prompts = heldout_prompts(data_dir, target, num_prompts)
    run = lambda: collect(target, drafter, prompts, temperature, max_new_tokens, max_batch)  # noqa: E731
    if rounds is None:
        z, drafted, accepted = run()
    else:
        source = {
            "drafter_weights": weights_fingerprint(drafter_dir),
            "target": target.fingerprint,
            "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16],
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
        }
        z, drafted, accepted = load_or_collect(rounds, source, run)
    n_fit = len(z) - int(len(z) * eval_fraction)
    fit = (z[:n_fit], drafted[:n_fit], accepted[:n_fit])
    ev = (z[n_fit:], drafted[n_fit:], accepted[n_fit:]) if n_fit < len(z) else fit
    K = z.shape[1]
    ones = [1.0] * K
    temps, biases = fit_sts(*fit, bias_grid=BIAS_GRID if bias else None)
    stored = lambda xs: [float(torch.tensor(x).to(torch.bfloat16).float()) for x in xs]  # noqa: E731
    temps, biases = stored(temps), stored(biases)  # as the bf16 checkpoint keeps them
    result = {
        "method": "sts+bias" if bias else "sts",
        "temperature": temperature,
        "prompts": len(prompts),
        "rounds_fit": n_fit,
        "rounds_eval": len(z) - n_fit,
        "sts_temperature": temps,
        "sts_bias": biases,
        "before": report(*ev, ones),
        "after": report(*ev, temps, biases),
        "after_fit_rounds": report(*fit, temps, biases),
    }
    d = Path(drafter_dir)
    if write:
        keys = ("method", "temperature", "prompts", "rounds_fit", "sts_temperature", "sts_bias")
        write_temperatures(d, temps, biases, {k: result[k] for k in keys})
        (d / "calibration.json").write_text(json.dumps(result, indent=2))
        plot(d / "reliability.png", *ev, ones, temps, biases)
    return result


def format_table(result: dict) -> str:
    lines = [
        "| position | rounds | prefix acceptance | ECE raw | ECE STS | ECE floor | AUROC raw "
        "| AUROC STS | temperature | bias |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = zip(result["before"], result["after"], result["sts_temperature"], result["sts_bias"], strict=True)
    for b, a, t, bias in rows:
        lines.append(
            f"| {b['position']} | {b['n']} | {b['rate']:.3f} | {100 * b['ece']:.2f} % "
            f"| {100 * a['ece']:.2f} % | {100 * a['ece_floor']:.2f} % | {b['auroc']:.3f} | {a['auroc']:.3f} "
            f"| {t:.3g} | {bias:.2g} |"
        )
    return "\n".join(lines)
