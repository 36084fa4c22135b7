"""Weight formats: every kernel computes the same product (within its format's rounding), plans
dispatch by rows, `auto` measures once per machine, and quantized targets stay lossless
(greedy spec == greedy ar on the quantized model)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specdecode import measured
from specdecode.config import SamplingParams
from specdecode.decode import GenerationRequest, SpeculativeDecoder
from specdecode.drafters.ar import ARDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.errors import SpecDecodeError
from specdecode.models import formats
from specdecode.models.formats import BUCKETS, KERNELS, FormatPlan, Linear, forced_plan, int4_quantize
from specdecode.models.loader import load_model
from specdecode.policy import FixedK

# Relative error of each kernel against an fp32 product (weights ~N(0, 1), 128 inputs).
TOLERANCE = {"fp32": 1e-5, "fp32-mkl": 1e-5, "fp32-onednn": 1e-5, "bf16": 2e-2, "bf16-up": 2e-2,
             "bf16-onednn": 2e-2, "bf16w": 2e-2, "bf16-amx": 2e-2, "bf16-dp": 2e-2, "bf16-dp1": 2e-2,
             "int8": 2e-2, "int8-bf16": 3e-2, "int8w": 2e-2, "int4": 0.2, "int4-bf16": 0.2}  # fmt: skip


def _available(name, w, b):
    try:
        return KERNELS[name](w, b)
    except (RuntimeError, NotImplementedError) as e:  # e.g. oneDNN bf16 packing without AVX-512
        pytest.skip(f"{name} is refused on this machine: {str(e)[:80]}")


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_every_kernel_computes_the_product(name, rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 128, generator=gen)
    fn = _available(name, w, b)
    ref = F.linear(x, w, b)
    for act in (torch.float32, torch.bfloat16):
        y = fn(x.to(act))
        assert y.dtype == act and y.shape == (rows, 96)
        err = (y.float() - ref).norm() / ref.norm()
        assert err < TOLERANCE[name] + (1e-2 if act == torch.bfloat16 else 0), (name, act, float(err))


def test_int4_matches_its_dequantized_weights():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 96, generator=gen), torch.randn(5, 96, generator=gen)
    q, sz = int4_quantize(w)
    assert q.min() >= 0 and q.max() <= 15
    scale = sz[..., 0].t().repeat_interleave(32, dim=1)  # [out, in]
    zero = sz[..., 1].t().repeat_interleave(32, dim=1)
    w_deq = (q - 8) * scale + zero
    torch.testing.assert_close(KERNELS["int4"](w, None)(x), F.linear(x, w_deq), rtol=1e-4, atol=1e-3)
    with pytest.raises(SpecDecodeError, match="divisible by 32"):
        int4_quantize(torch.randn(8, 40))


def test_plan_dispatches_by_rows_and_names_itself():
    plan = FormatPlan(("bf16",) + ("fp32",) * (len(BUCKETS) - 1))
    assert plan.act_dtype == torch.float32 and plan.name == "bf16@1,fp32@2+"
    assert forced_plan("bf16", "cpu").act_dtype == torch.bfloat16
    assert forced_plan("bf16", "cuda").kernels == ("bf16",) * len(BUCKETS)
    assert forced_plan("int8").name == "int8"
    w = torch.randn(16, 32)
    lin = Linear(w, None, plan)
    one, two = torch.randn(1, 32), torch.randn(2, 32)
    assert torch.equal(lin(one), KERNELS["bf16"](w, None)(one))  # M = 1: the bf16 copy
    assert torch.equal(lin(two), KERNELS["fp32"](w, None)(two))  # M >= 2: the fp32 weights
    assert lin(torch.randn(BUCKETS[-1] + 5, 32)).shape == (BUCKETS[-1] + 5, 16)  # past the last bucket
    with pytest.raises(SpecDecodeError, match="weight format"):
        forced_plan("fp8")
    with pytest.raises(SpecDecodeError, match="plan needs"):
        FormatPlan(("fp32",))


@pytest.mark.parametrize("name", ["bf16-amx", "bf16-dp", "bf16-dp1"])
def test_a_capped_cpu_capability_bars_our_avx512_products(name, monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (the AVX2 kind emulated) caps our kernels like PyTorch's: the AMX
    and AVX512-BF16 products are refused, so `auto` cannot pick them; the AVX2 ones stay."""
    w = torch.randn(32, 64)
    _available(name, w, None)  # skips where this CPU lacks it anyway
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.raises(RuntimeError, match="capped to AVX2"):
        KERNELS[name](w, None)
    assert formats.measure_kernels([(32, 64)], None, 1, candidates=[name, "fp32"], buckets=(1,), repeats=1)[
        name
    ] == [None]
    KERNELS["bf16w"](w, None)  # AVX2 + FMA: allowed under the cap (where the extension builds)


