"""Conformance of our speculators export with the `speculators` package itself (issue 16).

Two halves, because speculators 0.9.0 pins transformers <= 5.19 and specdecode pins 5.24:
- `reference OUT` (specdecode's environment): exports the shipped SmolLM2 EAGLE-3 drafter to
  OUT/export with the installed target directory as the verifier, runs the target on a prompt,
  and writes OUT/reference.safetensors: the fused features [1, T, 3d], the token ids each row
  reads, and OUR drafter's logits for 3 training-time-test steps, draft ids in the export's order.
- `check OUT` (an environment with speculators; imports nothing from specdecode): validates
  config.json with `SpeculatorModelConfig.from_pretrained` (must give `Eagle3SpeculatorConfig`),
  loads the weights with `Eagle3DraftModel.from_pretrained` (every stored tensor must land
  unchanged in the model) and the embedding from the verifier directory with its own
  `_load_verifier_weights(overwrite_embed_tokens=True)`, runs its
  `forward(..., ttt_steps=3)` with eager attention and compares the logits of each step.
The same for DFlash and DSpark: `reference OUT dflash=DIR dspark=DIR` exports those trained
checkpoints (default: the shipped ones when they have the published layer, `qk_norm` and
`mask_token_id`; else a seeded random drafter of that layer for SmolLM2 with a reduced draft
vocabulary) and checks the round trip on our side (export -> import: the same weights, and the
same greedy tokens as `ar` through both directories, a `ROUNDTRIP` line);
`check` validates the config (`DFlashSpeculatorConfig` / `DSparkSpeculatorConfig`), loads the
weights into `DFlashDraftModel` / `DSparkDraftModel` unchanged, runs its training forward on the
target's features with one anchor (eager attention) and compares the block's draft logits (DSpark:
with the Markov bias given the block's tokens, and the confidence logits) with ours.
Prints one `CONFORMANCE ...` line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

PROMPT = "Write a Python function that reverses a string, then explain how it works."
STEPS = 3
MASK_ID = 3  # a SmolLM2 special token that never occurs in chat text


def reference(out: Path, drafters: dict | None = None) -> None:
    drafters = drafters or {}
    from safetensors.torch import save_file

    from specdecode.drafters.checkpoint import SHIPPED_ROOT
    from specdecode.drafters.eagle.model import Eagle3, EagleConfig, ttt_forward
    from specdecode.interop import export_drafter, import_drafter
    from specdecode.interop.common import sorted_vocab
    from specdecode.models.loader import load_model

    target = load_model("smollm2-135m", dtype="fp32", device="cpu")
    src = SHIPPED_ROOT / "smollm2-135m-eagle"
    export_drafter(src, out / "export", verifier_name_or_path=str(target.path))
    _, arch, state = import_drafter(src, target)
    net = Eagle3(EagleConfig.from_json(arch))
    net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    net.eval()
    ids = torch.tensor(target.tokenizer(PROMPT)["input_ids"])[None]  # [1, T]
    T = ids.shape[1]
    cache = target.model.new_cache(1, T + 1)
    layers = list(arch["feature_layers"])
    hidden = target.model.prefill(ids, cache, [0], capture=layers).hidden
    feats = torch.cat([hidden[i] for i in layers], dim=-1).float()  # [1, T, 3d]
    with torch.no_grad():
        outs = ttt_forward(net, target.model.embed, feats, ids, torch.tensor([T]), STEPS)
        logits = torch.stack([net.logits(o)[0] for o in outs])  # [STEPS, T, Vd]
    perm = sorted_vocab(state["d2t"])
    save_file(
        {
            "feats": feats.contiguous(),
            "row_ids": torch.nn.functional.pad(ids[:, 1:], (0, 1)).contiguous(),  # x_{t+1} per row
            "logits": logits[..., perm].contiguous(),
        },
        str(out / "reference.safetensors"),
    )
    print(f"REFERENCE written: T={T} steps={STEPS} Vd={logits.shape[-1]} -> {out}")
    for method in ("dflash", "dspark"):
        dflash_reference(target, ids, out, method, drafters)


def dflash_reference(target, ids, out: Path, method: str, drafters: dict) -> None:
    """The shipped DFlash / DSpark when it has the published layer (qk_norm, mask_token_id), else
    a seeded random one (Vd = 8192), its speculators export, and our logits for one block at
    anchor a (context rows < a)."""
    from safetensors.torch import save_file

    from specdecode.drafters.checkpoint import SHIPPED_ROOT, save_checkpoint
    from specdecode.drafters.dflash.model import DFlash, DFlashConfig, t2d_table
    from specdecode.drafters.dspark.model import DSpark
    from specdecode.interop import export_drafter, import_drafter
    from specdecode.interop.common import sorted_vocab

    info, V = target.model.info, target.model.info.vocab_size
    given = drafters.get(method) or SHIPPED_ROOT / f"smollm2-135m-{method}"
    arch = json.loads((Path(given) / "config.json").read_text())["arch"]
    if arch.get("qk_norm") and arch.get("mask_token_id") is not None:  # a drafter that exports
        _, arch, state = import_drafter(given, target)
        cfg = DFlashConfig.from_json(arch)
        net = (DSpark if method == "dspark" else DFlash)(cfg)
        net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        src, which = Path(given), f"trained drafter {Path(given).name}"
    else:  # the shipped one predates the published layer: a seeded random one of that layer
        kw = {"layout": "dspark", "markov_rank": 64, "block_size": 7} if method == "dspark" else {}
        cfg = DFlashConfig.for_target(info, target.config, 8192, qk_norm=True, mask_token_id=MASK_ID, **kw)
        net = (DSpark if method == "dspark" else DFlash)(cfg)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(("norm" in name) + 0.05 * torch.randn(p.shape, generator=g))
            net.d2t.copy_(torch.randperm(V, generator=g)[:8192])
        src = save_checkpoint(
            out / f"ours-{method}", method, cfg.to_json(), net.state_dict(), target, dtype=torch.float32
        )
        which = "a seeded random drafter"
    net.eval()
    export_drafter(src, out / f"export-{method}", verifier_name_or_path=str(target.path))
    T, B = ids.shape[1], cfg.block_size
    a = T - B - 1  # the anchor: a whole block fits before the end
    layers = list(cfg.feature_layers)
    hidden = target.model.prefill(ids, target.model.new_cache(1, T + 1), [0], capture=layers).hidden
    feats = torch.cat([hidden[i] for i in layers], dim=-1).float()  # [1, T, 5d]
    embed = target.model.embed
    with torch.no_grad():
        kv = net.context_kv(net.fuse(feats), torch.arange(T)[None])
        block = net.block_input(embed(ids[:, a : a + 1]), net.mask_vector(embed))  # [1, 1, B, d]
        visible = (torch.arange(T) < a)[None, None]
        states = net.block_states(block, (a + torch.arange(B))[None, None], kv, visible)[0, 0]  # [B, d]
        logits = net.logits(states, target.model.lm_head_weight().float()[net.d2t])  # [B, Vd]
        extra = {}
        if method == "dspark":
            prev = t2d_table(net.d2t, V)[ids[0, a : a + B]]  # the block's own tokens, as theirs
            logits = net.markov_logits(logits, prev)
            extra["confidence"] = net.confidence_logit(states, prev).contiguous()
    perm = sorted_vocab(net.d2t)
    save_file(
        {
            "feats": feats.contiguous(),
            "ids": ids.contiguous(),
            "logits": logits[:, perm].contiguous(),
            **extra,
        },
        str(out / f"reference-{method}.safetensors"),
        metadata={"anchor": str(a)},
    )
    print(f"REFERENCE {method} written ({which}): T={T} anchor={a} block={B}")
    round_trip(target, src, out / f"export-{method}", method)


def round_trip(target, src: Path, exported: Path, method: str) -> None:
    """Export -> import: the same drafter logits on the target's features, and the same greedy
    tokens (fixed K) through our directory and through the exported one."""
    from specdecode.build import LoadOptions, build
    from specdecode.interop import import_drafter

    _, a0, s0 = import_drafter(src, target)
    _, a1, s1 = import_drafter(exported, target)
    diff = max(
        float((s0[k].float() - s1[k].float()).abs().max())
        for k in s0
        if k in s1 and s0[k].is_floating_point()
    )
    missing = sorted(set(s0) ^ set(s1))

    def greedy(drafter):
        opts = LoadOptions(
            target=target, method=method, drafter=str(drafter), policy="fixed", num_draft_tokens=4
        )
        return build(opts).generate(PROMPT, max_new_tokens=48, temperature=0.0).token_ids

    ar = build(LoadOptions(target=target, method="ar")).generate(PROMPT, max_new_tokens=48, temperature=0.0)
    same = greedy(src) == greedy(exported) == ar.token_ids
    line = (
        f"{method}: weights max |diff| {diff:.2e} over {len(s0)} tensors (keys differing: {missing}); "
        f"greedy 48 tokens via ours == via export == ar: {same}"
    )
    if missing or diff > 0 or not same:
        sys.exit(f"ROUNDTRIP FAIL {line}")
    print(f"ROUNDTRIP OK {line}")


def check(out: Path) -> None:
    from safetensors.torch import load_file
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    export = out / "export"
    ref = load_file(str(out / "reference.safetensors"))
    cfg = SpeculatorModelConfig.from_pretrained(str(export))
    if type(cfg) is not Eagle3SpeculatorConfig:
        sys.exit(f"CONFORMANCE FAIL config: {type(cfg).__name__} is not Eagle3SpeculatorConfig")
    print(
        f"CONFORMANCE OK config: {type(cfg).__name__} speculators_model_type={cfg.speculators_model_type} "
        f"layer={type(cfg.transformer_layer_config).__name__} draft_vocab_size={cfg.draft_vocab_size} "
        f"aux_layers={cfg.eagle_aux_hidden_state_layer_ids} "
        f"speculative_tokens={cfg.speculators_config.proposal_methods[0].speculative_tokens}"
    )
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU
    model = Eagle3DraftModel.from_pretrained(str(export), config=cfg, dtype=torch.float32).eval()
    stored = load_file(str(export / "model.safetensors"))
    params = model.state_dict()
    missing = sorted(set(stored) - set(params))
    changed = [k for k, v in stored.items() if k in params and not torch.equal(params[k].to(v.dtype), v)]
    unfilled = sorted(set(params) - set(stored))
    if missing or changed:
        sys.exit(f"CONFORMANCE FAIL weights: unknown {missing}, not loaded as stored {changed}")
    print(f"CONFORMANCE OK weights: {len(stored)} tensors load unchanged; from the verifier: {unfilled}")
    # The export stores no embedding (vLLM shares the target's). speculators' public
    # load_verifier_weights() fills it only when it is NaN, but from_pretrained under
    # transformers 5.19 initialises missing tensors to zeros, so ask for the overwrite.
    zeros = bool((model.embed_tokens.weight == 0).all())
    model._load_verifier_weights(overwrite_embed_tokens=True)
    if model.embed_tokens.weight.isnan().any() or model.lm_head.weight.isnan().any():
        sys.exit("CONFORMANCE FAIL verifier weights: embedding or head left uninitialised")
    print(f"CONFORMANCE OK embedding from the verifier (all zeros after from_pretrained: {zeros})")
    captured: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda mod, inp, o: captured.append(o.detach()))
    T = ref["feats"].shape[1]
    with torch.no_grad():
        model(
            hidden_states=ref["feats"],
            input_ids=ref["row_ids"],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            ttt_steps=len(ref["logits"]),
        )
    worst, same = 0.0, []
    for j, theirs in enumerate(captured):
        ours = ref["logits"][j]
        worst = max(worst, float((theirs[0] - ours).abs().max()))
        same.append(float((theirs[0].argmax(-1) == ours.argmax(-1)).float().mean()))
    ok = len(captured) == len(ref["logits"]) and worst < 1e-3 and min(same) == 1.0
    line = f"draft logits over {T} rows x {len(captured)} TTT steps: max |diff| {worst:.2e}, "
    line += f"argmax agreement {same}"
    if not ok:
        sys.exit(f"CONFORMANCE FAIL {line}")
    print(f"CONFORMANCE OK {line}")
    for method in ("dflash", "dspark"):
        check_dflash(out, method)


def check_dflash(out: Path, method: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file
    from speculators import SpeculatorModelConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    export = out / f"export-{method}"
    ref_path = out / f"reference-{method}.safetensors"
    ref = load_file(str(ref_path))
    with safe_open(str(ref_path), framework="pt") as f:
        a = int(f.metadata()["anchor"])
    want = DFlashSpeculatorConfig if method == "dflash" else DSparkSpeculatorConfig
    cfg = SpeculatorModelConfig.from_pretrained(str(export))
    if type(cfg) is not want:
        sys.exit(f"CONFORMANCE FAIL {method} config: {type(cfg).__name__} is not {want.__name__}")
    print(
        f"CONFORMANCE OK {method} config: {type(cfg).__name__} "
        f"layer={type(cfg.transformer_layer_config).__name__} block_size={cfg.block_size} "
        f"mask_token_id={cfg.mask_token_id} aux_layers={cfg.aux_hidden_state_layer_ids} "
        f"sample_from_anchor={cfg.sample_from_anchor} draft_vocab_size={cfg.draft_vocab_size}"
    )
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU
    cls = DFlashDraftModel if method == "dflash" else DSparkDraftModel
    model = cls.from_pretrained(str(export), config=cfg, dtype=torch.float32).eval()
    stored = load_file(str(export / "model.safetensors"))
    params = model.state_dict()
    missing = sorted(set(stored) - set(params))
    changed = [k for k, v in stored.items() if k in params and not torch.equal(params[k].to(v.dtype), v)]
    if missing or changed:
        sys.exit(f"CONFORMANCE FAIL {method} weights: unknown {missing}, not loaded as stored {changed}")
    model._load_verifier_weights(overwrite_embed_tokens=True)
    if model.embed_tokens.weight.isnan().any() or model.lm_head.weight.isnan().any():
        sys.exit(f"CONFORMANCE FAIL {method} verifier weights: embedding or head left uninitialised")
    print(
        f"CONFORMANCE OK {method} weights: {len(stored)} tensors load unchanged (embedding from the verifier)"
    )
    got: dict[str, torch.Tensor] = {}
    model.lm_head.register_forward_hook(lambda mod, inp, o: got.__setitem__("logits", o.detach()))
    model.norm.register_forward_hook(lambda mod, inp, o: got.__setitem__("hidden", o.detach()))
    if method == "dspark":
        model.confidence_head.register_forward_hook(lambda mod, inp, o: got.__setitem__("conf", o.detach()))
    feats, ids = ref["feats"], ref["ids"]
    T, B = ids.shape[1], cfg.block_size
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, a] = 1  # one anchor candidate: a
    from speculators.losses import resolve_loss_config

    losses = {"loss_config": resolve_loss_config("kl_div", "eager")}  # the fused ones need Triton
    if method == "dspark":
        losses["tv_loss_fn"] = resolve_loss_config("tv", "eager")["tv"][0]
    with torch.no_grad():
        model(
            **losses,
            hidden_states=feats,
            input_ids=ids,
            loss_mask=loss_mask,
            verifier_last_hidden_states=torch.zeros(
                1, T, feats.shape[-1] // len(cfg.aux_hidden_state_layer_ids)
            ),
            document_ids=torch.zeros(1, T, dtype=torch.long),
            max_anchors=1,
        )
    theirs = got["logits"][0]  # [B, Vd]
    if method == "dspark":
        bias = model.markov_head.block_bias(
            prev_token_ids=ids[:, a : a + B], hidden_states=got["hidden"].view(1, B, -1)
        )
        theirs = theirs + bias[0]
    worst = float((theirs - ref["logits"]).abs().max())
    same = float((theirs.argmax(-1) == ref["logits"].argmax(-1)).float().mean())
    line = f"{method} draft logits over a block of {B}: max |diff| {worst:.2e}, argmax agreement {same}"
    if method == "dspark":
        cdiff = float((got["conf"].reshape(-1) - ref["confidence"]).abs().max())
        line += f", confidence logits max |diff| {cdiff:.2e}"
        worst = max(worst, cdiff)
    if worst > 1e-3 or same < 1.0:
        sys.exit(f"CONFORMANCE FAIL {line}")
    print(f"CONFORMANCE OK {line}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("reference", "check"):
        sys.exit(
            "usage: speculators_conformance.py reference OUT_DIR [dflash=DIR] [dspark=DIR] | check OUT_DIR"
        )
    torch.manual_seed(0)
    if sys.argv[1] == "check":
        check(Path(sys.argv[2]))
    else:
        reference(Path(sys.argv[2]), dict(arg.split("=", 1) for arg in sys.argv[3:]))
