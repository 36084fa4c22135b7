from specdecode.drafters import build_drafter
from specdecode.models.loader import load_model


def test_draft_model_carries_its_fingerprint_for_the_cost_profile(tiny_llama_dir, tiny_qwen2_dir):
    target = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    drafter = build_drafter("draft", target, str(tiny_qwen2_dir), dtype="fp32", device="cpu")
    assert drafter.fingerprint == load_model(str(tiny_qwen2_dir), dtype="fp32", device="cpu").fingerprint
    assert drafter.fingerprint != target.fingerprint


def test_drafter_dtype_follows_the_targets_measured_formats():
    """A bf16 target's drafter runs bf16 only where the target's plan multiplies 8 rows in bf16
    (read from the measured plan, never from CPU flags); fp32 targets keep fp32 drafters."""
    from types import SimpleNamespace

    import torch

    from specdecode.drafters.checkpoint import drafter_dtype
    from specdecode.models.formats import BUCKETS, FormatPlan

    def target(dtype, kernels):
        info = SimpleNamespace(device=torch.device("cpu"), dtype=dtype)
        return SimpleNamespace(model=SimpleNamespace(info=info, plan=FormatPlan(tuple(kernels))))

    n = len(BUCKETS)
    amx_like = target(torch.bfloat16, ["bf16"] * n)
    avx2_auto = target(torch.bfloat16, ["bf16", "bf16"] + ["fp32-onednn"] * (n - 2))
    assert drafter_dtype(amx_like) == torch.bfloat16
    assert drafter_dtype(avx2_auto) == torch.float32
    assert drafter_dtype(target(torch.float32, ["fp32"] * n)) == torch.float32