def test_profile_picks_the_fastest_kernel_per_bucket():
    n = len(BUCKETS)
    profile = {"fp32": [2.0] * n, "bf16": [1.0] + [3.0] * (n - 1), "fp32-mkl": [None] * n}
    assert formats.plan_from_profile(profile).kernels == ("bf16",) + ("fp32",) * (n - 1)
    with pytest.raises(SpecDecodeError, match="no weight format"):
        formats.plan_from_profile({"fp32": [None] * n})


def test_profile_keeps_few_copies_of_the_weights():
    # the AMX machine's measurement: three kernels are fastest somewhere, two within 10 % cover all
    profile = {
        "bf16w": [10.0, 12.2, 16.3, 31.4, 46.1, 80.0, 141.6, 541.4, None],
        "bf16-amx": [11.7, 11.8, 11.9, 17.5, 14.9, 22.0, 36.0, 126.3, 480.0],
        "bf16-onednn": [17.6, 18.1, 17.9, 33.4, 22.4, 28.0, 34.1, 121.6, 470.0],
        "fp32": [None] * len(BUCKETS),
    }
    # without slack three kernels are fastest somewhere: the pair with the least total serves
    assert formats.plan_from_profile(profile, slack=1.0).kernels == ("bf16-amx",) * 6 + ("bf16-onednn",) * 3
    assert formats.plan_from_profile(profile).kernels == ("bf16w",) + ("bf16-amx",) * (len(BUCKETS) - 1)
    # a kernel within the slack everywhere serves alone
    profile["bf16-amx"][0] = 10.9
    assert formats.plan_from_profile(profile).kernels == ("bf16-amx",) * len(BUCKETS)


def test_large_buckets_race_only_the_kernels_near_the_fastest(monkeypatch):
    import time

    def slow(w, b):
        fn = KERNELS["fp32"](w, b)

        def product(x):
            time.sleep(0.01)
            return fn(x)

        return product

    monkeypatch.setitem(KERNELS, "slow", slow)
    shapes = [(16, 32), (32, 16)]
    out = formats.measure_kernels(  # the minimum of 3 repeats: a busy host's pause only adds time
        shapes, (64, 32), 2, ("fp32", "slow"), buckets=(4, formats.LARGE + 1), repeats=3
    )
    assert out["slow"][0] > 2 * out["fp32"][0]  # timed where rows are few
    assert out["slow"][1] is None and out["fp32"][1] > 0  # left out of the large bucket


SHAPES, HEAD = [(96, 64), (64, 64), (256, 64), (64, 128)], (448, 64)  # a tiny layer's products


def _count_measurements(tmp_path, monkeypatch, busy: bool) -> list:
    """A fresh format cache and a counted one-repeat measure_kernels (one entry per call). The
    share of the cores the measurement's threads get is faked: none (`busy`) or all of them, so
    whether a record is final never depends on what else the test machine runs."""

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    calls = []
    real = formats.measure_kernels

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw, repeats=1, buckets=BUCKETS)

    monkeypatch.setattr(formats, "measure_kernels", counted)
    monkeypatch.setattr(measured, "run_with_share", lambda fn: (fn(), 0.0 if busy else 1.0))
    return calls


def test_auto_measures_once_per_machine(tmp_path, monkeypatch):
    calls = _count_measurements(tmp_path, monkeypatch, busy=False)
    shapes, head = SHAPES, HEAD
    plan, rec = formats.auto_plan(shapes, head, 2, torch.device("cpu"))
    again, _ = formats.auto_plan(shapes, head, 2, torch.device("cpu"))
    assert calls == [1] and again == plan and rec["cpu_share"] >= measured.QUIET_SHARE
    assert set(rec["ms_per_forward"]) == set(formats.AUTO_CANDIDATES)
    assert all(k in formats.AUTO_CANDIDATES for k in plan.kernels)  # never a quantized format
    assert list((tmp_path / "formats").glob("*.json"))


