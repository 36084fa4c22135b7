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
  step, RNG, the names of the trained parameters) atomically (also at `stop_at` or past
  `time_limit_s`, as if killed there); a rerun with the same out_dir resumes from `trainer.pt`
  and walks the same batches the killed run would have (one that would train other parameters,
  e.g. another `--train-only`, is refused). Every `eval_every` steps it runs the real
  speculative loop (greedy, fixed K) on held-out prompts and logs the served tau. Metrics
  (losses, accuracies, gradient norm, training tokens/s over all ranks) go to
  out_dir/log.jsonl and the progress bar.
- `train_many([(task, cfg), ...], target, seqs, eval_prompts)`: several tasks side by side on
  the same batches (`specdecode train A,B,...`): runs at the same step read one forward of the
  frozen target over the union of their feature layers, so each pays a share of it; each keeps
  its own optimiser, schedule, checkpoints, log and clock (its share of the target forward plus
  its own work) in its own out_dir, and resumes on its own. The configs must cut batches alike
  (tokens_per_batch, max_len, seed, grad_accum). `train(task, ...)` is the one-task case.
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
from specdecode.request import SamplingParams
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
    time_limit_s: float | None = None  # save and return after the step that passes this wall time
    anneal_to_time_limit: bool = False  # the schedule ends at the time limit (or at `steps`, if sooner)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "tokens_per_batch", "max_len", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.time_limit_s is not None and not self.time_limit_s >= 0:
            raise SpecDecodeError(f"--time-limit must be >= 0 minutes, got {self.time_limit_s / 60}")
        if not self.lr > 0:
            raise SpecDecodeError(f"--lr must be > 0, got {self.lr}")


