"""Our compiled CPU kernels: bf16w computes x @ w.T + b in fp32 arithmetic from bf16 weights, int8w
from int8 weights with a scale per output row, and
bf16amx (where AMX runs) and bf16dp (where AVX512-BF16 runs) the product of bf16-rounded x and
bf16 weights accumulated in fp32, at every shape their tiles cut differently (row and column
remainders, K not a multiple of the tile)."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.models import kernels
from specdecode.models.formats import int8_quantize


@pytest.fixture(scope="module")
def ops():
    o = kernels.fused()
    if o is None:
        pytest.skip(f"our kernels are not available here: {kernels.unavailable.get('cpu')}")
    return o


def _check_product(pack, linear, m, n, k, round_x, rows_alone):
    """linear(x, pack(w), n, bias) against float64 x @ w.T (+ b), x passed through `round_x`,
    with and without bias; each row in `rows_alone` rounds alike alone and in the whole block.
    Returns (x, packed)."""
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen)
    packed = pack(w)
    ref = round_x(x).double() @ w.double().t()
    for bias in (b, None):
        y = linear(x, packed, n, bias)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        want = ref + b.double() if bias is not None else ref
        # fp32 accumulation of k terms: a bf16 product would be ~100x further off
        assert (y.double() - want).abs().max() < 1e-5 * k**0.5 * want.abs().max().clamp(min=1)
    full = linear(x, packed, n, b)
    for r in rows_alone:
        assert torch.equal(linear(x[r : r + 1], packed, n, b), full[r : r + 1])
    return x, packed


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 13, 17])
@pytest.mark.parametrize("n,k", [(96, 128), (7, 13), (33, 40), (5, 576), (200, 64)])  # 200: sweeps
def test_bf16w_is_the_fp32_product_of_bf16_weights(ops, m, n, k):
    # what fp32 arithmetic approximates: x as it is
    _check_product(ops.bf16w_pack, ops.bf16w_linear, m, n, k, lambda x: x, rows_alone=(m - 1,))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 13, 17])
@pytest.mark.parametrize("n,k", [(96, 128), (7, 13), (33, 40), (5, 576), (200, 64)])
def test_int8w_is_the_fp32_product_of_its_int8_weights(ops, m, n, k):
    """x @ (q * scale).T (+ b) in fp32 arithmetic, for the weights `int8_quantize` makes: each
    block's scales sit after its weights, so every remainder of rows and outputs is checked."""
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w, b = (
        torch.randn(m, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )
    q, scale = int8_quantize(w)
    packed = ops.int8w_pack(q, scale)
    ref = x.double() @ (q.double() * scale.double()[:, None]).t()
    for bias in (b, None):
        y = ops.int8w_linear(x, packed, n, bias)
        want = ref + b.double() if bias is not None else ref
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert (y.double() - want).abs().max() < 1e-5 * k**0.5 * want.abs().max().clamp(min=1)
    assert torch.equal(ops.int8w_linear(x[m - 1 :], packed, n, b), ops.int8w_linear(x, packed, n, b)[m - 1 :])


@pytest.mark.parametrize("fmt", ["bf16w", "int8w"])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_narrow_products_are_the_same_whatever_the_threads_and_their_shares(ops, fmt, m):
    """Products of 2+ rows hand sweeps of blocks to the threads as they ask (each owns a run and
    takes the last of another's when done): every block computed once, the same way, so the
    result is bit for bit the same at 1, 2 and 3 threads and repeated calls, and it is the product."""
    gen = torch.Generator().manual_seed(m)
    n, k = 16 * 6 * 7 + 5, 64  # 43 blocks of 16 outputs: 8 sweeps, the last one short
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    if fmt == "bf16w":
        packed, linear, ref = ops.bf16w_pack(w), ops.bf16w_linear, x @ w.float().t()
    else:
        q, scale = int8_quantize(w)
        packed, linear, ref = ops.int8w_pack(q, scale), ops.int8w_linear, x @ (q.float() * scale[:, None]).t()
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs += [linear(x, packed, n, None) for _ in range(5)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


def test_bf16w_reads_strided_inputs_and_refuses_wrong_ones(ops):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen)[::2]  # rows with a stride: copied, not misread
    w = torch.randn(12, 64, generator=gen).to(torch.bfloat16)
    packed = ops.bf16w_pack(w)
    torch.testing.assert_close(ops.bf16w_linear(x, packed, 12, None), x @ w.float().t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.bf16w_pack(w.float())
    with pytest.raises(RuntimeError, match="bf16w_pack"):
        ops.bf16w_linear(x[:, :32], packed, 12, None)
    q, scale = int8_quantize(w)
    packed = ops.int8w_pack(q, scale)
    torch.testing.assert_close(
        ops.int8w_linear(x, packed, 12, None), x @ (q.float() * scale[:, None]).t(), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(RuntimeError, match="int8"):
        ops.int8w_pack(w, scale)
    with pytest.raises(RuntimeError, match="int8w_pack"):
        ops.int8w_linear(x[:, :32], packed, 12, None)
    with pytest.raises(RuntimeError, match="int8w_pack"):
        ops.int8w_linear(x, ops.bf16w_pack(w), 12, None)


@pytest.mark.parametrize("n,k", [(96, 128), (33, 40), (200, 64), (5, 576), (400, 24)])
def test_bf16w_one_row_is_the_same_in_2_and_3_streams(ops, n, k):
    """A one-row product reads 2 or 3 blocks side by side (`bf16w_streams`, chosen by timing when
    the extension loads): the same bits either way, and the same as that row in a block of rows."""
    chosen = ops.bf16w_streams(0)
    assert kernels.choices["bf16w one row"].startswith(f"{chosen} streams")  # the timed choice is in use
    gen = torch.Generator().manual_seed(n + k)
    x, w, b = (
        torch.randn(5, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )
    packed = ops.bf16w_pack(w.to(torch.bfloat16))
    try:
        got = {s: ops.bf16w_linear(x[:1], packed, n, b) for s in (2, 3) if ops.bf16w_streams(s) == s}
    finally:
        ops.bf16w_streams(chosen)
    assert set(got) == {2, 3}
    assert torch.equal(got[2], got[3])
    assert torch.equal(got[3], ops.bf16w_linear(x, packed, n, b)[:1])
    with pytest.raises(RuntimeError, match="2 or 3"):
        ops.bf16w_streams(4)


def test_bf16w_streams_are_chosen_without_a_writable_cache(ops, monkeypatch, tmp_path):
    """Where the measurement cannot be cached (the cache path is a file), the streams are timed
    for the process alone: the kernels stay available."""
    chosen = ops.bf16w_streams(0)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setattr(kernels, "cache_dir", lambda: blocker)
    monkeypatch.setattr(kernels, "choices", dict(kernels.choices))  # the process's record comes back after
    try:
        kernels._choose_one_row_streams(ops)
        assert kernels.choices["bf16w one row"].startswith(f"{ops.bf16w_streams(0)} streams")
    finally:
        ops.bf16w_streams(chosen)


def test_bf16w_streams_record_without_a_count_is_measured_again(ops, monkeypatch, tmp_path):
    """A cached record that says nothing of the streams (another writer's, or damaged) is timed
    again and replaced, not read as a choice (a KeyError there would leave the kernels unbuilt)."""
    chosen = ops.bf16w_streams(0)
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels, "choices", dict(kernels.choices))
    kernels._choose_one_row_streams(ops)  # the record's path, from a first measurement
    (path,) = (tmp_path / "kernels").glob("bf16w-streams-*.json")
    path.write_text(json.dumps({"cpu_share": 1.0, "attempts": 1}))  # final, but no count
    try:
        kernels._choose_one_row_streams(ops)
        assert json.loads(path.read_text())["streams"] == ops.bf16w_streams(0)
    finally:
        ops.bf16w_streams(chosen)


PAIR_PACKS = {
    "bf16amx": "bf16amx_pack",
    "bf16dp": "bf16dp_pack",
    "bf16dp1": "bf16dp_pack",
}  # linear -> its pack


@pytest.fixture(scope="module", params=list(PAIR_PACKS))
def pairs(request, ops):
    """(pack, linear, pack's name) of a kernel that multiplies bf16 pairs, where this CPU runs it."""
    name = request.param
    pack, linear = getattr(ops, PAIR_PACKS[name]), getattr(ops, f"{name}_linear")
    try:
        pack(torch.zeros(16, 32, dtype=torch.bfloat16))
    except RuntimeError as e:  # no AMX / AVX512-BF16 on this CPU, or the OS refused the tiles
        pytest.skip(f"{name} is not available here: {str(e)[:80]}")
    return pack, linear, PAIR_PACKS[name]


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 8, 9, 15, 16, 17, 20, 33, 40, 64])
@pytest.mark.parametrize("n,k", [(96, 128), (7, 13), (33, 40), (130, 576)])
def test_pair_kernels_are_the_product_of_bf16_inputs_accumulated_in_fp32(pairs, m, n, k):
    # x rounded to bf16, exact products; rows alone as in any block of rows (bf16amx: from m = 17
    # on, a 16-row chunk and the next (up to 16 rows) run as a pair, row m - 1 in the second one,
    # row m // 2 there from m = 32 on; bf16dp: passes of up to 8 rows, 4 blocks at a time for up to 6
    # rows, 3 for 7-8; bf16dp1: up to 16 rows in one pass, a block at a time)
    pack, linear, pack_name = pairs
    x, packed = _check_product(
        pack, linear, m, n, k, lambda x: x.to(torch.bfloat16), rows_alone=(0, m // 2, m - 1)
    )
    if k > 64:  # x from another shape is refused (K is known to within one tile of 32)
        with pytest.raises(RuntimeError, match=pack_name):
            linear(x[:, : k // 2], packed, n, None)


@pytest.mark.parametrize("m", [0, 1, 2, 5, 7, 8, 9, 12, 13, 16, 17, 20])
def test_bf16dp_in_one_stream_gives_the_same_bits(ops, m):
    # bf16dp1 reads the same packing a block at a time, up to 16 rows in one pass: the same sums
    # in the same order, so the same bits as bf16dp (3-4 blocks at once, passes of 8 rows)
    gen = torch.Generator().manual_seed(m)
    w, x, b = (
        torch.randn(200, 576, generator=gen),
        torch.randn(m, 576, generator=gen),
        torch.randn(200, generator=gen),
    )
    try:
        packed = ops.bf16dp_pack(w.to(torch.bfloat16))
    except RuntimeError as e:  # no AVX512-BF16 on this CPU
        pytest.skip(f"bf16dp is not available here: {str(e)[:80]}")
    assert torch.equal(ops.bf16dp1_linear(x, packed, 200, b), ops.bf16dp_linear(x, packed, 200, b))


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPECDECODE_NO_KERNELS", "1")
    kernels._ops.cache_clear()
    try:
        assert kernels.fused() is None
        assert "SPECDECODE_NO_KERNELS" in kernels.unavailable["cpu"]
    finally:
        kernels._ops.cache_clear()


def _close(a, b, tol=1e-5):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert (a - b).abs().max() <= tol * max(1.0, float(b.abs().max())), float((a - b).abs().max())


@pytest.mark.parametrize("m", [1, 5, 33])
def test_norms_match_pytorch(ops, m):
    gen = torch.Generator().manual_seed(m)
    x, delta, w = torch.randn(m, 72, generator=gen), torch.randn(m, 72, generator=gen), torch.randn(72)
    _close(ops.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (72,), w, 1e-5))
    s, h = ops.add_rms_norm(x, delta, w, 1e-6)
    _close(s, x + delta, 0)
    _close(h, torch.nn.functional.rms_norm(x + delta, (72,), w, 1e-6))


def test_rope_rotates_the_first_heads_in_place(ops):
    gen = torch.Generator().manual_seed(0)
    M, D, heads, extra = 4, 16, 3, 2  # 3 rotated heads (q and k), 2 left alone (v)
    qkv = torch.randn(M, (heads + extra) * D, generator=gen)
    ang = torch.randn(M, D // 2, generator=gen)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([-ang.sin(), ang.sin()], -1)
    cs = torch.stack([cos, sin], 1)  # [M, 2, D]
    x = qkv[:, : heads * D].view(M, heads, D)
    want = x * cos[:, None] + x.roll(D // 2, -1) * sin[:, None]
    v_before = qkv[:, heads * D :].clone()
    ops.rope_(qkv, cs, heads)
    _close(qkv[:, : heads * D].view(M, heads, D), want)
    assert torch.equal(qkv[:, heads * D :], v_before)


def test_silu_mul_matches_pytorch(ops):
    gu = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(1)) * 4
    _close(ops.silu_mul(gu), torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:])


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("R", [6, 19])  # one task per (row, head), or several row chunks
def test_attention_matches_sdpa_and_skips_what_no_row_sees(ops, with_mask, R):
    gen = torch.Generator().manual_seed(2)
    B, Hk, L, D = 3, 2, 11, 16
    q = torch.randn(B, Hk, R, D, generator=gen)
    kv = torch.randn(2, B, Hk, L + 5, D, generator=gen)
    k, v = kv[0, :, :, :L], kv[1, :, :, :L]  # strided views, as the cache gives them
    mask = None
    if with_mask:
        mask = torch.rand(B, 1, R, L, generator=gen) < 0.6
        mask[..., 0] = True  # every row sees a key (as the decoder guarantees)
        mask[1, ..., 7:] = False  # keys nobody in batch row 1 sees: garbage there must not matter
        k[1, :, 7:] = float("nan")
        v[1, :, 7:] = float("nan")
    got = ops.attention(q, k, v, mask)
    if with_mask:
        k[1, :, 7:] = 0
        v[1, :, 7:] = 0
    _close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    for r in (0, R - 1):  # a row rounds the same whatever rides with it
        one = ops.attention(
            q[:1, :, r : r + 1], k[:1], v[:1], None if mask is None else mask[:1, :, r : r + 1]
        )
        assert torch.equal(one, got[:1, :, r : r + 1])


@pytest.mark.parametrize("G", [1, 3, 8])  # query heads per KV head: rows summed together in 1-3s
def test_attention_rows_sharing_a_mask_row_sum_values_together_exactly(ops, G):
    """A decode step's G query heads share their mask row; the kernel then sums the values for
    them together. The result must be what SDPA gives and, bit for bit, what each row gives alone
    (and what a chunk whose rows see different keys gives)."""
    gen = torch.Generator().manual_seed(3)
    B, Hk, L, D = 4, 2, 37, 64
    lens = torch.tensor([5, 36, 17, 1])  # keys each batch row sees (a ragged decode batch)
    q = torch.randn(B, Hk, G, D, generator=gen)
    kv = torch.randn(2, B, Hk, L + 3, D, generator=gen)
    k, v = kv[0, :, :, :L], kv[1, :, :, :L]
    seen = torch.arange(L).view(1, L) < lens.view(B, 1)  # [B, L]
    k.masked_fill_(~seen.view(B, 1, L, 1), float("nan"))  # garbage past each row's length
    v.masked_fill_(~seen.view(B, 1, L, 1), float("nan"))
    mask = seen.view(B, 1, 1, L).repeat(1, 1, G, 1)
    got = ops.attention(q, k, v, mask)
    assert not got.isnan().any()
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.nan_to_num(0.0), v.nan_to_num(0.0), attn_mask=mask
    )
    _close(got, want)
    for g in range(G):  # one row alone
        one = ops.attention(q[:, :, g : g + 1], k, v, mask[:, :, g : g + 1])
        assert torch.equal(one, got[:, :, g : g + 1])
    if G > 1:  # a chunk whose rows differ (one sees a key less): summed row by row
        mixed = mask.clone()
        mixed[:, :, -1, 0] = False
        other = ops.attention(q, k, v, mixed)
        assert torch.equal(other[:, :, :-1], got[:, :, :-1])


@pytest.mark.parametrize(("R", "D"), [(3, 64), (19, 16)])  # rows summed together / one by one
def test_attention_reads_bf16_keys_and_values_exactly(ops, R, D):
    """bf16 K/V are widened to fp32 as they are read: the result is bit for bit the fp32 kernel's
    on the same values in fp32, ragged masks and garbage past them included."""
    gen = torch.Generator().manual_seed(4)
    B, Hk, L = 3, 2, 29
    q = torch.randn(B, Hk, R, D, generator=gen)
    kv = torch.randn(2, B, Hk, L + 4, D, generator=gen).bfloat16()
    k, v = kv[0, :, :, :L], kv[1, :, :, :L]
    mask = (
        (torch.arange(L).view(1, L) < torch.tensor([29, 7, 1]).view(B, 1)).view(B, 1, 1, L).repeat(1, 1, R, 1)
    )
    k[1, :, 7:] = float("nan")  # never seen
    got = ops.attention(q, k, v, mask)
    assert torch.equal(got, ops.attention(q, k.float(), v.float(), mask))
    assert not got.isnan().any()
    with pytest.raises(RuntimeError, match="both alike"):
        ops.attention(q, k, v.float(), mask)


@pytest.mark.parametrize(("R", "dtype"), [(3, torch.float32), (3, torch.bfloat16), (12, torch.float32)])
def test_attention_reads_each_row_s_own_slot_in_place(ops, R, dtype):
    """With `slots`, batch row b reads slot slots[b] of the whole cache where it lies: bit for bit
    what it gives on the gathered copy (any slots, any order); a slot outside the cache is refused."""
    gen = torch.Generator().manual_seed(6)
    S, Hk, L, D = 7, 3, 21, 64
    slots = torch.tensor([5, 0, 3])  # unordered, with gaps
    B = len(slots)
    q = torch.randn(B, Hk, R, D, generator=gen)
    kv = torch.randn(2, S, Hk, L + 3, D, generator=gen).to(dtype)
    k, v = kv[0, :, :, :L], kv[1, :, :, :L]  # [S, Hk, L, D] strided views of a cache
    lens = torch.tensor([21, 4, 13])
    mask = (torch.arange(L).view(1, L) < lens.view(B, 1)).view(B, 1, 1, L).repeat(1, 1, R, 1)
    k[0, :, 4:] = float("nan")  # slot 0 (row 1) past its length: masked (its values never read)
    v[0, :, 4:] = float("nan")
    got = ops.attention(q, k, v, mask, slots)
    want = ops.attention(q, k.index_select(0, slots), v.index_select(0, slots), mask)
    assert torch.equal(got, want) and not got.isnan().any()
    one = ops.attention(q[:1], k, v, None, slots[:1])  # no mask: slot 5 sees all L keys
    assert torch.equal(one, ops.attention(q[:1], k[5:6], v[5:6], None))
    with pytest.raises(RuntimeError, match="outside k's 7 slots"):
        ops.attention(q, k, v, mask, torch.tensor([5, 0, 7]))


@pytest.mark.parametrize("N", [2, 5, 8])
def test_verify_block_rows_sum_their_shared_prefix_together_exactly(ops, N):
    """A verify block's rows (G query heads x N new tokens) all see the committed prefix and
    differ on the new keys: the prefix's values are summed for them together, the rest row by
    row. Bit for bit what each row gives alone; == SDPA."""
    gen = torch.Generator().manual_seed(5)
    B, Hk, G, D, P = 2, 3, 3, 64, 23  # P committed keys, then the block's N keys
    L = P + N
    q = torch.randn(B, Hk, G * N, D, generator=gen)
    kv = torch.randn(2, B, Hk, L + 2, D, generator=gen)
    k, v = kv[0, :, :, :L], kv[1, :, :, :L]
    causal = torch.ones(N, L, dtype=torch.bool).tril(P)  # new token n sees keys < P + n + 1
    mask = causal.repeat(G, 1).view(1, 1, G * N, L).expand(B, 1, G * N, L).clone()  # row g*N + n
    mask[1, :, :, P - 3 : P] = False  # batch row 1: a gap inside the prefix (a tree's siblings)
    got = ops.attention(q, k, v, mask)
    _close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    for r in range(G * N):
        one = ops.attention(q[:, :, r : r + 1], k, v, mask[:, :, r : r + 1])
        assert torch.equal(one, got[:, :, r : r + 1]), r


@pytest.mark.parametrize(
    ("B", "N", "dtype"), [(1, 1, torch.float32), (1, 8, torch.float32), (2, 5, torch.bfloat16)]
)
def test_attention_tokens_reads_and_writes_token_major_rows_in_place(ops, B, N, dtype):
    """attention_tokens takes q as the QKV product leaves it ([B, N, H, D], a strided view) and
    returns [B, N, H, D]: bit for bit `attention` on the permuted copy, permuted back."""
    gen = torch.Generator().manual_seed(7 + N)
    Hk, G, D, P = 3, 3, 64, 29
    L = P + N
    qkv = torch.randn(B * N, (Hk * G + 2 * Hk) * D, generator=gen)
    q = qkv[:, : Hk * G * D].view(B, N, Hk * G, D)  # not contiguous: rows of qkv
    kv = torch.randn(2, B, Hk, L + 2, D, generator=gen).to(dtype)
    k, v = kv[0, :, :, :L], kv[1, :, :, :L]
    causal = torch.ones(N, L, dtype=torch.bool).tril(P)
    mask = causal.repeat(G, 1).view(1, 1, G * N, L)  # row g * N + n
    want = ops.attention(
        q.reshape(B, N, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hk, G * N, D), k, v, mask
    )
    got = ops.attention_tokens(q, k, v, mask)
    assert got.shape == (B, N, Hk * G, D)
    assert torch.equal(got, want.view(B, Hk, G, N, D).permute(0, 3, 1, 2, 4).reshape(B, N, Hk * G, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("R", "D"), [(3, 64), (24, 64), (7, 128), (13, 64), (6, 32)])
def test_attention_value_pass_is_the_same_on_avx512_and_8_lanes(ops, dtype, R, D):
    """The AVX-512 value pass (6 rows, 64 elements at a time) and scores (6 rows, two keys a
    register) give bit for bit the 8-lane result: decode rows sharing a mask row, verify blocks
    (a shared prefix, then row by row), gaps, slots read in place, head sizes the value pass
    does not take (32: 8 lanes there)."""
    chosen = "AVX-512" in kernels.choices.get("attention", "")
    if not ops.attention_avx512(True):
        pytest.skip("no AVX-512F on this CPU")
    gen = torch.Generator().manual_seed(R * 100 + D)
    S, Hk, L = 4, 2, 70
    slots = torch.tensor([3, 0])
    q = torch.randn(2, Hk, R, D, generator=gen)
    kv = (torch.randn(2, S, Hk, L + 3, D, generator=gen) * 3).to(dtype)
    k, v = kv[0, :, :, :L], kv[1, :, :, :L]
    causal = torch.ones(R, L, dtype=torch.bool).tril(L - R)
    gap = causal.clone()
    gap[:, 10:13] = False  # a hole in the prefix every row sees
    cases = [(None, None), (causal.view(1, 1, R, L), None), (gap.view(1, 1, R, L), slots)]
    try:
        for mask, sl in cases:
            b = 1 if sl is None else 2
            args = (q[:b], k[:b] if sl is None else k, v[:b] if sl is None else v, mask, sl)
            ops.attention_avx512(False)
            lanes8 = ops.attention(*args)
            ops.attention_avx512(True)
            assert torch.equal(ops.attention(*args), lanes8)
    finally:
        ops.attention_avx512(chosen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_markov_argmax_is_the_greedy_markov_loop(ops, dtype):
    """markov_argmax == x_k = argmax(u[:, k-1] + table[x_{k-1}]) with off ids at -inf, slot by
    slot in PyTorch: the same ids, ties included (rounded values make equal sums common)."""
    g = torch.Generator().manual_seed(3)
    n, K, V = 3, 6, 50
    u = (torch.randn(n, K, V, generator=g) * 4).round()  # [n, K, V]
    table = (torch.randn(V + 1, V, generator=g) * 4).round().to(dtype)  # [V + 1, V]
    prev = torch.tensor([V, 0, 17])  # the "other" row, and two ids
    off = torch.zeros(V, dtype=torch.bool)
    off[[2, 40]] = True
    for o in (None, off):
        want, p = [], prev
        for k in range(K):
            logits = u[:, k] + table[p].float()
            p = (logits if o is None else logits.masked_fill(o, float("-inf"))).argmax(-1)
            want.append(p)
        assert torch.equal(ops.markov_argmax(u, table, prev, o), torch.stack(want, 1))
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.markov_argmax(u, table, torch.tensor([V + 1, 0, 0]), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_markov_topk_ranks_a_nodes_children_as_log_softmax_and_topk(ops, dtype):
    """markov_topk == topk(log_softmax(u + table[prev]) with off ids at -inf): the same ids in
    the same order (ties to the lower id) and the same log-probabilities up to rounding."""
    g = torch.Generator().manual_seed(5)
    V = 8 * 40 + 3  # whole vectors and a tail
    u = torch.randn(V, generator=g) * 3  # [V]
    table = (torch.randn(V + 1, V, generator=g) * 3).to(dtype)  # [V + 1, V]
    off = torch.zeros(V, dtype=torch.bool)
    off[[1, 7, V - 1]] = True
    for o in (None, off):
        for prev in (0, 17, V):
            s = u + table[prev].float()
            lp = torch.log_softmax(s if o is None else s.masked_fill(o, float("-inf")), -1)
            for k in (1, 4, 9):
                want = lp.topk(k)
                vals, ids = ops.markov_topk(u, table, prev, o, k)
                assert ids.tolist() == want.indices.tolist()
                torch.testing.assert_close(vals, want.values, rtol=0, atol=1e-5)
    ties = torch.zeros(V)
    ties[[30, 5, 200, V - 2]] = 2.0  # four equal best, in blocks and the tail
    vals, ids = ops.markov_topk(ties, torch.zeros(1, V), 0, None, 3)
    assert ids.tolist() == [5, 30, 200]
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.markov_topk(u, table, V + 1, None, 4)


def test_markov_argmax_takes_torchs_choice_on_nan_inf_and_ties(ops):
    """The vectorised argmax (no off ids) picks what torch.argmax picks: the first NaN, the first
    of equal maxima wherever they fall in the 8-lane blocks, index 0 for a row of -inf."""
    V = 8 * 37 + 5  # whole vectors and a tail
    rows = torch.full((6, V), -5.0)
    rows[0, [9, 14, 200, V - 1]] = 7.0  # ties in one block, in others, in the tail
    rows[1, [V - 2, V - 1]] = 3.0  # the maximum only in the tail
    rows[2, [11, 300]] = float("nan")  # NaN wins, the first one
    rows[2, 5] = float("inf")
    rows[3] = float("-inf")
    rows[4, [V - 3]] = float("nan")  # a NaN in the tail only
    rows[5, 0] = 1.0  # the very first id
    u = rows[:, None]  # [6, 1, V]: one slot per request, a zero table
    got = ops.markov_argmax(u, torch.zeros(1, V), torch.zeros(6, dtype=torch.long), None)[:, 0]
    assert got.tolist() == rows.argmax(-1).tolist() == [9, V - 2, 11, 0, V - 3, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_markov_sample_is_the_sampled_markov_loop(ops, dtype):
    """markov_sample == the loop the drafter runs without it: q_k = process_logits(u[:, k] +
    table[x_{k-1}], T) with off ids at -inf, x_k = sample(q_k, uniforms[:, k]): the same ids, q to
    rounding, never an off id."""
    from specdecode.config import SamplingParams
    from specdecode.sampling import process_logits, sample

    g = torch.Generator().manual_seed(4)
    n, K, V = 3, 6, 50
    u = torch.randn(n, K, V, generator=g) * 2  # [n, K, V]
    table = (torch.randn(V + 1, V, generator=g) * 2).to(dtype)  # [V + 1, V]
    prev = torch.tensor([V, 0, 17])
    off = torch.zeros(V, dtype=torch.bool)
    off[[2, 40]] = True
    uni = torch.rand(n, K, generator=g)
    for o in (None, off):
        for temp in (1.0, 0.5):
            want_ids, want_q, p = [], [], prev
            for k in range(K):
                logits = u[:, k] + table[p].float()
                logits = logits if o is None else logits.masked_fill(o, float("-inf"))
                q = process_logits(logits, SamplingParams(temp))
                p = sample(q, uni[:, k])
                want_ids.append(p)
                want_q.append(q)
            ids, q = ops.markov_sample(u, table, prev, o, uni, temp)
            assert torch.equal(ids, torch.stack(want_ids, 1))
            torch.testing.assert_close(q, torch.stack(want_q, 1), atol=1e-6, rtol=1e-5)
            if o is not None:
                assert not off[ids].any() and q[..., off].sum() == 0


def test_markov_sample_takes_its_max_over_the_ids_it_may_draw(ops):
    """Off ids are out of the max as well as the draw: a huge logit on an off id, in the 8-lane
    part of the row and in its tail, leaves q and the id those of the masked logits (a max that
    saw them would underflow every allowed exponential to zero)."""
    from specdecode.config import SamplingParams
    from specdecode.sampling import process_logits, sample

    g = torch.Generator().manual_seed(6)
    V = 53  # 6 vectors of 8 lanes and a tail of 5
    u = torch.randn(2, 1, V, generator=g)  # [2, 1, V]
    off = torch.zeros(V, dtype=torch.bool)
    off[[3, 50]] = True
    u[0, 0, 3] = u[1, 0, 50] = 1e4
    uni = torch.tensor([[0.3], [0.8]])
    ids, q = ops.markov_sample(u, torch.zeros(1, V), torch.zeros(2, dtype=torch.long), off, uni, 1.0)
    want_q = process_logits(u[:, 0].masked_fill(off, float("-inf")), SamplingParams(1.0))
    assert torch.equal(ids[:, 0], sample(want_q, uni[:, 0]))
    torch.testing.assert_close(q[:, 0], want_q, atol=1e-6, rtol=1e-5)
    assert q[..., off].sum() == 0


def test_markov_sample_draws_torchs_ids_over_a_real_vocabulary(ops):
    """Over a 32k vocabulary the running sums decide ids near interval ends: summed in double and
    rounded as torch.cumsum does, the kernel draws torch's ids (128 draws; fp32 sums differed in
    ~4 % of them)."""
    from specdecode.config import SamplingParams
    from specdecode.sampling import process_logits, sample

    g = torch.Generator().manual_seed(5)
    n, V = 64, 32000
    u = torch.randn(n, 1, V, generator=g) * 3  # [n, 1, V]: one position, read from the table's rows 0-1
    table = torch.zeros(2, V)
    uni = torch.rand(n, 1, generator=g)
    prev = torch.arange(n) % 2
    for temp in (1.0, 0.7):
        ids, _ = ops.markov_sample(u, table, prev, None, uni, temp)
        want = sample(process_logits(u[:, 0], SamplingParams(temp)), uni[:, 0])
        assert torch.equal(ids[:, 0], want)