@pytest.fixture(scope="module")
def auto_tiny(tiny_llama_dir, tmp_path_factory):
    import os

    old = os.environ.get("SPECDECODE_CACHE")
    os.environ["SPECDECODE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield load_model(str(tiny_llama_dir), dtype="auto", device="cpu")
    finally:
        if old is None:
            os.environ.pop("SPECDECODE_CACHE")
        else:
            os.environ["SPECDECODE_CACHE"] = old


def test_auto_model_is_the_same_model(auto_tiny, tiny_llama_dir):
    ref = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu").model
    m = auto_tiny.model
    assert m.info.format == m.plan.name and m.info.dtype == m.plan.act_dtype
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    a = m.forward(ids, None, m.new_cache(2, 16), [0, 1]).logits
    b = ref.forward(ids, None, ref.new_cache(2, 16), [0, 1]).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def _greedy(target, drafter, k, prompts, n=20):
    dec = SpeculativeDecoder(target, drafter, FixedK(k), max_batch=4)
    reqs = [
        GenerationRequest(p, SamplingParams(), n, id=str(i), ignore_eos=True) for i, p in enumerate(prompts)
    ]
    return [r.token_ids for r in dec.generate(reqs)]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_target_is_lossless_for_itself(fmt, tiny_llama_dir, tiny_qwen2_dir):
    target = load_model(str(tiny_llama_dir), dtype=fmt, device="cpu")
    assert target.model.info.format in formats.QUANTIZED_CANDIDATES[fmt]
    tok = target.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("the cat sat on the mat and the cat", "a b c d e f g a b c")]
    base = _greedy(target, ARDrafter(), 0, prompts)
    other = load_model(str(tiny_qwen2_dir), dtype="fp32", device="cpu")
    v, rows = target.vocab_size, target.model.info.vocab_size
    for drafter in (
        NgramDrafter(),
        DraftModelDrafter(target.model, v, rows),
        DraftModelDrafter(other.model, v, rows),
    ):
        assert _greedy(target, drafter, 4, prompts) == base
    fp32 = _greedy(load_model(str(tiny_llama_dir), dtype="fp32", device="cpu"), ARDrafter(), 0, prompts)
    assert fp32 != base or fmt == "int8"  # int4 is another model (int8 may round to the same tokens)


def test_an_int8w_target_is_lossless_for_itself(tiny_llama_dir):
    """Our int8 product as the target's every product (decode_layers' kind 3, the quantized
    plan `--dtype int8` may measure fastest): greedy speculation equals greedy ar on it."""
    target = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu")
    try:
        target.model.use_formats(FormatPlan(("int8w",) * len(BUCKETS)))
    except RuntimeError as e:
        pytest.skip(f"int8w is refused on this machine: {str(e)[:80]}")
    tok = target.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("the cat sat on the mat and the cat", "a b c d e f g a b c")]
    base = _greedy(target, ARDrafter(), 0, prompts)
    v, rows = target.vocab_size, target.model.info.vocab_size
    for drafter in (NgramDrafter(), DraftModelDrafter(target.model, v, rows)):
        assert _greedy(target, drafter, 4, prompts) == base


def test_quantized_formats_need_the_native_runtime(tiny_gpt2_dir):
    with pytest.raises(SpecDecodeError, match="native runtime"):
        load_model(str(tiny_gpt2_dir), dtype="int8", device="cpu")


