"""One trainer for every trainable drafter.

Contract:
- A method supplies a `TrainTask` (in its own drafters/<method>/ folder): `module` (an
  nn.Module whose `forward(batch, feats) -> (loss, logs)` holds all trainable parameters),
  `feature_layers` (target layers its loss reads), `arch()` (config.json fields),
  `checkpoint_state()` (tensors of the drafter checkpoint) and `make_drafter()` (a ready
  `Drafter` built from the current weights, for evaluation in the real loop). Optional hooks,
  for tasks that train the target too (MTP native mode): `param_groups()` (parameter groups,
  each with an `lr_scale`), `eval_target()` (the target to evaluate with), `save_extra()`
  (called at every save, e.g. to write the new target) and `training_meta()` (fields for the
  checkpoint's training record). An empty `feature_layers` runs no frozen-target forward.
- `train(task, target, seqs, cfg, eval_prompts)`: AdamW, linear warm-up then cosine decay to
  `min_lr_ratio`, gradient clipping, optional bf16 autocast, gradient accumulation. Every
  `checkpoint_every` steps (and at the end) it writes the drafter checkpoint (config.json +
  model.safetensors, loadable by the drafter) and `trainer.pt` (fp32 weights, optimiser,
  step, RNG) atomically; a rerun with the same out_dir resumes from `trainer.pt` and walks the
  same batches the killed run would have. Every `eval_every` steps it runs the real
  speculative loop (greedy, fixed K) on held-out prompts and logs the served tau. Metrics
  (losses, accuracies, gradient norm, training tokens/s over all ranks) go to
  out_dir/log.jsonl and the progress bar.
- Distributed: under torchrun (WORLD_SIZE > 1) it joins a process group (gloo on CPU, nccl on
  CUDA), wraps the module in DistributedDataParallel and gives rank r every world-th batch;
  rank 0 writes checkpoints, logs and evaluates.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm

from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.checkpoint import save_checkpoint
from specdecode.errors import SpecDecodeError
from specdecode.policy import FixedK
from specdecode.training.data import collate, plan_batches
from specdecode.training.features import TargetFeatures

STATE = "trainer.pt"


class TrainTask(Protocol):
    method: str
    module: torch.nn.Module
    feature_layers: tuple[int, ...]

    def arch(self) -> dict: ...
    def checkpoint_state(self) -> dict[str, torch.Tensor]: ...
    def make_drafter(self): ...


@dataclass
class TrainConfig:
    out_dir: str
    steps: int = 1000
    lr: float = 5e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 0.5
    grad_accum: int = 1
    tokens_per_batch: int = 4096
    max_len: int = 512
    checkpoint_every: int = 100
    eval_every: int = 0  # 0: only at the end
    eval_prompts: int = 16
    eval_num_draft: int = 4
    eval_max_new_tokens: int = 64
    log_every: int = 10
    seed: int = 0
    bf16: bool = False  # autocast the drafter's forward in bf16
    stop_at: int | None = None  # save and return after this step, as if killed (time-boxed runs)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "tokens_per_batch", "max_len", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise SpecDecodeError(f"--lr must be > 0, got {self.lr}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _dist() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def read_state(out_dir, method: str) -> dict | None:
    """The trainer state (`trainer.pt`) of the run in `out_dir`, None when it has none; a run of
    another method is refused."""
    path = Path(out_dir) / STATE
    if not path.exists():
        return None
    st = torch.load(path, weights_only=True)  # tensors, numbers, strings: nothing to execute
    if st["method"] != method:
        raise SpecDecodeError(f"{out_dir} holds a {st['method']!r} training run, not {method!r}")
    return st


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(drafter, target, prompts: list[list[int]], num_draft: int, max_new_tokens: int) -> dict:
    """Served tau and acceptance of `drafter` in the real loop (greedy, fixed K)."""
    dec = SpeculativeDecoder(target, drafter, FixedK(num_draft), max_batch=min(8, len(prompts)))
    reqs = [
        GenerationRequest(prompt_ids=p, max_new_tokens=max_new_tokens, id=str(i))
        for i, p in enumerate(prompts)
    ]
    res = dec.generate(reqs)
    steps = sum(r.num_steps for r in res)
    emitted = sum(r.tau * r.num_steps for r in res)
    reached = [
        sum(r.reached_per_position[k] for r in res if k < len(r.reached_per_position))
        for k in range(num_draft)
    ]
    acc = [
        sum(r.accepted_per_position[k] for r in res if k < len(r.accepted_per_position))
        for k in range(num_draft)
    ]
    return {
        "tau": emitted / max(steps, 1),
        "acceptance": [a / r if r else 0.0 for a, r in zip(acc, reached, strict=True)],
    }


def train(
    task: TrainTask,
    target,
    seqs: list,
    cfg: TrainConfig,
    eval_prompts: list[list[int]] | None = None,
    features=None,
    progress: bool = True,
) -> dict:
    """Train `task.module` on `seqs` (see module docstring); returns the final log record."""
    rank, world = _dist()
    out = Path(cfg.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    if features is None:
        features = TargetFeatures(target, task.feature_layers) if task.feature_layers else (lambda b: {})
    module = task.module
    model = module
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(module)
    params = [p for p in module.parameters() if p.requires_grad]
    groups = task.param_groups() if hasattr(task, "param_groups") else [{"params": params, "lr_scale": 1.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, wall = 0, 0.0
    state_path = out / STATE
    st = read_state(out, task.method)
    if st is not None:
        module.load_state_dict(st["module"])
        opt.load_state_dict(st["optimizer"])
        step, wall = st["step"], st["wall"]
        torch.set_rng_state(st["rng"])
        if rank == 0:
            print(f"resuming {task.method} training from step {step} ({out / STATE})")
    lengths = [len(s.input_ids) for s in seqs]
    # Every epoch packs the same sorted lengths, so it holds the same number of batches.
    per_epoch = len(plan_batches(lengths, cfg.tokens_per_batch, cfg.seed, 0))
    plans: dict[int, list[list[int]]] = {}

    def batch_at(cursor: int) -> dict:
        """The cursor-th global micro-batch (epoch order fixed by seed and epoch)."""
        e, i = divmod(cursor, per_epoch)
        if e not in plans:
            plans.clear()
            plans[e] = plan_batches(lengths, cfg.tokens_per_batch, cfg.seed, e)
        idx = plans[e][i]
        b = collate([seqs[j] for j in idx])
        b["index"] = torch.tensor(idx)
        return b

    def save(final: bool = False) -> None:
        if rank != 0:
            return
        meta = {
            "steps": step,
            "wall_clock_s": round(wall, 1),
            "num_sequences": len(seqs),
            "num_tokens": sum(lengths),
            "config": {k: v for k, v in asdict(cfg).items() if k != "out_dir"},
            "world_size": world,
            "final": final,
            **(task.training_meta() if hasattr(task, "training_meta") else {}),
        }
        if hasattr(task, "save_extra"):
            task.save_extra()
        save_checkpoint(out, task.method, task.arch(), task.checkpoint_state(), target, training=meta)
        _save_atomic(
            {
                "method": task.method,
                "module": module.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "wall": wall,
                "rng": torch.get_rng_state(),
            },
            state_path,
        )

    def log(rec: dict) -> None:
        if rank == 0:
            with (out / "log.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")

    def run_eval() -> dict:
        if rank != 0 or not eval_prompts:
            return {}
        module.eval()
        tgt = task.eval_target() if hasattr(task, "eval_target") else target
        r = evaluate(task.make_drafter(), tgt, eval_prompts, cfg.eval_num_draft, cfg.eval_max_new_tokens)
        module.train()
        return {"eval_tau": round(r["tau"], 3), "eval_acceptance": [round(a, 3) for a in r["acceptance"]]}

    module.train()
    bar = tqdm(
        total=cfg.steps,
        initial=step,
        desc=f"train {task.method}",
        disable=not progress or rank != 0,
        dynamic_ncols=True,
    )
    last: dict = {}
    dev = next(module.parameters()).device
    while step < cfg.steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg) * g.get("lr_scale", 1.0)
        logs_acc: dict[str, float] = {}
        tokens = 0  # real (unpadded) tokens this step, for the tokens/s figure
        for micro in range(cfg.grad_accum):
            batch = batch_at((step * cfg.grad_accum + micro) * world + rank)
            tokens += int(batch["lengths"].sum()) if "lengths" in batch else batch["input_ids"].numel()
            feats = {k: v.to(dev) for k, v in features(batch).items()}
            batch = {k: v.to(dev) for k, v in batch.items()}
            sync = world == 1 or micro == cfg.grad_accum - 1
            ctx = model.no_sync() if not sync else _null()
            with ctx, torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, logs = model(batch, feats)
                (loss / cfg.grad_accum).backward()
            for k, v in logs.items():
                logs_acc[k] = logs_acc.get(k, 0.0) + v / cfg.grad_accum
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        wall += time.perf_counter() - t0
        bar.update(1)
        rec = {
            "step": step,
            "lr": lr_at(step - 1, cfg),
            "grad_norm": round(float(gnorm), 4),
            "tok_s": round(tokens * world / (time.perf_counter() - t0), 1),
            **{k: round(v, 4) for k, v in logs_acc.items()},
        }
        if step % cfg.log_every == 0 or step == cfg.steps:
            bar.set_postfix({k: rec[k] for k in list(logs_acc)[:4]})
            log(rec)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            ev = run_eval()
            if ev:
                log({"step": step, **ev})
                bar.write(f"step {step}: served tau {ev['eval_tau']} acceptance {ev['eval_acceptance']}")
        if step % cfg.checkpoint_every == 0 and step < cfg.steps:
            save()
        last = rec
        if cfg.stop_at is not None and step >= cfg.stop_at and step < cfg.steps:
            save()
            bar.close()
            return {**last, "stopped_at": step, "wall_clock_s": wall}
    bar.close()
    ev = run_eval()
    if ev:
        log({"step": step, **ev})
        if rank == 0:
            print(f"final served tau {ev['eval_tau']} acceptance {ev['eval_acceptance']}")
    save(final=True)
    if world > 1:
        dist.barrier()
    return {**last, **ev, "wall_clock_s": wall}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
