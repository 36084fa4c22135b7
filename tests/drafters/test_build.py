from specdecode.drafters import build_drafter
from specdecode.models.loader import load_model


def test_draft_model_carries_its_fingerprint_for_the_cost_profile(tiny_llama_dir, tiny_qwen2_dir):
    target = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    drafter = build_drafter("draft", target, str(tiny_qwen2_dir), dtype="fp32", device="cpu")
    assert drafter.fingerprint == load_model(str(tiny_qwen2_dir), dtype="fp32", device="cpu").fingerprint
    assert drafter.fingerprint != target.fingerprint
