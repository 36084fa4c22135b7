"""specdecode.bench.paired: the paired runs' order and warm-up, and the rows drawn from them."""

from types import SimpleNamespace

import pytest

from specdecode.bench.paired import paired_rows, paired_runs, paired_table


class _Decoder:
    """Records the order it is called in; `seconds` per token, `tau` tokens per step."""

    def __init__(self, name, log, seconds, tau):
        self.name, self.log, self.seconds, self.tau = name, log, seconds, tau

    def generate(self, reqs):
        (req,) = reqs
        self.log.append((self.name, req.seed))
        n = 10
        steps = round(n / self.tau)
        return [
            SimpleNamespace(
                decode_time_s=self.seconds * n,
                num_new_tokens=n,
                tau=self.tau,
                num_steps=steps,
                num_drafted=2 * steps,
            )
        ]


def test_paired_runs_alternate_the_order_and_drop_the_warm_up():
    log = []
    decoders = {"ar": _Decoder("ar", log, 0.02, 1.0), "x": _Decoder("x", log, 0.01, 2.0)}
    runs = paired_runs(decoders, [("code", [1, 2]), ("chat", [3])], 0.0, 10, repeats=2)
    # 3 passes (one warm-up) x 2 prompts x 2 decoders; the order flips every pass
    assert [n for n, _ in log[:4]] == ["ar", "x", "ar", "x"]
    assert [n for n, _ in log[4:8]] == ["x", "ar", "x", "ar"]
    assert len(log) == 12
    # the same seed for every decoder of a prompt and pass
    assert {s for n, s in log[:2]} == {0} and {s for n, s in log[4:6]} == {1000}
    assert len(runs[("x", "code")]) == 2  # the warm-up pass is not kept
    assert runs[("x", "code")][0] == pytest.approx((0.01, 2.0, 2.0))


def test_paired_rows_give_the_median_paired_speedup_per_category():
    runs = {
        ("ar", "code"): [(0.03, 1.0, 0.0), (0.02, 1.0, 0.0), (0.04, 1.0, 0.0)],
        ("x", "code"): [(0.01, 2.0, 1.0), (0.02, 1.0, 3.0), (0.04, 3.0, 2.0)],
    }
    (row,) = paired_rows(runs, ["code"])
    # paired ratios 3, 1, 1: median 1 (the ratio of the medians would read 0.03 / 0.02 = 1.5)
    assert row == pytest.approx(
        {"category": "code", "decoder": "x", "speedup": 1.0, "tau": 2.0, "drafts": 2.0}
    )
    table = paired_table([row], "drafter")
    assert table[0].startswith("| category | drafter |") and table[2] == "| code | x | 1.000x | 2.00 | 2.00 |"


def test_the_report_names_the_setting_and_the_command_that_reruns_it(tmp_path):
    import argparse
    import json

    from specdecode.bench.paired import write_paired_report

    args = argparse.Namespace(temperature=0.0, max_new_tokens=96, limit=6, repeats=2, k=6, seed=None, out="x")
    row = {"category": "code", "decoder": "x", "speedup": 1.25, "tau": 1.5, "drafts": 1.0}
    write_paired_report(tmp_path, "Title", "ab.py", args, "CPU", ", fixed K 6 policy", [row], "drafter")
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# Title\n")
    assert "order alternating), fixed K 6 policy. Speed-up" in text
    cmd = "python benchmarks/ab.py --temperature 0.0 --max-new-tokens 96 --limit 6 --repeats 2 --k 6"
    assert f"Command: `{cmd}`" in text and "| code | x | 1.250x | 1.50 | 1.00 |" in text
    assert json.loads((tmp_path / "results.json").read_text()) == {"command": cmd, "rows": [row]}


def test_paired_scripts_share_their_options():
    import argparse

    import pytest

    from specdecode.bench.paired import add_paired_arguments

    ap = argparse.ArgumentParser()
    add_paired_arguments(ap, datasets="code,chat", limit=4, temperature=1.0)
    a = ap.parse_args(["--out", "d", "--limit", "2"])
    assert (a.target, a.datasets, a.limit, a.temperature, a.max_new_tokens, a.repeats, a.out) == (
        "smollm2-135m", "code,chat", 2, 1.0, 96, 2, "d",
    )  # fmt: skip
    with pytest.raises(SystemExit):  # --out is required
        ap.parse_args([])
