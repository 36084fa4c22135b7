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
Prints one `CONFORMANCE ...` line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

PROMPT = "Write a Python function that reverses a string, then explain how it works."
STEPS = 3


def reference(out: Path) -> None:
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
    # Why DFlash / DSpark exports are refused: the format's layer normalises q and k per head.
    from speculators.models.dflash.model_definitions import Qwen3DFlashDecoderLayer
    from transformers import Qwen3Config

    tiny = Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    norms = sorted(n for n, _ in Qwen3DFlashDecoderLayer(tiny, 0).named_parameters() if "_norm" in n)
    print(f"CONFORMANCE OK dflash/dspark refusal grounded: speculators' DFlash layer has {norms}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("reference", "check"):
        sys.exit("usage: speculators_conformance.py reference|check OUT_DIR")
    torch.manual_seed(0)
    {"reference": reference, "check": check}[sys.argv[1]](Path(sys.argv[2]))