@pytest.mark.parametrize(
    "fmt,faster", [(fmt, k) for fmt, ks in sorted(formats.QUANTIZED_CANDIDATES.items()) for k in ks]
)
def test_a_quantized_target_runs_the_kernel_measured_fastest_at_decoding_sizes(
    fmt, faster, tmp_path, monkeypatch
):
    """`--dtype int8|int4`: the same quantized weights with fp32 or bf16 activations (int8: or our
    int8w product), whichever products of up to 16 rows take less time here (a prefill-sized
    bucket does not decide), as one kernel everywhere; measured once and cached. A GPU takes the
    forced plan."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    calls = []

    def fake(shapes, head, num_layers, candidates, buckets):
        calls.append(tuple(buckets))
        assert max(buckets) == formats.DECODE_ROWS and set(candidates) == set(
            formats.QUANTIZED_CANDIDATES[fmt]
        )
        return {k: [1.0 if k == faster else 2.0] * len(buckets) for k in candidates}

    monkeypatch.setattr(formats, "measure_kernels", fake)
    monkeypatch.setattr(measured, "run_with_share", lambda fn: (fn(), 1.0))
    plan, rec = formats.quantized_plan(fmt, SHAPES, HEAD, 2, torch.device("cpu"))
    assert plan.kernels == (faster,) * len(BUCKETS) and rec["name"] == faster
    again, _ = formats.quantized_plan(fmt, SHAPES, HEAD, 2, torch.device("cpu"))
    assert again == plan and len(calls) == 1
    assert formats.quantized_plan(fmt, SHAPES, HEAD, 2, torch.device("cuda"))[0] == forced_plan(fmt)
    assert len(calls) == 1
    with pytest.raises(SpecDecodeError, match="quantized format"):
        formats.quantized_plan("bf16", SHAPES, HEAD, 2, torch.device("cpu"))


def test_a_plan_measured_on_a_busy_machine_is_measured_again(tmp_path, monkeypatch):
    """A measurement whose threads got little of the cores (faked here by a process clock that
    stands still) is provisional: the next load measures again, the quieter record stays, and
    after MAX_ATTEMPTS the cached plan is used as it is."""
    calls = _count_measurements(tmp_path, monkeypatch, busy=True)
    shapes, head = SHAPES, HEAD
    for n in range(1, measured.MAX_ATTEMPTS + 2):
        _, rec = formats.auto_plan(shapes, head, 2, torch.device("cpu"))
        assert len(calls) == min(n, measured.MAX_ATTEMPTS) and rec["cpu_share"] < measured.QUIET_SHARE
    (path,) = (tmp_path / "formats").glob("*.json")
    path.write_text(json.dumps({**rec, "cpu_share": 0.95, "attempts": 1}))  # measured quietly
    formats.auto_plan(shapes, head, 2, torch.device("cpu"))
    assert len(calls) == measured.MAX_ATTEMPTS  # a quiet record is final at once


def test_int8_formats_quantize_alike():
    """Every int8 format multiplies by the weights `int8_quantize` gives (PyTorch's kernel and
    ours: the same quantized model), and re-quantizing those weights (fp32 q * scale, as an
    int8-stored drafter loads) gives the same integers back."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 64, generator=gen), torch.randn(3, 64, generator=gen)
    q, scale = formats.int8_quantize(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    w_deq = q.float() * scale[:, None]
    for name in ("int8", "int8w"):
        fn = KERNELS[name](w, None) if name == "int8" else _available(name, w, None)
        torch.testing.assert_close(fn(x), F.linear(x, w_deq), rtol=1e-5, atol=1e-5)
    again, scale_again = formats.int8_quantize(w_deq)
    assert torch.equal(again, q)
    torch.testing.assert_close(scale_again, scale, rtol=1e-6, atol=0)


def test_int8_drafter_plan_takes_int8w_where_it_is_measured_faster(tmp_path, monkeypatch):
    """An int8-stored drafter's plan: per bucket of up to DRAFT_ROWS rows, int8w where it is timed
    faster than the target plan's kernel, that kernel elsewhere and past DRAFT_ROWS; measured
    once and cached; a GPU keeps the target's plan."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    base = FormatPlan(("bf16w",) * 4 + ("fp32",) * (len(BUCKETS) - 4))
    calls = []

    def fake(shapes, head, num_layers, candidates, buckets):
        calls.append(tuple(buckets))
        assert max(buckets) == formats.DRAFT_ROWS and set(candidates) == {"bf16w", "fp32", "int8w"}
        return {k: [(1.0 if m <= 2 else 3.0) if k == "int8w" else 2.0 for m in buckets] for k in candidates}

    monkeypatch.setattr(formats, "measure_kernels", fake)
    monkeypatch.setattr(measured, "run_with_share", lambda fn: (fn(), 1.0))
    plan, rec = formats.int8_drafter_plan(base, SHAPES, torch.device("cpu"))
    assert plan.kernels == ("int8w", "int8w") + base.kernels[2:], plan.kernels
    assert rec["name"] == plan.name
    again, _ = formats.int8_drafter_plan(base, SHAPES, torch.device("cpu"))
    assert again == plan and len(calls) == 1
    assert formats.int8_drafter_plan(base, SHAPES, torch.device("cuda"))[0] == base
    assert len(calls) == 1
