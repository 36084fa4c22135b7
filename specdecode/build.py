"""Model assembly below the API: `LoadOptions` -> target + drafter + draft-length policy.

Contract:
- `LoadOptions` holds every setting of `specdecode.load` with its default, once; the CLI, the
  server (`engine.server.build_engine`) and the benchmark harness build one and pass it on.
  Construction checks what needs no model (a known method, K >= 0) with errors naming the flag.
- `build(options)` resolves the target (alias, Hugging Face directory or hub id; a `LoadedModel`
  is used as given, so several methods can share one target) and the drafter (a foreign layout,
  e.g. a speculators or SpecForge EAGLE-3 directory, is converted first: `native_drafter`),
  measures what the policy needs (cached per machine) and returns a `SpecDecode`.
- `SpecDecode.generate` / `stream` / `requests` take text, chat messages, or a list of prompts,
  and validated sampling parameters. Output is exactly the target's distribution (greedy at
  temperature 0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from specdecode.assets import cache_dir
from specdecode.chat import PromptItem, derive_seed, encode_prompt, parse_item
from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, GenerationResult, SpeculativeDecoder
from specdecode.drafters import DEFAULT_NUM_DRAFT, METHODS, build_drafter
from specdecode.errors import SpecDecodeError
from specdecode.interop import detect_layout, write_native
from specdecode.models import kernels
from specdecode.models.loader import load_model
from specdecode.policy import (
    FixedK,
    StepCostModel,
    draft_round_costs,
    make_policy,
    step_cost_curves,
    step_costs,
)

DEFAULT_TARGET = "smollm2-135m"
# The policies that time a target step (and a draft token) to choose K.
_MEASURED_POLICIES = ("adaptive", "scheduled", "scheduled-production")
_SCHEDULED_POLICIES = ("scheduled", "scheduled-production")


@dataclass
class LoadOptions:
    """What `specdecode.load` takes.

    policy: fixed, adaptive, scheduled or scheduled-production (`specdecode.policy`);
    max_model_len bounds the contexts the scheduled policies profile (default: the model's
    context); drafter_options: method-specific drafter settings (dspark: confidence_threshold,
    threshold_on)."""

    target: Any = DEFAULT_TARGET  # alias, HF directory, hub id, or a LoadedModel to share
    method: str = "ar"
    drafter: str | None = None
    num_draft_tokens: int | None = None
    policy: str = "adaptive"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str | None = None
    max_batch: int = 8
    verify_mode: str = "block"
    max_model_len: int | None = None
    drafter_options: dict | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecDecodeError(f"unknown method {self.method!r}; choose one of: {', '.join(METHODS)}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise SpecDecodeError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")

    @property
    def k(self) -> int:
        """Draft tokens per step: the method's default unless given; 0 for `ar`."""
        if self.method == "ar":
            return 0
        return DEFAULT_NUM_DRAFT[self.method] if self.num_draft_tokens is None else self.num_draft_tokens


def _is_single(prompt) -> bool:
    """A string or one conversation (a list of role/content messages) is a single prompt."""
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)
    )


