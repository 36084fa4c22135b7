"""NativeDecoder against transformers (fp32) and against itself: trees, ragged batches, capture."""

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.models.native import NativeDecoder

ATOL = 1e-4
KINDS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]


def _load(path, dtype="fp32"):
    lm = load_model(str(path), dtype=dtype, device="cpu")
    assert isinstance(lm.model, NativeDecoder)
    return lm.model


def _ids(n, seed=0, vocab=400, batch=1):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _check_against_hf(model, ref, num_prompt=9, num_decode=5, capture_layers=(0,)):
    ids = _ids(num_prompt + num_decode + 3)
    with torch.no_grad():
        r = ref(ids, output_hidden_states=True)
    cache = model.new_cache(2, 64)
    # 1. prefill in one forward (slot 1: slots are independent), with hidden capture
    last = model.info.num_layers - 1
    out = model.forward(ids[:, :num_prompt], None, cache, [1], capture=(*capture_layers, last, -1))
    torch.testing.assert_close(out.logits, r.logits[:, :num_prompt], atol=ATOL, rtol=0)
    for i in capture_layers:  # layer i < last is transformers' hidden_states[i + 1]
        # the residual stream grows with depth, and so does the fp32 summation-order difference
        # between two kernel libraries (4.9e-5 relative at layer 14 on an AVX-512 EPYC)
        torch.testing.assert_close(
            out.hidden[i], r.hidden_states[i + 1][:, :num_prompt], atol=ATOL, rtol=1e-4
        )
    # transformers' last entry is the final normed state (our -1); our `last` is the raw layer output
    torch.testing.assert_close(out.hidden[-1], r.hidden_states[-1][:, :num_prompt], atol=ATOL, rtol=0)
    normed = torch.nn.functional.rms_norm(
        out.hidden[last], (model.info.hidden_size,), model.norm, model.spec.rms_norm_eps
    )
    torch.testing.assert_close(normed, out.hidden[-1], atol=ATOL, rtol=0)
    cache.commit(1, num_prompt)
    # 2. incremental decode through the cache
    for j in range(num_prompt, num_prompt + num_decode):
        o = model.forward(ids[:, j : j + 1], torch.tensor([[j]]), cache, [1])
        torch.testing.assert_close(o.logits[0, 0], r.logits[0, j], atol=ATOL, rtol=0)
        cache.commit(1, 1)
    # 3. a 3-token verification block on top
    j = num_prompt + num_decode
    o = model.forward(ids[:, j : j + 3], None, cache, [1])
    torch.testing.assert_close(o.logits, r.logits[:, j : j + 3], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers_fp32(kind, request, hf_reference):
    path = request.getfixturevalue(kind)
    model = _load(path)
    _check_against_hf(model, hf_reference(path), capture_layers=(0,))
    assert model.info.vocab_size == 448 and model.info.dtype == torch.float32


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    ],
)  # fmt: skip
def test_rope_scaling_matches_transformers(rope, make_tiny_model, hf_reference):
    path = make_tiny_model("llama", f"llama_{rope['rope_type']}", rope_parameters=rope)
    _check_against_hf(_load(path), hf_reference(path), num_prompt=40, num_decode=3)


def test_mistral_and_its_sliding_window(make_tiny_model, hf_reference):
    path = make_tiny_model("mistral", sliding_window=24)
    model = _load(path)
    _check_against_hf(model, hf_reference(path), num_prompt=12, num_decode=3)  # within the window
    cache = model.new_cache(1, 64)
    model.prefill(_ids(20), cache, [0])
    with pytest.raises(SpecDecodeError, match="sliding-window attention"):
        model.forward(_ids(5), None, cache, [0])


def test_unsupported_rope_is_refused(make_tiny_model):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    path = make_tiny_model("llama", "llama_yarn", rope_parameters=rope)
    with pytest.raises(SpecDecodeError, match="rope type 'yarn' is not supported"):
        _load(path)


def _tree():
    # node: 0 root; 1, 2 children of 0; 3 child of 1; 4 child of 2; 5 child of 3
    parents = [-1, 0, 0, 1, 2, 3]
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = []
    for i in range(n):
        j, d = i, 0
        while j >= 0:
            mask[i, j] = True
            j, d = parents[j], d + 1
        depth.append(d - 1)
    return mask, torch.tensor(depth), [[0, 1, 3, 5], [0, 2, 4]]


