"""Conformance with the vLLM `speculators` package (issue 16, part 3): our export validates against
its config classes, loads into its Eagle3DraftModel / DFlashDraftModel / DSparkDraftModel unchanged
and gives our draft logits.

speculators 0.9.0 pins transformers <= 5.19 (we pin 5.24), so it lives in .venv-speculators
(docs/interop.md): the first test runs wherever both import; the second runs
scripts/check_speculators.sh across the two environments when .venv-speculators exists."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "speculators_conformance.py"


def _script():
    spec = importlib.util.spec_from_file_location("speculators_conformance", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_conformance_in_process(tmp_path, smollm2_dir, capsys):
    pytest.importorskip("speculators")
    mod = _script()
    mod.reference(tmp_path)
    mod.check(tmp_path)  # exits non-zero on the first failed check
    out = capsys.readouterr().out
    assert "CONFORMANCE OK draft logits" in out and "FAIL" not in out


@pytest.mark.slow
@pytest.mark.skipif(
    not (ROOT / ".venv-speculators" / "bin" / "python").exists(),
    reason="no .venv-speculators (docs/interop.md)",
)
def test_check_speculators_script(tmp_path, smollm2_dir):
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_speculators.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    checks = ("OK config: Eagle3SpeculatorConfig", "OK weights: 15 tensors load unchanged", "OK draft logits")
    checks += ("OK dflash config: DFlashSpeculatorConfig", "OK dflash draft logits")
    checks += ("OK dspark config: DSparkSpeculatorConfig", "OK dspark draft logits")
    for check in checks:
        assert f"CONFORMANCE {check}" in out, out[-3000:]
    assert "argmax agreement [1.0, 1.0, 1.0]" in out and "FAIL" not in out
    assert "ROUNDTRIP OK dflash" in out and "ROUNDTRIP OK dspark" in out  # export -> import, our side