class SpecDecode:
    """A target + drafter pair ready to generate."""

    def __init__(self, target, drafter, policy, method: str, max_batch: int = 8, verify_mode: str = "block"):
        self.target, self.drafter, self.method = target, drafter, method
        self.tokenizer = target.tokenizer
        self.decoder = SpeculativeDecoder(
            target, drafter, policy, max_batch=max_batch, verify_mode=verify_mode
        )

    def _items(self, prompt) -> list[PromptItem]:
        if isinstance(prompt, str):
            return [parse_item({"prompt": prompt}, "prompt", "0")]
        if _is_single(prompt):
            return [parse_item({"messages": prompt}, "messages", "0")]
        if isinstance(prompt, list) and prompt:
            items = []
            for i, p in enumerate(prompt):
                obj = {"prompt": p} if isinstance(p, str) else {"messages": p} if isinstance(p, list) else p
                items.append(parse_item(obj, f"prompt[{i}]", str(i)))
            return items
        raise SpecDecodeError(
            "prompt must be a non-empty string, a list of chat messages, or a list of prompts"
        )

    def requests(
        self,
        prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: tuple[str, ...] | list[str] = (),
        chat: bool = False,
        ignore_eos: bool = False,
    ) -> list[GenerationRequest]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        reqs = []
        for i, item in enumerate(self._items(prompt)):
            reqs.append(
                GenerationRequest(
                    prompt_ids=encode_prompt(self.tokenizer, item, chat),
                    params=params,
                    max_new_tokens=item.max_new_tokens or max_new_tokens,
                    stop=tuple(item.stop or stop),
                    seed=item.seed if item.seed is not None else derive_seed(seed, i),
                    id=item.id,
                    ignore_eos=ignore_eos,
                )
            )
        return reqs

    def generate(self, prompt, **kwargs) -> GenerationResult | list[GenerationResult]:
        """One result for a single prompt (text or messages), a list for a list of prompts."""
        results = self.decoder.generate(self.requests(prompt, **kwargs))
        return results[0] if _is_single(prompt) else results

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Text pieces of a single prompt as they are verified."""
        reqs = self.requests(prompt, **kwargs)
        if len(reqs) != 1:
            raise SpecDecodeError("stream() takes a single prompt; use decoder.stream() for many")
        for event in self.decoder.stream(reqs):
            if event.text:
                yield event.text
            if event.result is not None:
                self.last_result = event.result


def native_drafter(spec: str | None, target) -> str | None:
    """`--drafter` as we load it: a directory in another framework's layout (speculators,
    SpecForge EAGLE-3, z-lab DFlash) is converted once into our checkpoint layout (cached per
    source directory and its config/weights' modification times), or refused with the reason."""
    if spec is None or detect_layout(spec) in (None, "specdecode"):
        return spec
    src = Path(spec).resolve()
    stamp = "|".join(f"{f.name}:{f.stat().st_mtime_ns}" for f in sorted(src.iterdir()) if f.is_file())
    key = hashlib.sha256(f"{src}|{stamp}|{target.fingerprint}".encode()).hexdigest()[:20]
    out = cache_dir() / "imported" / key
    if not (out / "config.json").is_file():
        write_native(src, target, out)
    return str(out)


CALIBRATION_TEXT = (
    "Write a Python function that returns the n-th Fibonacci number, then explain how it works "
    "and what its running time is."
)


@torch.inference_mode()
def _round_seconds(tgt, drf, k: int, tokens: int = 24):
    """Drafting seconds per round of a greedy run that always drafts k (best of two runs)."""
    dec = SpeculativeDecoder(tgt, drf, FixedK(k), max_batch=1)
    ids = tgt.tokenizer.encode(CALIBRATION_TEXT)
    req = GenerationRequest(prompt_ids=ids, params=SamplingParams(), max_new_tokens=tokens, ignore_eos=True)
    dec.generate([req])  # warm-up
    best = float("inf")
    for _ in range(2):  # the faster of two runs: interference only adds time
        dec.draft_time = dec.verify_time = 0.0
        res = dec.generate([req])[0]
        best = min(best, dec.draft_time / max(res.num_steps, 1))
    return best


def _step_timer(tgt, drf, tokens: int = 24):
    """(k, T) -> drafting + verification seconds per step of one run that always drafts k at
    temperature T; a decoder per k and a warm-up per (k, T), kept for the calls that follow
    (`policy.draft_round_costs` pairs them)."""
    ids = tgt.tokenizer.encode(CALIBRATION_TEXT)
    decoders: dict[int, SpeculativeDecoder] = {}
    warm: set[tuple[int, float]] = set()

    def step_seconds(k: int, temperature: float) -> float:
        if k not in decoders:
            decoders[k] = SpeculativeDecoder(tgt, drf, FixedK(k), max_batch=1)
        dec = decoders[k]
        params = SamplingParams(temperature=temperature)
        req = GenerationRequest(prompt_ids=ids, params=params, max_new_tokens=tokens, ignore_eos=True)
        if (k, temperature) not in warm:
            dec.generate([req])
            warm.add((k, temperature))
        dec.draft_time = dec.verify_time = 0.0
        res = dec.generate([req])[0]
        return (dec.draft_time + dec.verify_time) / max(res.num_steps, 1)

    return step_seconds


@cache
def _drafting_code_tag() -> str:
    """Hash of the drafters' sources, the step's sampling and verification, and our compiled
    kernels: what a drafting round and a sampled step's extra run."""
    pkg = Path(__file__).parent
    h = hashlib.sha256(kernels.source_tag().encode())
    step = [pkg / f for f in ("sampling.py", "verify.py", "verify_rules.py", "verify_native.py", "step.py")]
    for f in [*sorted((pkg / "drafters").rglob("*.py")), *step]:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def drafter_round_costs(tgt, drf, method: str, k: int):
    """A learned drafter's round costs in seconds (`policy.draft_round_costs`: fixed, per token
    and the curve over K, through the K where the drafter says its cost bends),
    timed on short greedy runs (catch-up on committed context included, as in a real round) and
    keyed by the drafter's architecture (method, class, parameter count, dtype), its products'
    format plan, the drafting code (sources and kernels), the target and the machine; with what a
    sampled step costs beyond a greedy one (`RoundCosts.sampled_extra`)."""
    nets = [m for m in vars(drf).values() if isinstance(m, torch.nn.Module)]
    params = sum(p.numel() for m in nets for p in m.parameters())
    dtypes = sorted({str(p.dtype) for m in nets for p in m.parameters()})
    ident = [method, type(drf).__name__, str(params), ",".join(dtypes), tgt.fingerprint, str(k)]
    ident += [torch.__version__, torch.backends.cpu.get_cpu_capability(), str(torch.get_num_threads())]
    ident.append(_drafting_code_tag())  # faster drafting code is measured anew
    ident += sorted({m.formats_plan.name for m in nets if hasattr(m, "formats_plan")})  # products' formats
    cpu = tgt.model.info.device.type == "cpu"
    return draft_round_costs(
        ident,
        k,
        lambda n: _round_seconds(tgt, drf, n),
        cpu=cpu,
        points=drf.cost_points,
        step_seconds=_step_timer(tgt, drf),
    )


def build(options: LoadOptions) -> SpecDecode:
    """Load (or take) the target, build the drafter and the policy, and pair them."""
    o = options
    tgt = o.target
    if isinstance(tgt, str):
        tgt = load_model(tgt, dtype=o.dtype, device=o.device, kv_cache_dtype=o.kv_cache_dtype)
    spec = native_drafter(o.drafter, tgt)
    drf = build_drafter(o.method, tgt, spec, dtype=o.dtype, device=o.device, options=o.drafter_options)
    k = o.k
    verify_cost, draft_cost, draft_fixed, step_cost = 0.03, drf.cost_per_token, 0.0, None
    draft_curve = verify_curves = sampled_extra = None
    if o.policy in _MEASURED_POLICIES and k > 0:
        # Measured once per machine and cached: what K+1 verified tokens and a draft token cost.
        verify_curves = step_cost_curves(tgt.model, tgt.fingerprint, k + 1)  # {context: seconds}
        costs = verify_curves[min(verify_curves)]
        verify_cost = [c / costs[0] for c in costs]
        if drf.model is not None:  # a draft model: time its step too
            draft_cost = step_costs(drf.model, drf.fingerprint, 1)[0] / costs[0]
        elif o.policy == "adaptive" and drf.cost_per_token > 0:  # a learned drafter: time its rounds
            rc = drafter_round_costs(tgt, drf, o.method, k)
            draft_fixed, draft_cost = rc.fixed / costs[0], rc.per_token / costs[0]
            draft_curve = [c / costs[0] for c in rc.curve]
            if rc.sampled_extra is not None:
                sampled_extra = [c / costs[0] for c in rc.sampled_extra]
    if o.policy in _SCHEDULED_POLICIES:
        if k > 0:  # SPS(B): the target's step time over batch sizes, blocks and contexts (cached)
            max_context = o.max_model_len or tgt.model.info.max_position
            step_cost = StepCostModel.measured(tgt, o.max_batch, k + 1, max_context, draft_cost=draft_cost)
        else:  # nothing to schedule
            step_cost = StepCostModel.flat()
    # The scheduled policies correct the profile and the drafting cost from the steps they see.
    pol = make_policy(
        o.policy,
        k,
        draft_cost=draft_cost,
        verify_cost=verify_cost,
        step_cost=step_cost,
        online=True,
        draft_fixed=draft_fixed,
        draft_curve=draft_curve,
        verify_curves=verify_curves,
        sampled_extra=sampled_extra,
        sampled_k_max=drf.sampled_k_max,
    )
    return SpecDecode(tgt, drf, pol, o.method, max_batch=o.max_batch, verify_mode=o.verify_mode)
