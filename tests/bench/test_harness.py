"""`specdecode bench` end to end on a tiny model: rows, report, plots, resume, bad input."""

import json

import pytest

from specdecode.bench.harness import BenchConfig, run_bench
from specdecode.bench.report import _interval_lines, acceptance_by_position, median_ci, summarize
from specdecode.cli import main
from specdecode.errors import SpecDecodeError


def _cfg(tiny_llama_dir, out, **kw):
    base = dict(
        target=str(tiny_llama_dir),
        methods=["ngram"],
        datasets="chat,code",
        limit=2,
        temperatures=[0.0, 1.0],
        batch_sizes=[1, 2],
        max_new_tokens=6,
        dtype="fp32",
        device="cpu",
        policy="fixed",
        num_draft_tokens=3,
        out=str(out),
    )
    base.update(kw)
    return BenchConfig(**base)


def test_bench_writes_rows_report_plots_and_resumes(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench"
    run_bench(_cfg(tiny_llama_dir, out), progress=False)
    data = json.loads((out / "results.json").read_text())
    rows = data["runs"]
    # 2 methods (ar added) x 2 categories x 2 prompts x 2 temperatures x 2 batch sizes
    assert len(rows) == 2 * 4 * 2 * 2
    assert {r["method"] for r in rows} == {"ar", "ngram"}
    for r in rows:
        assert r["num_new_tokens"] >= 1 and r["decode_time_s"] > 0 and r["tau"] >= 1.0
        assert r["prefill_time_s"] >= 0 and r["peak_rss_MB"] > 0
    assert data["meta"]["bandwidth_GBps"] > 0 and data["meta"]["ar_ceiling_tokens_per_s"] > 0
    end = data["meta"]["bandwidth_end_GBps"]
    assert end > 0
    report = (out / "report.md").read_text()
    assert f"At the end of the run it read {end:.1f} GB/s" in report
    assert "## T = 0.0, batch 1" in report and "## T = 1.0, batch 2" in report and "geo-mean" in report
    assert "Hardware limit" in report and "Per-position conditional acceptance" in report
    for name in ["speedup_T0.0_B1.png", "acceptance_T1.0.png", "time_share.png"]:
        assert (out / name).stat().st_size > 1000
    # A second run with the same settings finds every run done and adds nothing.
    mtime = (out / "results.json").stat().st_mtime_ns
    run_bench(_cfg(tiny_llama_dir, out), progress=False)
    assert len(json.loads((out / "results.json").read_text())["runs"]) == len(rows)
    assert (out / "results.json").stat().st_mtime_ns >= mtime
    with pytest.raises(SpecDecodeError, match="other settings"):
        run_bench(_cfg(tiny_llama_dir, out, max_new_tokens=7), progress=False)


def test_resume_after_interruption(tiny_llama_dir, tmp_path, monkeypatch):
    """A results file holding part of the runs is completed, not restarted."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench"
    cfg = _cfg(tiny_llama_dir, out, temperatures=[0.0], batch_sizes=[1])
    run_bench(cfg, progress=False)
    data = json.loads((out / "results.json").read_text())
    full = len(data["runs"])
    kept = data["runs"][: full // 2]
    data["runs"] = kept
    (out / "results.json").write_text(json.dumps(data))
    run_bench(cfg, progress=False)
    rows = json.loads((out / "results.json").read_text())["runs"]
    assert len(rows) == full and rows[: len(kept)] == kept


def test_summary_math():
    rows = [
        {
            "method": "ar",
            "category": "c",
            "prompt_id": "p",
            "temperature": 0.0,
            "batch": 1,
            "repeat": 0,
            "tokens_per_s": 10.0,
            "tau": 1.0,
        },
        {
            "method": "x",
            "category": "c",
            "prompt_id": "p",
            "temperature": 0.0,
            "batch": 1,
            "repeat": 0,
            "tokens_per_s": 25.0,
            "tau": 3.0,
            "accepted_per_position": [3, 1],
            "reached_per_position": [4, 3],
        },
    ]
    s = summarize(rows)[(0.0, 1)]
    assert s["x"]["c"]["speedup"] == 2.5 and s["x"]["all"]["speedup"] == pytest.approx(2.5)
    assert acceptance_by_position(rows, "x", 0.0) == [0.75, pytest.approx(1 / 3)]


def test_median_ci_is_the_order_statistics_interval():
    xs = [1.1, 0.9, 1.0, 0.95, 1.02, 0.97, 1.05, 0.99]
    # n = 8 at 90 %: the 2nd and 7th smallest (the sign test's interval, coverage 0.93)
    assert median_ci(xs) == (0.95, 1.05)
    assert median_ci(xs[:4]) is None  # four ratios cannot give a 90 % interval


def _ratio_rows(method, category, ratios):
    rows = []
    for i, r in enumerate(ratios):
        key = dict(category=category, prompt_id=f"{category}{i}", temperature=0.0, batch=1, repeat=0)
        rows.append(dict(method="ar", tokens_per_s=10.0, tau=1.0, **key))
        rows.append(dict(method=method, tokens_per_s=10.0 * r, tau=1.1, **key))
    return rows


def test_report_tells_cells_below_the_line_from_cells_within_noise_of_it():
    rows = _ratio_rows("slow", "chat", [0.80, 0.85, 0.86, 0.88, 0.90, 0.91, 0.92, 0.93])
    rows += _ratio_rows("noisy", "code", [0.80, 0.88, 0.90, 0.93, 0.95, 1.00, 1.05, 1.10])
    rows += _ratio_rows("fast", "math", [1.2] * 8)
    per = summarize(rows)[(0.0, 1)]
    assert per["slow"]["chat"]["ci"] == pytest.approx((0.85, 0.92))
    text = "\n".join(_interval_lines(per, ["ar", "slow", "noisy", "fast"], ["chat", "code", "math"]))
    assert "Below 0.95x with 90% confidence: slow on chat (0.89x, 0.85-0.92)." in text
    assert "interval reaching above it: noisy on code (0.94x, 0.88-1.05)." in text
    assert "fast" in text and "fast on" not in text  # a row of intervals, named below no line


@pytest.mark.parametrize(
    "args, match",
    [
        (["--methods", "ar,warp"], "unknown method"),
        (["--datasets", "poetry"], "poetry"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--peers", "vllm"], "unknown peer"),
        (["--drafter", "draft"], "METHOD=MODEL"),
        (["--peers", "hf-assisted"], "needs the draft model"),
    ],
)
def test_bad_bench_input(capsys, tmp_path, tiny_llama_dir, args, match):
    code = main(["bench", "--target", str(tiny_llama_dir), "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "Traceback" not in err


def test_transformers_peer_rows(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench"
    cfg = _cfg(
        tiny_llama_dir, out, datasets="chat", limit=1, temperatures=[0.0], batch_sizes=[1], peers=["hf"]
    )
    run_bench(cfg, progress=False)
    rows = json.loads((out / "results.json").read_text())["runs"]
    hf = [r for r in rows if r["method"] == "hf"]
    assert len(hf) == 1 and hf[0]["num_new_tokens"] >= 1 and hf[0]["tokens_per_s"] > 0
    assert "| hf |" in (out / "report.md").read_text()
