"""Drafter checkpoints: int8 weight storage (per-row scales) halves the bytes, loads back within half
a quantization step, and an int8 drafter stays lossless in the real loop."""

import contextlib
import json

import pytest
import torch
from fakes import decode_fixed_k, short_prompts
from safetensors import safe_open

from specdecode.drafters import build_drafter, checkpoint
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.checkpoint import (
    SCALE,
    dequantize_int8,
    quantize_int8,
    read_weights,
    save_checkpoint,
    write_checkpoint,
)
from specdecode.drafters.layers import cpu_plan
from specdecode.errors import SpecDecodeError
from specdecode.interop import export_drafter
from specdecode.models import formats, kernels
from specdecode.models.formats import BUCKETS, FormatPlan


def test_int8_rows_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of every scale
    w[5] = 0.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] * 0.5 + 1e-7).all()
    assert (dequantize_int8(q, scale)[5] == 0).all()
    # each row uses the full range: its largest entry maps to +-127
    assert (q.abs().amax(dim=1)[torch.arange(64) != 5] == 127).all()


def test_int8_storage_halves_the_file_and_loads_back(tiny, tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {
        "big.weight": torch.randn(300, 256, generator=g),  # >= INT8_MIN_NUMEL: stored as int8
        "norm.weight": torch.randn(256, generator=g),  # small: stays bf16
        "ids": torch.arange(10),
    }
    a = save_checkpoint(tmp_path / "bf16", "eagle", {}, state, tiny)
    b = save_checkpoint(tmp_path / "int8", "eagle", {}, state, tiny, storage="int8")
    assert (b / "model.safetensors").stat().st_size < 0.6 * (a / "model.safetensors").stat().st_size
    assert json.loads((b / "config.json").read_text())["storage"] == "int8"
    with safe_open(str(b / "model.safetensors"), "pt") as f:
        assert f.get_tensor("big.weight").dtype == torch.int8 and "big.weight" + SCALE in f.keys()
    wa, wb = read_weights(a), read_weights(b)
    assert set(wb) == set(state)  # the scales are not part of the state dict
    assert torch.equal(wa["norm.weight"], wb["norm.weight"]) and torch.equal(wb["ids"], state["ids"])
    assert wb["big.weight"].dtype == torch.bfloat16  # dequantized into the file's float format
    step = state["big.weight"].abs().amax(dim=1, keepdim=True) / 127
    w = state["big.weight"]
    assert ((wb["big.weight"].float() - w).abs() <= step * 0.5 + w.abs() * 2**-8 + 1e-6).all()  # + bf16
    exact = read_weights(b, int8_as=torch.float32)["big.weight"]  # q * scale unrounded
    with safe_open(str(b / "model.safetensors"), "pt") as f:
        q = f.get_tensor("big.weight")
    assert torch.equal(formats.int8_quantize(exact)[0], q)  # the stored integers back
    assert not torch.equal(formats.int8_quantize(wb["big.weight"])[0], q)  # bf16 moved some
    with pytest.raises(SpecDecodeError, match="unknown weight storage"):
        save_checkpoint(tmp_path / "x", "eagle", {}, state, tiny, storage="int4")


@pytest.mark.parametrize("int8w", [False, True])
@pytest.mark.parametrize("method", ["eagle", "dspark", "mtp"])
def test_int8_export_of_a_trained_drafter_stays_exact(tiny, trained, method, int8w, tmp_path, monkeypatch):
    """An int8-stored drafter is lossless and still drafts, in the target's formats and in its own
    int8 weights (`int8w` for products of up to DRAFT_ROWS rows: the integers the file holds)."""
    monkeypatch.setattr(checkpoint, "INT8_MIN_NUMEL", 1)  # the tiny drafter's matrices are small
    src, _ = trained(method)
    out = export_drafter(src, tmp_path / "int8", fmt="specdecode", storage="int8")
    # stored as the shipped drafters are: int8 matrices beside bf16 norms (bf16 would round q * scale)
    write_checkpoint(out, checkpoint.read_config(out), read_weights(out), torch.bfloat16, "int8")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert any(v.dtype == torch.bfloat16 for v in stored.values())
    assert any(v.dtype == torch.int8 for v in stored.values())
    if kernels.fused() is None and int8w:
        pytest.skip(f"our kernels are not available here: {kernels.unavailable.get('cpu')}")
    if kernels.fused() is not None:  # the drafter's plan measured as int8w; in_target_formats skips it
        small = [i for i, m in enumerate(BUCKETS) if m <= formats.DRAFT_ROWS]

        def int8w_plan(base, shapes, device):
            return FormatPlan(tuple("int8w" if i in small else k for i, k in enumerate(base.kernels))), {}

        monkeypatch.setattr(checkpoint, "int8_drafter_plan", int8w_plan)
    prompts = short_prompts(tiny.tokenizer)
    ar = decode_fixed_k(tiny, ARDrafter(), 0, prompts)
    with contextlib.nullcontext() if int8w else checkpoint.in_target_formats():  # else: the target's
        if not int8w:  # leaving a nested context keeps the outer one's setting
            with checkpoint.in_target_formats():
                pass
        drafter = build_drafter(method, tiny, str(out))
    net = drafter.net
    assert ("int8w" in net.formats_plan.kernels) == int8w
    head = {"dspark": lambda: drafter.head and drafter.head.product, "mtp": lambda: drafter._head}.get(method)
    if head is not None and cpu_plan(tiny) is not None:  # the target's head rows: in the target's plan
        assert head().kernels == cpu_plan(tiny).kernels
    for name, lin in net.named_modules():  # every matrix loads as the file's integers times scales
        key = name + ".weight"
        if key + SCALE in stored:
            assert torch.equal(lin.weight, dequantize_int8(stored[key], stored[key + SCALE])), name
            assert torch.equal(formats.int8_quantize(lin.weight)[0], stored[key]), name
    sd = decode_fixed_k(tiny, drafter, 3, prompts)
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    assert sum(r.tau for r in sd) / len(sd) > 1.2  # still a drafter, not noise
    with pytest.raises(SpecDecodeError, match="--format specdecode"):
        export_drafter(src, tmp_path / "s", fmt="speculators", storage="int8")
