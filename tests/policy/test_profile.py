import json

from specdecode.models.loader import load_model
from specdecode.policy.profile import measure_step_costs, step_costs


def test_step_costs_are_measured_once_and_cached(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    m = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    costs = step_costs(m.model, m.fingerprint, 4)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1
    # A cached profile is reused as is (no re-measurement): plant known numbers and read them back.
    files[0].write_text(json.dumps({"costs": [1.0, 2.0, 3.0, 4.0, 5.0]}))
    assert step_costs(m.model, m.fingerprint, 3) == [1.0, 2.0, 3.0]
    # Asking for more tokens than cached measures again.
    assert len(step_costs(m.model, m.fingerprint, 6)) == 6


def test_measure_leaves_no_state(tiny_llama_dir):
    m = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    assert len(measure_step_costs(m.model, 2, repeats=1)) == 2
