"""The interop layouts as users reach them: `--drafter FOREIGN_DIR` through `build()` and the
`specdecode export` command."""

import json

import pytest

from specdecode.build import LoadOptions, build, native_drafter
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.interop import write_native

PROMPT = "def add(a, b):"
LAYERS = {"eagle_aux_hidden_state_layer_ids": [1, 2, 0]}


def _greedy(tiny, method, drafter=None):
    opts = LoadOptions(target=tiny, method=method, drafter=drafter, policy="fixed", num_draft_tokens=3)
    res = build(opts).generate(PROMPT, max_new_tokens=20, temperature=0.0)
    return res.token_ids, res.num_steps


def test_a_foreign_drafter_dir_decodes_as_its_native_copy(tiny, specforge_dir, tmp_path):
    src = specforge_dir(eagle_config=LAYERS)
    native = write_native(src, tiny, tmp_path / "native")
    via_foreign, steps_foreign = _greedy(tiny, "eagle", str(src))
    via_native, steps_native = _greedy(tiny, "eagle", str(native))
    assert via_foreign == via_native == _greedy(tiny, "ar")[0]  # lossless, and the same drafter
    assert steps_foreign == steps_native
    converted = native_drafter(str(src), tiny)
    assert converted != str(src)
    assert json.loads((tmp_path / "native" / "config.json").read_text())["method"] == "eagle"
    assert native_drafter(converted, tiny) == converted  # our own layout is used as it is
    assert native_drafter(None, tiny) is None


def test_a_foreign_drafter_for_another_method_is_refused(tiny, specforge_dir):
    with pytest.raises(SpecDecodeError, match="'eagle' drafter, not 'dflash'"):
        build(LoadOptions(target=tiny, method="dflash", drafter=str(specforge_dir(eagle_config=LAYERS))))


def test_cli_export_writes_speculators_and_int8_and_refuses_clearly(tmp_path, capsys):
    ok = ["export", "--target", "smollm2-135m", "--method", "eagle", "--out", str(tmp_path / "e")]
    assert main(ok) == 0
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and (tmp_path / "e" / "model.safetensors").is_file()
    refused = ["export", "--target", "smollm2-135m", "--method", "dflash", "--out", str(tmp_path / "d")]
    assert main([*refused, "--format", "specforge"]) == 2  # SpecForge has no DFlash layout
    assert not (tmp_path / "d").exists()
    assert main([*refused, "--storage", "int8"]) == 2  # int8 is our own layout only
    assert "--format specdecode" in capsys.readouterr().err
    again = ["export", "--target", "smollm2-135m", "--method", "eagle", "--format", "specdecode"]
    assert main([*again, "--storage", "int8", "--out", str(tmp_path / "n")]) == 0
    assert json.loads((tmp_path / "n" / "config.json").read_text())["storage"] == "int8"
    assert main(["export", "--out", str(tmp_path / "x")]) == 2
    assert "--target and --method" in capsys.readouterr().err