def lr_at(step: float, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at cfg.steps (`step` may
    be fractional: a time-annealed run passes its progress in steps' units)."""
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
def evaluate(
    drafter, target, prompts: list[list[int]], num_draft: int, max_new_tokens: int, temperature: float = 0.0
) -> dict:
    """Served tau and acceptance of `drafter` in the real loop (fixed K; greedy unless a
    temperature is given, each prompt then seeded by its index)."""
    dec = SpeculativeDecoder(target, drafter, FixedK(num_draft), max_batch=min(8, len(prompts)))
    params = SamplingParams(temperature=temperature)
    reqs = [
        GenerationRequest(prompt_ids=p, params=params, max_new_tokens=max_new_tokens, seed=i, id=str(i))
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


@dataclass
class _Run:
    """One method's training inside `train_many`: its module, optimiser, step and clock."""

    task: TrainTask
    cfg: TrainConfig
    out: Path
    model: torch.nn.Module  # the module, or its DDP wrapper
    params: list
    opt: torch.optim.Optimizer
    step: int = 0
    wall: float = 0.0
    lr: float = 0.0  # the learning rate of the step in flight (before any group's lr_scale)
    stopped: bool = False
    last: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return not self.stopped and self.step < self.cfg.steps


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
    return train_many([(task, cfg)], target, seqs, eval_prompts, features, progress)[0]


def feature_union(tasks) -> tuple[int, ...]:
    """The target layers any of `tasks` reads, each once, in first-use order."""
    return tuple(dict.fromkeys(layer for task in tasks for layer in task.feature_layers))


def _check_shared(cfgs: list[TrainConfig]) -> None:
    """Runs that share batches must cut them alike."""
    for name in ("tokens_per_batch", "max_len", "seed", "grad_accum"):
        values = {getattr(c, name) for c in cfgs}
        if len(values) > 1:
            flag = "--" + name.replace("_", "-")
            raise SpecDecodeError(f"methods trained together must share {flag}, got {values}")
    outs = [str(Path(c.out_dir).resolve()) for c in cfgs]
    if len(set(outs)) != len(outs):
        raise SpecDecodeError(f"methods trained together need one output directory each, got {outs}")


def train_many(
    jobs: list[tuple[TrainTask, TrainConfig]],
    target,
    seqs: list,
    eval_prompts: list[list[int]] | None = None,
    features=None,
    progress: bool = True,
) -> list[dict]:
    """Train several tasks side by side on the same batches (see module docstring): runs at the
    same step read one feature forward of the frozen target (the union of their layers); each
    keeps its own optimiser, schedule, clock, checkpoints and log in its own out_dir."""
    rank, world = _dist()
    cfgs = [cfg for _, cfg in jobs]
    _check_shared(cfgs)
    torch.manual_seed(cfgs[0].seed)
    layers = feature_union(task for task, _ in jobs)
    if features is None:
        features = TargetFeatures(target, layers) if layers else (lambda b: {})
    runs = [_start_run(task, cfg, rank, world) for task, cfg in jobs]
    sess = _Session([t.method for t, _ in jobs], target, seqs, cfgs[0], eval_prompts, features, rank, world)
    bars = {
        id(r): tqdm(
            total=r.cfg.steps,
            initial=r.step,
            desc=f"train {r.task.method}",
            position=i,
            disable=not progress or rank != 0,
            dynamic_ncols=True,
        )
        for i, r in enumerate(runs)
    }
    while any(r.active for r in runs):
        active = [r for r in runs if r.active]
        work = sess.forward_backward(active)
        for r in active:
            sess.finish_step(r, *work[id(r)], bars[id(r)])
    for bar in bars.values():
        bar.close()
    results = [r.last if r.stopped else sess.finish(r) for r in runs]
    if world > 1:
        dist.barrier()
    return results


@dataclass
class _Session:
    """What the runs of one `train_many` share: the data, the frozen target's features, the
    evaluation prompts, the process group and the clock; one step of every run goes through it."""

    methods: list[str]  # every method trained together (recorded in checkpoints)
    target: object
    seqs: list
    base: TrainConfig  # the shared batch cut (tokens_per_batch, seed, grad_accum)
    eval_prompts: list[list[int]] | None
    features: object  # batch -> {layer: [B, T, d]}
    rank: int
    world: int
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.lengths = [len(s.input_ids) for s in self.seqs]
        # Every epoch packs the same sorted lengths, so it holds the same number of batches.
        self.per_epoch = len(plan_batches(self.lengths, self.base.tokens_per_batch, self.base.seed, 0))
        self.plans: dict[int, list[list[int]]] = {}

    def batch_at(self, cursor: int) -> dict:
        """The cursor-th global micro-batch (epoch order fixed by seed and epoch)."""
        e, i = divmod(cursor, self.per_epoch)
        if e not in self.plans:
            self.plans.clear()
            self.plans[e] = plan_batches(self.lengths, self.base.tokens_per_batch, self.base.seed, e)
        idx = self.plans[e][i]
        b = collate([self.seqs[j] for j in idx])
        b["index"] = torch.tensor(idx)
        return b

    def progress(self, r: _Run) -> float:
        """Where run r is on its schedule, in steps: its step, or with `anneal_to_time_limit` the
        larger of that and the share of the time limit spent (times `steps`), so a run boxed in time
        (a lent GPU of unknown speed) still decays its learning rate to the end."""
        limit = r.cfg.time_limit_s
        if not (r.cfg.anneal_to_time_limit and limit):
            return r.step
        return max(r.step, (time.perf_counter() - self.started) / limit * r.cfg.steps)

    def forward_backward(self, active: list[_Run]) -> dict[int, tuple[float, int, dict]]:
        """Set each run's learning rate, then accumulate its gradients over this step's
        micro-batches; runs at the same cursor share one feature forward of the target (its time
        split evenly). -> {id(run): (seconds charged, real tokens seen, mean logs)}."""
        base, world = self.base, self.world
        out = {id(r): (0.0, 0, {}) for r in active}
        for r in active:
            r.lr = lr_at(self.progress(r), r.cfg)
            for g in r.opt.param_groups:
                g["lr"] = r.lr * g.get("lr_scale", 1.0)
        for micro in range(base.grad_accum):
            by_cursor: dict[int, list[_Run]] = {}
            for r in active:
                by_cursor.setdefault((r.step * base.grad_accum + micro) * world + self.rank, []).append(r)
            for cursor, group in by_cursor.items():
                t0 = time.perf_counter()
                batch = self.batch_at(cursor)
                n_tok = int(batch["lengths"].sum()) if "lengths" in batch else batch["input_ids"].numel()
                dev = next(group[0].task.module.parameters()).device
                feats = {k: v.to(dev) for k, v in self.features(batch).items()}
                batch = {k: v.to(dev) for k, v in batch.items()}
                share = (time.perf_counter() - t0) / len(group)  # the target's forward, split evenly
                for r in group:
                    t1 = time.perf_counter()
                    sync = world == 1 or micro == base.grad_accum - 1
                    ctx = r.model.no_sync() if not sync else _null()
                    with ctx, torch.autocast(dev.type, dtype=torch.bfloat16, enabled=r.cfg.bf16):
                        loss, logs = r.model(batch, {k: feats[k] for k in r.task.feature_layers})
                        (loss / base.grad_accum).backward()
                    spent, tokens, acc = out[id(r)]
                    for k, v in logs.items():
                        acc[k] = acc.get(k, 0.0) + v / base.grad_accum
                    out[id(r)] = (spent + share + time.perf_counter() - t1, tokens + n_tok, acc)
        return out

    def finish_step(self, r: _Run, spent: float, tokens: int, logs: dict, bar) -> None:
        """Clip, step the optimiser, then log / evaluate / checkpoint / stop as the config says."""
        t1 = time.perf_counter()
        gnorm = torch.nn.utils.clip_grad_norm_(r.params, r.cfg.clip)
        r.opt.step()
        r.opt.zero_grad(set_to_none=True)
        r.step += 1
        took = spent + time.perf_counter() - t1
        r.wall += took
        bar.update(1)
        rec = {
            "step": r.step,
            "lr": r.lr,
            "grad_norm": round(float(gnorm), 4),
            "tok_s": round(tokens * self.world / took, 1),
            **{k: round(v, 4) for k, v in logs.items()},
        }
        if r.step % r.cfg.log_every == 0 or r.step == r.cfg.steps:
            bar.set_postfix({k: rec[k] for k in list(logs)[:4]})
            self.log(r, rec)
        if r.cfg.eval_every and r.step % r.cfg.eval_every == 0 and r.step < r.cfg.steps:
            ev = self.run_eval(r)
            if ev:
                self.log(r, {"step": r.step, **ev})
                bar.write(f"{r.task.method} step {r.step}: {_served(ev)}")
        if r.step % r.cfg.checkpoint_every == 0 and r.step < r.cfg.steps:
            self.save(r)
        r.last = rec
        limit = r.cfg.time_limit_s
        out_of_time = limit is not None and time.perf_counter() - self.started > limit
        at_stop = r.cfg.stop_at is not None and r.step >= r.cfg.stop_at
        if (at_stop or out_of_time) and r.step < r.cfg.steps:
            self.save(r)
            r.stopped = True
            r.last = {**rec, "stopped_at": r.step, "wall_clock_s": r.wall}

    def finish(self, r: _Run) -> dict:
        """The last evaluation and the final save of a run that reached its steps."""
        ev = self.run_eval(r)
        if ev:
            self.log(r, {"step": r.step, **ev})
            if self.rank == 0:
                print(f"{r.task.method}: final {_served(ev)}")
        self.save(r, final=True)
        return {**r.last, **ev, "wall_clock_s": r.wall}

    def save(self, r: _Run, final: bool = False) -> None:
        if self.rank != 0:
            return
        meta = {
            "steps": r.step,
            "wall_clock_s": round(r.wall, 1),
            "num_sequences": len(self.seqs),
            "num_tokens": sum(self.lengths),
            "config": {k: v for k, v in asdict(r.cfg).items() if k != "out_dir"},
            "world_size": self.world,
            "final": final,
            "trained_with": self.methods,
            **({"init_from": r.task.init_from} if getattr(r.task, "init_from", None) else {}),
            **(r.task.training_meta() if hasattr(r.task, "training_meta") else {}),
        }
        if hasattr(r.task, "save_extra"):
            r.task.save_extra()
        state = r.task.checkpoint_state()
        save_checkpoint(r.out, r.task.method, r.task.arch(), state, self.target, training=meta)
        _save_atomic(
            {
                "method": r.task.method,
                "module": r.task.module.state_dict(),
                "optimizer": r.opt.state_dict(),
                "step": r.step,
                "wall": r.wall,
                "rng": torch.get_rng_state(),
                "trainable": _trainable(r.task.module),
            },
            r.out / STATE,
        )

    def log(self, r: _Run, rec: dict) -> None:
        if self.rank == 0:
            with (r.out / "log.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")

    def run_eval(self, r: _Run) -> dict:
        if self.rank != 0 or not self.eval_prompts:
            return {}
        r.task.module.eval()
        tgt = r.task.eval_target() if hasattr(r.task, "eval_target") else self.target
        num_draft, max_new = r.cfg.eval_num_draft, r.cfg.eval_max_new_tokens
        ev = evaluate(r.task.make_drafter(), tgt, self.eval_prompts, num_draft, max_new)
        r.task.module.train()
        return {"eval_tau": round(ev["tau"], 3), "eval_acceptance": [round(a, 3) for a in ev["acceptance"]]}


def _served(ev: dict) -> str:
    return f"served tau {ev['eval_tau']} acceptance {ev['eval_acceptance']}"


def _trainable(module) -> list[str]:
    """The names of the parameters a run trains (a resume must train the same)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _start_run(task: TrainTask, cfg: TrainConfig, rank: int, world: int) -> _Run:
    """A run's optimiser over its task's parameters, resumed from `trainer.pt` when out_dir has one."""
    out = Path(cfg.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    module = task.module
    model = torch.nn.parallel.DistributedDataParallel(module) if world > 1 else module
    params = [p for p in module.parameters() if p.requires_grad]
    groups = task.param_groups() if hasattr(task, "param_groups") else [{"params": params, "lr_scale": 1.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    run = _Run(task, cfg, out, model, params, opt)
    st = read_state(out, task.method)
    if st is not None:
        trained = st.get("trainable")
        if trained is not None and trained != _trainable(module):
            raise SpecDecodeError(
                f"{out / STATE} trained other weights than this run would ({len(trained)} tensors, here "
                f"{len(_trainable(module))}): resume with the options it was started with "
                "(e.g. --train-only), or train into a new --out"
            )
        module.load_state_dict(st["module"])
        opt.load_state_dict(st["optimizer"])
        run.step, run.wall = st["step"], st["wall"]
        torch.set_rng_state(st["rng"])
        if rank == 0:
            print(f"resuming {task.method} training from step {run.step} ({out / STATE})")
    module.train()
    return run


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
