"""Top-k over activations, the pieces: the gather of activation rows from headless
extents [E, blk, H] (reference, the Pallas kernel in interpret mode, a host extent), and `act_rows`: the
selected tokens' K/V recomputed from the X rows of the union of the heads' selections, against NumPy
(LLaMA: RoPE at each token's own position). CPU, fp32."""

import jax
import jax.numpy as jnp
import numpy as np

from kvoffload import ops
from kvoffload.models import tiny_random_model
from kvoffload.models.transformer import family
from kvoffload.device import memory as M
from kvoffload.pallas import gather as _ga
from kvoffload.policies.selection.rows import act_rows
from kvoffload.policies.selection.space import union_tiers


def test_headless_gather_rows_reference_kernel_and_host():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 16, 300)).astype(np.float32)  # 300: column tiles with a ragged last one
    block = rng.integers(-1, 6, size=(2, 37)).astype(np.int32)  # -1 and 5: outside, rows of 0
    offset = rng.integers(0, 16, size=(2, 37)).astype(np.int32)
    inside = (block >= 0) & (block < 5)
    want = np.where(inside[..., None], x[np.clip(block, 0, 4), offset], 0)
    np.testing.assert_array_equal(_ga.gather_rows_reference(jnp.asarray(x), block, offset), want)
    np.testing.assert_array_equal(_ga.gather_rows_kernel(jnp.asarray(x), block, offset, interpret=True, poison=True),
                                  want)
    # tokens over two extents, from host memory, -1 reading nothing
    ext = [rng.normal(size=(n, 4, 24)).astype(np.float32) for n in (3, 2)]
    tok = np.asarray([[0, 7, 19, -1], [12, 3, -1, 13]], np.int32)
    got = jax.jit(ops.gather_pool_rows, static_argnums=2)([M.to_host(jnp.asarray(e)) for e in ext], jnp.asarray(tok), 4)
    flat = np.concatenate(ext)
    np.testing.assert_array_equal(np.asarray(got), np.where((tok >= 0)[..., None], flat[tok // 4, tok % 4], 0))
    q = ops.quantize_int4(jnp.asarray(x[..., :256]), 64)  # int4 X: codes and scales gathered alike
    rows = ops.gather_block_rows(q, block, offset)
    np.testing.assert_allclose(np.asarray(ops.dequantize(rows, jnp.float32)),
                               np.where(inside[..., None], np.asarray(ops.dequantize(q, jnp.float32))[
                                   np.clip(block, 0, 4), offset], 0), atol=1e-6)


def test_act_rows_recompute_the_union_against_numpy():
    """Per (request, head) a different set of tokens: one X row per token of the union is read, and each
    head's rows are its tokens' K/V, recomputed at their own positions (RoPE), as the layer computed them."""
    model = tiny_random_model("llama", seed=1)
    cfg, lp = model.config, model.params.layers[1]
    fam = family(cfg)
    rng = np.random.default_rng(2)
    B, n_kv, K, blk, N = 2, cfg.num_kv_heads, 5, 4, 24
    x_all = rng.normal(size=(B, N, cfg.hidden_size)).astype(np.float32)  # request b's token t: x_all[b, t]
    # the pool token space: request 0 owns blocks 0-2, request 1 blocks 3-5 (positions 0..11 each)
    owner_tok = np.repeat(np.arange(6) // 3, blk)
    positions = np.tile(np.arange(12), 2).astype(np.int32)
    flat = x_all[owner_tok, positions]  # [N, H]
    acts = [M.to_host(jnp.asarray(flat[:12].reshape(3, blk, -1))), M.to_host(jnp.asarray(flat[12:].reshape(3, blk, -1)))]
    idx = np.zeros((B, n_kv, K), np.int32)
    nv = np.asarray([[5, 3], [2, 0]], np.int32)
    for b in range(B):
        for h in range(n_kv):
            idx[b, h, :nv[b, h]] = np.sort(rng.choice(np.arange(12) + 12 * b, nv[b, h], replace=False))
    valid = np.arange(K) < nv[..., None]
    (k, v), count = jax.jit(act_rows, static_argnums=(0, 3, 7, 8))(
        cfg, lp, acts, blk, jnp.asarray(positions), jnp.asarray(idx), jnp.asarray(valid), True, jnp.float32)
    for b in range(B):
        assert int(count[b]) == len({int(t) for h in range(n_kv) for t in idx[b, h, :nv[b, h]]})
    # the reference: K/V of every token of the request at its position, through the family's own path
    want_k, want_v = fam.recompute_kv(cfg, lp, jnp.asarray(x_all[:, :12]), jnp.tile(jnp.arange(12), (B, 1)))
    for b in range(B):
        for h in range(n_kv):
            for j in range(nv[b, h]):
                t = idx[b, h, j] - 12 * b
                np.testing.assert_allclose(np.asarray(k[b, h, j]), np.asarray(want_k[b, h, t]), atol=1e-5)
                np.testing.assert_allclose(np.asarray(v[b, h, j]), np.asarray(want_v[b, h, t]), atol=1e-5)
    (v_only,), _ = jax.jit(act_rows, static_argnums=(0, 3, 7, 8))(
        cfg, lp, acts, blk, jnp.asarray(positions), jnp.asarray(idx), jnp.asarray(valid), False, jnp.float32)
    np.testing.assert_allclose(np.asarray(v_only) * valid[..., None], np.asarray(v) * valid[..., None], atol=1e-6)
    assert union_tiers(5, 2, 24) == [5, 10] and union_tiers(4, 32, 1000) == [4, 16, 64, 128]
