"""Paged decode attention (kernel in interpret mode and reference) against float64 NumPy, against
dense decode attention, and the exact fp32 accumulator merge the runtime folds extents with."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kvoffload import ops
from kvoffload.errors import KVOffloadError
from kvoffload.testing.attention import check_paged
from kvoffload.testing.cases import case_id
from kvoffload.pallas.paged_attention import PagedLayoutError

# (kwargs of testing.attention.check_paged); every case has a row with M blocks and a row with none
_CASES = [
    dict(G=1, d=64, blk=16, dtype="float32"),
    dict(G=3, d=80, blk=64, dtype="bfloat16"),
    dict(G=4, d=80, blk=16, dtype="bfloat16", M=7, E=9),
    # blk not a power of two (padded tiles); the kernel walks the whole table in one program
    dict(G=4, d=64, blk=24, dtype="float32", M=3, num_splits=1),
]
_IDS = [case_id(check_paged, k) for k in _CASES]


@pytest.mark.parametrize("kw", _CASES, ids=_IDS)
def test_reference_vs_float64(kw):
    kw = {k: v for k, v in kw.items() if k != "num_splits"}  # a kernel launch parameter
    r = check_paged(mode="reference", **kw)
    assert r["ok"], r


@pytest.mark.parametrize("kw", _CASES, ids=_IDS)
def test_kernel_interpret_vs_float64(kw):
    r = check_paged(mode="interpret", **kw)
    assert r["ok"], r


def _pool(rng, E, n_kv, blk, d, dtype=jnp.float32):
    k = jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), dtype)
    v = jnp.asarray(rng.standard_normal((E, n_kv, blk, d)), dtype)
    return k, v


def _dense(blocks, table):
    """[E, n_kv, blk, d] + [B, M] table -> [B, n_kv, M*blk, d] (the rows' blocks in order)."""
    g = blocks[jnp.asarray(table)]
    B, M, n_kv, blk, d = g.shape
    return g.transpose(0, 2, 1, 3, 4).reshape(B, n_kv, M * blk, d)


def test_in_order_blocks_equal_dense_decode():
    """Blocks laid out in order: paged attention is dense decode attention over the same keys
    (the reference bit for bit, the kernel to fp32 rounding), with a non-default scale too."""
    rng = np.random.default_rng(11)
    B, n_kv, G, d, blk, M = 3, 2, 4, 64, 16, 4
    k, v = _pool(rng, B * M + 2, n_kv, blk, d)
    q = jnp.asarray(rng.standard_normal((B, n_kv * G, d)), jnp.float32)
    table = np.arange(B * M, dtype=np.int32).reshape(B, M)
    nb = jnp.array([M, 1, 0], jnp.int32)
    kd, vd = _dense(k, table), _dense(v, table)
    for scale in (None, 0.3):
        dense = ops.decode_attention(q, kd, vd, nb * blk, scale=scale, impl="reference")
        paged = ops.paged_decode_attention(q, k, v, table, nb, scale=scale, impl="reference")
        assert np.array_equal(np.asarray(paged[0]), np.asarray(dense[0]))
        assert np.array_equal(np.asarray(paged[1]), np.asarray(dense[1]))
    ker = ops.paged_decode_attention(q, k, v, table, nb, scale=0.3, impl="kernel",
                                     interpret=True)
    dk = dense  # scale 0.3
    np.testing.assert_allclose(np.asarray(ker[0]), np.asarray(dk[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ker[1]), np.asarray(dk[1]), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(ker[0])[2] == 0) and np.all(np.isneginf(np.asarray(ker[1])[2]))


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _random_acc(rng, B, H, d):
    out = rng.standard_normal((B, H, d)).astype(np.float32)
    out[0, 0, :3] = -0.0  # signed zeros must survive a no-op fold too
    return jnp.asarray(out), jnp.asarray(rng.uniform(-5, 20, (B, H)).astype(np.float32))


@pytest.mark.parametrize("part_dtype", [jnp.float32, jnp.bfloat16])
def test_merge_into_identities_are_bitwise(part_dtype):
    rng = np.random.default_rng(12)
    B, H, d = 3, 6, 80
    q = jnp.zeros((B, H, d), part_dtype)
    acc = _random_acc(rng, B, H, d)
    empty = ops.empty_attention(q)
    assert empty[0].dtype == jnp.float32 and empty[1].dtype == jnp.float32
    assert np.all(np.asarray(empty[0]) == 0) and np.all(np.isneginf(np.asarray(empty[1])))
    # folding an empty part (its out zeros, as attention over no keys returns) changes nothing
    empty_part = (jnp.zeros((B, H, d), part_dtype), jnp.full((B, H), -jnp.inf, jnp.float32))
    o, l = ops.merge_attention_into(acc, empty_part)
    assert o.dtype == jnp.float32 and l.dtype == jnp.float32
    assert np.array_equal(_bits(o), _bits(acc[0])) and np.array_equal(_bits(l), _bits(acc[1]))
    # folding a part into the empty accumulator returns the part (out cast to f32)
    part = (jnp.asarray(rng.standard_normal((B, H, d)), part_dtype).at[1, 2, :4].set(-0.0),
            jnp.asarray(rng.uniform(-5, 20, (B, H)), jnp.float32))
    o, l = ops.merge_attention_into(empty, part)
    assert np.array_equal(_bits(o), _bits(part[0].astype(jnp.float32)))
    assert np.array_equal(_bits(l), _bits(part[1]))
    # empty into empty stays empty; rows mix: only the empty rows of a part are left alone
    o, l = ops.merge_attention_into(empty, empty_part)
    assert np.array_equal(_bits(o), _bits(empty[0])) and np.array_equal(_bits(l), _bits(empty[1]))
    mixed = (part[0], part[1].at[0].set(-jnp.inf))
    o, l = ops.merge_attention_into(acc, mixed)
    assert np.array_equal(_bits(o[0]), _bits(acc[0][0])) and np.array_equal(_bits(l[0]),
                                                                             _bits(acc[1][0]))
    assert not np.array_equal(np.asarray(o[1:]), np.asarray(acc[0][1:]))


def test_merge_into_matches_merge_attention():
    """The pairwise fold and the n-ary merge_attention agree on non-empty parts."""
    rng = np.random.default_rng(13)
    acc = _random_acc(rng, 2, 4, 64)
    part = (jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32),
            jnp.asarray(rng.uniform(-5, 20, (2, 4)), jnp.float32))
    o, l = ops.merge_attention_into(acc, part)
    mo, ml = ops.merge_attention([acc, part])
    np.testing.assert_allclose(np.asarray(o), np.asarray(mo), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(l), np.asarray(ml), rtol=1e-6, atol=1e-6)


def test_two_extents_fold_to_whole_sequence():
    """A sequence whose blocks sit in two extents: attending each extent and folding the parts
    left to right equals attending the whole sequence; folding one more, empty, extent (what
    the `full` policy does) changes no bit."""
    rng = np.random.default_rng(14)
    B, n_kv, G, d, blk = 4, 2, 3, 64, 16
    ka, va, kb, vb = (rng.standard_normal((E, n_kv, blk, d)).astype(np.float32)
                      for E in (6, 6, 5, 5))
    q = jnp.asarray(rng.standard_normal((B, n_kv * G, d)), jnp.float32)
    # row b: its first na[b] blocks in extent A, the next nb[b] in extent B
    na = np.array([3, 0, 2, 3], np.int32)
    nb = np.array([2, 3, 0, 0], np.int32)
    ta = np.stack([rng.permutation(6)[:3] for _ in range(B)]).astype(np.int32)
    tb = np.stack([rng.permutation(5)[:3] for _ in range(B)]).astype(np.int32)
    S = 6 * blk
    kd = np.zeros((B, n_kv, S, d), np.float32)
    vd = np.zeros((B, n_kv, S, d), np.float32)
    for b in range(B):
        blocks = [(ka, va, ta[b, j]) for j in range(na[b])] + [(kb, vb, tb[b, j])
                                                               for j in range(nb[b])]
        for j, (kk, vv, e) in enumerate(blocks):
            kd[b, :, j * blk:(j + 1) * blk] = kk[e]
            vd[b, :, j * blk:(j + 1) * blk] = vv[e]
    whole = ops.decode_attention(q, kd, vd, (na + nb) * blk)
    acc = ops.empty_attention(q)
    acc = ops.merge_attention_into(acc, ops.paged_decode_attention(
        q, ka, va, ta, na, impl="kernel", interpret=True))
    acc = ops.merge_attention_into(acc, ops.paged_decode_attention(q, kb, vb, tb, nb))
    np.testing.assert_allclose(np.asarray(acc[0]), np.asarray(whole[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acc[1]), np.asarray(whole[1]), rtol=1e-5, atol=1e-6)
    extra = ops.paged_decode_attention(q, kb, vb, tb, np.zeros(B, np.int32))
    again = ops.merge_attention_into(acc, extra)
    assert np.array_equal(_bits(again[0]), _bits(acc[0]))
    assert np.array_equal(_bits(again[1]), _bits(acc[1]))


def test_joined_extents_attend_as_one_call_per_extent():
    """ops.join_block_tables: three extents laid end to end (their blocks concatenated) and their tables joined
    give, row by row, extent 0's listed blocks then extent 1's then extent 2's, packed at the front and offset
    into the joined blocks (stale entries past a row's count never leak in); one paged attention over the
    joined extents equals one per extent folded in order, empty rows included (the kernel against this
    reference: the tests above)."""
    rng = np.random.default_rng(15)
    B, n_kv, G, d, blk = 5, 2, 2, 32, 8
    sizes = (4, 6, 3)
    ks = [rng.standard_normal((E, n_kv, blk, d)).astype(np.float32) for E in sizes]
    vs = [rng.standard_normal((E, n_kv, blk, d)).astype(np.float32) for E in sizes]
    q = jnp.asarray(rng.standard_normal((B, n_kv * G, d)), jnp.float32)
    # random tables (entries past a row's count are garbage on purpose) and counts, a row with none at all
    widths = (3, 4, 2)
    tables = [rng.integers(0, E, (B, M)).astype(np.int32) for E, M in zip(sizes, widths)]
    counts = [np.array([3, 0, 1, 2, 0]), np.array([4, 2, 0, 1, 0]), np.array([1, 2, 2, 0, 0])]
    counts = [c.astype(np.int32) for c in counts]
    table, count = ops.join_block_tables(tables, counts, sizes)
    offsets = np.cumsum((0,) + sizes[:-1])
    for b in range(B):
        want = [int(t[b, j]) + int(o) for t, c, o in zip(tables, counts, offsets) for j in range(c[b])]
        assert int(count[b]) == len(want)
        assert np.asarray(table)[b, :len(want)].tolist() == want
    k_all, v_all = np.concatenate(ks), np.concatenate(vs)
    one = ops.paged_decode_attention(q, k_all, v_all, table, count, impl="reference")
    acc = ops.empty_attention(q)
    for k, v, t, c in zip(ks, vs, tables, counts):
        acc = ops.merge_attention_into(acc, ops.paged_decode_attention(q, k, v, t, c, impl="reference"))
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(acc[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(one[1]), np.asarray(acc[1]), rtol=1e-5, atol=1e-6)
    assert np.isneginf(np.asarray(one[1])[4]).all()  # row 4 attends nothing
    t1, c1 = ops.join_block_tables(tables[:1], counts[:1], sizes[:1])  # one extent: itself
    assert np.array_equal(np.asarray(t1), tables[0]) and np.array_equal(np.asarray(c1), counts[0])


def test_ops_jit_validation_and_empty_table():
    rng = np.random.default_rng(15)
    k, v = _pool(rng, 4, 2, 16, 64)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    table = jnp.array([[1, 3], [2, 0]], jnp.int32)
    nb = jnp.array([2, 1], jnp.int32)
    eager = ops.paged_decode_attention(q, k, v, table, nb)
    jitted = jax.jit(lambda *a: ops.paged_decode_attention(*a))(q, k, v, table, nb)
    assert np.array_equal(np.asarray(eager[0]), np.asarray(jitted[0]))
    with pytest.raises(ValueError):
        ops.paged_decode_attention(q, k, v, table, nb, impl="bogus")
    with pytest.raises(PagedLayoutError) as e:
        ops.paged_decode_attention(q, k, v[:, :, :8], table, nb)
    assert isinstance(e.value, KVOffloadError) and "v_blocks" in str(e.value)
    with pytest.raises(PagedLayoutError):
        ops.paged_decode_attention(q[:, :3], k, v, table, nb)  # 3 heads over 2 kv heads
    for impl in ("reference", "kernel"):  # a table with no columns: attention over no keys
        o, l = ops.paged_decode_attention(q, k, v, jnp.zeros((2, 0), jnp.int32),
                                          jnp.zeros(2, jnp.int32), impl=impl, interpret=True)
        assert o.shape == q.shape and np.all(np.asarray(o) == 0)
        assert np.all(np.isneginf(np.asarray(l)))