@pytest.mark.parametrize("kind", KINDS)
def test_tree_block_equals_its_paths_as_chains(kind, request):
    model = _load(request.getfixturevalue(kind))
    mask, depth, paths = _tree()
    prompt, tree_ids = _ids(7, seed=1), _ids(6, seed=2)
    cache = model.new_cache(1, 32)
    model.prefill(prompt, cache, [0])  # commits 7 rows
    out = model.forward(tree_ids, (7 + depth)[None], cache, [0], tree_mask=mask[None], capture=(1, -1))
    for path in paths:
        chain = model.forward(tree_ids[:, path], None, cache, [0], capture=(1, -1))
        torch.testing.assert_close(out.logits[:, path], chain.logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[1][:, path], chain.hidden[1], atol=ATOL, rtol=0)
    # Keeping a path by compaction == having fed that path as a chain.
    model.forward(tree_ids, (7 + depth)[None], cache, [0], tree_mask=mask[None])
    cache.commit(0, 3, kept_rows=[0, 2, 4])
    nxt = _ids(2, seed=3)
    after_tree = model.forward(nxt, None, cache, [0]).logits
    ref = model.new_cache(1, 32)
    model.prefill(torch.cat([prompt, tree_ids[:, [0, 2, 4]]], 1), ref, [0])
    torch.testing.assert_close(after_tree, model.forward(nxt, None, ref, [0]).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("attention", ["ours", "sdpa"])  # ours reads every slot by index in place
@pytest.mark.parametrize(("num_slots", "slots"), [(4, [3, 0, 1]), (8, [7, 0, 2])])  # SDPA: range; gathered
def test_ragged_batch_equals_single_requests(kind, request, attention, num_slots, slots):
    model = _load(request.getfixturevalue(kind))
    if attention == "sdpa":
        model._fused = None  # the stock-PyTorch layer (no kernels, CUDA): range and gather reads
    prompt_lens, new_counts = [5, 9, 3], [4, 1, 3]  # non-contiguous slots
    prompts = [_ids(n, seed=10 + i) for i, n in enumerate(prompt_lens)]
    blocks = [_ids(4, seed=20 + i) for i in range(3)]
    batch_cache = model.new_cache(num_slots, 32)
    for p, s in zip(prompts, slots, strict=True):
        model.prefill(p, batch_cache, [s])
    ids = torch.cat(blocks)  # [3, 4] (right padding = whatever the block holds past num_new)
    positions = torch.tensor(prompt_lens)[:, None] + torch.arange(4)
    out = model.forward(ids, positions, batch_cache, torch.tensor(slots), num_new=new_counts, capture=(0,))
    for b in range(3):
        single = model.new_cache(1, 32)
        model.prefill(prompts[b], single, [0])
        n = new_counts[b]
        ref = model.forward(blocks[b][:, :n], None, single, [0], capture=(0,))
        torch.testing.assert_close(out.logits[b : b + 1, :n], ref.logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[0][b : b + 1, :n], ref.hidden[0], atol=ATOL, rtol=0)
    assert torch.isfinite(out.logits).all()
    # After committing different amounts, a contiguous batched decode step still matches.
    for b, s in enumerate(slots):
        batch_cache.commit(s, new_counts[b])
    order = [0, slots[2]]  # [0, 1] a contiguous range read through views; [0, 2] not contiguous
    step = torch.tensor([[7], [8]])
    out2 = model.forward(step, None, batch_cache, order)
    for row, s in enumerate(order):
        b = slots.index(s)
        seq = torch.cat([prompts[b], blocks[b][:, : new_counts[b]], step[row : row + 1]], 1)
        ref = model.forward(seq, None, model.new_cache(1, 32), [0])
        torch.testing.assert_close(out2.logits[row, 0], ref.logits[0, -1], atol=ATOL, rtol=0)


def test_batched_tree_and_chain_rows(tiny_llama_dir):
    model = _load(tiny_llama_dir)
    mask, depth, paths = _tree()
    cache = model.new_cache(2, 32)
    model.prefill(_ids(5, seed=4), cache, [0])
    model.prefill(_ids(8, seed=5), cache, [1])
    ids = torch.cat([_ids(6, seed=6), _ids(6, seed=7)])
    masks = torch.stack([mask, torch.ones(6, 6, dtype=torch.bool).tril()])  # row 1: a plain chain
    positions = torch.stack([5 + depth, 8 + torch.arange(6)])
    out = model.forward(ids, positions, cache, [0, 1], tree_mask=masks)
    for path in paths:
        chain = model.forward(ids[:1, path], None, cache, [0])
        torch.testing.assert_close(out.logits[:1, path], chain.logits, atol=ATOL, rtol=0)
    chain = model.forward(ids[1:], None, cache, [1])
    torch.testing.assert_close(out.logits[1:], chain.logits, atol=ATOL, rtol=0)


def test_prefill_chunks_equal_one_forward(tiny_qwen2_dir):
    model = _load(tiny_qwen2_dir)
    prompts = torch.cat([_ids(23, seed=8), _ids(23, seed=9)])
    a, b = model.new_cache(2, 40), model.new_cache(2, 40)
    whole = model.forward(prompts, None, a, [0, 1], num_new=[23, 17], capture=(-1,))
    chunked = model.prefill(prompts, b, [0, 1], num_new=[23, 17], capture=(-1,), chunk_size=5)
    assert b.lengths == [23, 17] and a.lengths == [0, 0]  # prefill commits; forward never does
    torch.testing.assert_close(chunked.logits[0, 0], whole.logits[0, 22], atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked.logits[1, 0], whole.logits[1, 16], atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked.hidden[-1][1, :17], whole.hidden[-1][1, :17], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_segments_equal_separate_forwards(kind, request):
    """A decode step (two slots, one of them a ragged verify block), a tree row and a prompt chunk
    in one packed forward give each segment what its own forward gives, and write the same K/V."""
    from specdecode.models.base import Segment, forward_packed

    model = _load(request.getfixturevalue(kind))
    mask, depth, _ = _tree()
    caches = [model.new_cache(4, 32), model.new_cache(4, 32)]
    for c in caches:
        model.prefill(_ids(5, seed=1), c, [0])
        model.prefill(_ids(7, seed=2), c, [1])
        model.prefill(_ids(4, seed=3), c, [3])
    block = torch.cat([_ids(3, seed=4), _ids(3, seed=5)])  # slots 0, 1: K+1 = 3, row 1 ragged
    tree_ids = _ids(6, seed=6)
    chunk = _ids(9, seed=7)  # slot 2: the first chunk of a new prompt
    segs = [
        Segment(block, None, [0, 1], num_new=[3, 2], capture=(0,)),
        Segment(tree_ids, (4 + depth)[None], [3], tree_mask=mask[None]),
        Segment(chunk, None, [2], capture=(0, -1), logits=False),
    ]
    packed = forward_packed(model, caches[0], segs)
    alone = [forward_packed(model, caches[1], [g])[0] for g in segs]
    torch.testing.assert_close(packed[0].logits[0], alone[0].logits[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[0].logits[1, :2], alone[0].logits[1, :2], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[0].hidden[0][0], alone[0].hidden[0][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[1].logits, alone[1].logits, atol=ATOL, rtol=0)
    assert packed[2].logits is None and set(packed[2].hidden) == {0, -1}
    for key in (0, -1):
        torch.testing.assert_close(packed[2].hidden[key], alone[2].hidden[key], atol=ATOL, rtol=0)
    rows = {0: 3, 1: 2, 2: 9, 3: 6}  # K/V rows each slot's segment wrote past its length
    lens = {0: 5, 1: 7, 2: 0, 3: 4}
    for slot, n in rows.items():
        a = caches[0].kv[:, :, slot, :, lens[slot] : lens[slot] + n]
        b = caches[1].kv[:, :, slot, :, lens[slot] : lens[slot] + n]
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="distinct slots"):
        forward_packed(model, caches[0], [segs[0], Segment(chunk, None, [1])])


def test_bf16_kv_cache_is_half_the_memory_and_close(tiny_llama_dir, tiny_gpt2_dir):
    lm = load_model(str(tiny_llama_dir), dtype="fp32", device="cpu", kv_cache_dtype="bf16")
    model, ref = lm.model, _load(tiny_llama_dir)
    cache, ref_cache = model.new_cache(2, 80), ref.new_cache(2, 80)
    assert cache.kv.dtype == torch.bfloat16 and 2 * cache.kv.nbytes == ref_cache.kv.nbytes
    ids = _ids(70)  # a prompt over FUSED_ATTENTION_ROWS tokens reads the cache through SDPA
    out = model.forward(ids, None, cache, [1])
    want = ref.forward(ids, None, ref_cache, [1])
    torch.testing.assert_close(out.logits, want.logits, atol=5e-2, rtol=0)
    assert (out.logits - want.logits).abs().max() > 0  # it does round
    with pytest.raises(SpecDecodeError, match="kv-cache-dtype"):
        load_model(str(tiny_gpt2_dir), dtype="fp32", device="cpu", kv_cache_dtype="bf16")
    with pytest.raises(SpecDecodeError, match="unknown KV cache dtype"):
        load_model(str(tiny_llama_dir), kv_cache_dtype="fp8")


def test_decode_step_plan_is_lean(tiny_llama_dir):
    model = _load(tiny_llama_dir)
    cache = model.new_cache(4, 16)
    cache.commit(1, 3)
    cache.commit(2, 3)
    plan = model._plan(2, 1, cache, [1, 2], None, None)
    assert plan.mask is None and plan.s0 == 1 and plan.dst is not None  # views, no mask
    plan = model._plan(2, 1, cache, [2, 1], None, None)
    if model._fused is not None:  # our kernel reads each row's slot in place: no copy, no dummy rows
        assert plan.s0 is None and plan.window is None and plan.slot_idx.tolist() == [2, 1]
        assert plan.k_span is not None and plan.k_span[0].shape[0] == 4 and plan.mask is None
        model._fused = None  # the SDPA path (no kernels, CUDA) reads a slot range or gathers
        plan = model._plan(2, 1, cache, [2, 1], None, None)
    assert plan.s0 is None and plan.window.tolist() == [1, 0] and plan.k_span is None  # read in place
    plan = model._plan(2, 1, model.new_cache(8, 16), [0, 7], None, None)
    assert plan.window is None and plan.k_span is not None  # a range of mostly gaps gathers
    cache.commit(3, 5)
    plan = model._plan(2, 1, cache, [1, 3], None, None)  # slot 2 is a gap: a dummy query row
    assert plan.window.tolist() == [0, 2] and plan.mask.shape[0] == 3
    assert plan.mask[1].sum(-1).tolist() == [[1] * plan.mask.shape[2]]  # it reads one key only
    assert plan.mask[0, 0, 0, :4].all() and plan.mask[2, 0, 0, :6].all()


def test_step_costs_count_every_product(tiny_qwen2_dir):
    """step_macs: every projection and the head once per token; step_weight_bytes: their fp32
    weights (each product's copy) read once a step."""
    model = _load(tiny_qwen2_dir)
    d, f, h = model.info.hidden_size, model.spec.intermediate_size, model.info.head_dim
    qkv = d * (model.info.num_heads + 2 * model.info.num_kv_heads) * h
    per_layer = qkv + model.info.num_heads * h * d + 3 * d * f
    want = model.info.num_layers * per_layer + model.info.vocab_size * d
    assert model.step_macs() == want
    assert model.step_weight_bytes() == 4 * want


def test_overflow_and_bad_capture(tiny_llama_dir):
    model = _load(tiny_llama_dir)
    cache = model.new_cache(1, 8)
    model.prefill(_ids(6), cache, [0])
    with pytest.raises(SpecDecodeError, match="exceeds the cache/context length 8"):
        model.forward(_ids(3), None, cache, [0])
    out = model.forward(_ids(3), None, cache, [0], num_new=[2])  # the last row is padding: fits
    assert torch.isfinite(out.logits).all()
    with pytest.raises(SpecDecodeError, match="cannot capture hidden layer 7"):
        model.forward(_ids(1), None, cache, [0], capture=(7,))


def test_bf16_is_close_to_fp32(tiny_qwen3_dir):
    m32, m16 = _load(tiny_qwen3_dir), _load(tiny_qwen3_dir, "bf16")
    assert m16.info.dtype == torch.bfloat16 and m16.embed_tokens.dtype == torch.bfloat16
    ids = _ids(12, seed=11)
    out32 = m32.forward(ids, None, m32.new_cache(1, 16), [0])
    out16 = m16.forward(ids, None, m16.new_cache(1, 16), [0])
    assert out16.logits.dtype == torch.float32
    assert (out16.logits - out32.logits).abs().max() < 0.1 * out32.logits.abs().max()
    converted = _load(tiny_qwen3_dir).to(torch.bfloat16)  # .to() keeps the model consistent
    assert converted.info.dtype == torch.bfloat16 and converted._rope.dtype == torch.bfloat16
    out = converted.forward(ids, None, converted.new_cache(1, 16), [0])
    torch.testing.assert_close(out.logits, out16.logits)


@pytest.mark.slow
def test_smollm2_matches_transformers_fp32(smollm2_dir, hf_reference):
    model = _load(smollm2_dir)
    _check_against_hf(
        model, hf_reference(smollm2_dir), num_prompt=20, num_decode=4, capture_layers=(0, 14, 28)
    )


def test_bf16_upcast_path_agrees_and_prefill_can_skip_logits(tiny_llama_dir):
    """Forced bf16 multiplies prefill-sized products in fp32 (bf16-up); same model as pure bf16."""
    from specdecode.models.formats import BUCKETS, FormatPlan, forced_plan
    from specdecode.models.loader import load_model

    m = load_model(str(tiny_llama_dir), dtype="bf16", device="cpu").model
    assert m.plan == forced_plan("bf16") and "bf16-up" in m.plan.kernels
    ids = torch.randint(0, 300, (1, 24))
    pos = torch.arange(24)[None]
    outs = []
    for plan in (FormatPlan(("bf16",) * len(BUCKETS)), forced_plan("bf16")):
        m.use_formats(plan)
        cache = m.new_cache(1, 64)
        outs.append(m.forward(ids, pos, cache, [0]).logits)
        assert m.forward(ids, pos, cache, [0], logits=False).logits is None
    assert torch.allclose(outs[0], outs[1], atol=0.1, rtol=0.05)
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() > 0.9


def test_masters_shrink_to_bf16_only_when_exact_and_unread(tiny_llama_dir):
    """A plan whose kernels all hold their own weight copies (here int8) lets the projection
    masters of a bf16-exact model become bf16; the model computes the same, and a later fp32
    plan rebuilds the same fp32 model. Inexact (fp32) weights keep fp32 masters."""
    from specdecode.models.formats import BUCKETS, FormatPlan, forced_plan

    int8 = FormatPlan(("int8",) * len(BUCKETS))
    assert not int8.keeps_fp32_weights and forced_plan("fp32").keeps_fp32_weights
    ids, pos = _ids(10, seed=3), torch.arange(10)[None]

    def logits(m):
        return m.forward(ids, pos, m.new_cache(1, 16), [0]).logits

    inexact = _load(tiny_llama_dir)
    inexact.use_formats(int8)
    assert inexact.layers[0].w_qkv.dtype == torch.float32  # rounding would change a later fp32 plan

    models = []
    for _ in range(2):
        m = _load(tiny_llama_dir)
        with torch.no_grad():
            for layer in m.layers:  # a bf16 checkpoint, loaded in fp32
                for name in ("w_qkv", "w_o", "w_gu", "w_down"):
                    p = getattr(layer, name)
                    p.copy_(p.to(torch.bfloat16).float())
        m.use_formats(forced_plan("fp32"))  # rebuild the products from the rounded weights
        models.append(m)
    ref, m = models
    fp32_logits = logits(ref)
    ref.use_formats(int8)
    m.use_formats(int8)
    assert all(getattr(layer, n).dtype == torch.bfloat16 for layer in m.layers for n in ("w_qkv", "w_down"))
    assert m.layers[0].ln1.dtype == torch.float32 and m.embed_tokens.dtype == torch.float32
    assert m.info.dtype == torch.float32  # activations and KV cache stay fp32
    torch.testing.assert_close(logits(m), logits(ref), atol=0, rtol=0)
    m.use_formats(forced_plan("fp32"))  # back to fp32 products: the same fp32 model as before
    assert m.layers[0].w_qkv.dtype == torch.float32
    torch.testing.assert_close(logits(m), fp32_logits, atol=0, rtol=0)


def test_masters_round_to_bf16_when_the_plan_stays_and_reads_bf16(tiny_llama_dir):
    """keep_masters=False (the loader's auto plan): inexact fp32 masters become bf16 only when
    every kernel reads bf16-rounded weights, and the model computes exactly what it computed
    with the fp32 masters kept; a plan with a kernel that reads other values keeps them."""
    from specdecode.models import kernels
    from specdecode.models.formats import BUCKETS, FormatPlan

    if kernels.fused() is None:
        pytest.skip(f"our kernels are not available here: {kernels.unavailable.get('cpu')}")
    bf16w = FormatPlan(("bf16w",) * len(BUCKETS))  # bf16 weights, fp32 activations
    assert bf16w.bf16_weights and not FormatPlan(("int8",) * len(BUCKETS)).bf16_weights
    ids, pos = _ids(10, seed=4), torch.arange(10)[None]
    kept, rounded = _load(tiny_llama_dir), _load(tiny_llama_dir)
    kept.use_formats(bf16w)
    rounded.use_formats(bf16w, keep_masters=False)
    assert kept.layers[0].w_qkv.dtype == torch.float32  # inexact: kept by default
    names = ("w_qkv", "w_down")
    assert all(getattr(layer, n).dtype == torch.bfloat16 for layer in rounded.layers for n in names)
    out = [m.forward(ids, pos, m.new_cache(1, 16), [0]).logits for m in (kept, rounded)]
    torch.testing.assert_close(out[1], out[0], atol=0, rtol=0)
    int8 = _load(tiny_llama_dir)
    int8.use_formats(FormatPlan(("int8",) * len(BUCKETS)), keep_masters=False)
    assert int8.layers[0].w_qkv.dtype == torch.float32  # int8 quantizes the fp32 values


@pytest.mark.parametrize("kind", KINDS)  # qwen2: QKV bias; qwen3: per-head q/k norms
@pytest.mark.parametrize("kv", ["auto", "bf16"])
@pytest.mark.parametrize("product", ["bf16w", "int8w"])  # our AVX2 products: decode_layer's kinds 0, 3
def test_whole_layer_call_equals_the_python_layer(kind, kv, product, request, monkeypatch):
    from specdecode.models import kernels
    from specdecode.models.formats import BUCKETS, FormatPlan

    ops = kernels.fused()
    if ops is None:
        pytest.skip(f"our kernels are not available here: {kernels.unavailable.get('cpu')}")
    lm = load_model(str(request.getfixturevalue(kind)), dtype="fp32", device="cpu", kv_cache_dtype=kv)
    model = lm.model
    model.use_formats(FormatPlan((product,) * len(BUCKETS)))
    calls = []
    real = model._whole_layers

    def counted(groups, T):
        fn = real(groups, T)
        calls.append(fn is not None)
        return fn

    def run(whole, n, slots=(1,), num_slots=3):
        monkeypatch.setattr(model, "_whole_layers", counted if whole else (lambda groups, T: None))
        cache = model.new_cache(num_slots, 48)
        prompt = _ids(9, batch=len(slots))
        model.prefill(prompt, cache, list(slots))
        return model.forward(_ids(n, seed=5, batch=len(slots)), None, cache, list(slots), capture=(0, -1))

    for n, slots in [(1, (1,)), (5, (1,)), (1, (0, 1)), (3, (1, 2))]:
        calls.clear()
        a, b = run(True, n, slots), run(False, n, slots)
        assert calls[-1], (n, slots)  # the whole-layer path served the step
        assert torch.equal(a.logits, b.logits)
        assert all(torch.equal(a.hidden[k], b.hidden[k]) for k in (0, -1))
    mask, depth, _ = _tree()  # a token tree verified in one block: the mask goes into the call
    tree_out = []
    for whole in (True, False):
        monkeypatch.setattr(model, "_whole_layers", counted if whole else (lambda groups, T: None))
        cache = model.new_cache(1, 48)
        model.prefill(_ids(7, seed=1), cache, [0])
        ids = _ids(6, seed=2)
        tree_out.append(model.forward(ids, (7 + depth)[None], cache, [0], tree_mask=mask[None]).logits)
    assert calls[-1] and torch.equal(*tree_out)
    calls.clear()
    run(True, 2, slots=(2, 0))  # slots out of order: the Python layer (gathered writes)
    assert calls[-1] is False
