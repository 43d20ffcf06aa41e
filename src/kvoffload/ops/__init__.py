"""Public jit-able building blocks of kvoffload: this package's names are its API, one module per kernel family
(`dispatch`: which implementation runs; `matmul`, `attention`, `paged`, `sparse`, `recompute`, `scores`,
`selection`, `gather`), each with its jitted kernel and reference and the public function that chooses between them.
Quantization (`quantize_int4`, ...) and the LSE merge are `pallas`'s, named here.

Every op takes ``impl="auto" | "kernel" | "reference"``: "auto" runs the Pallas
(Triton) kernel on GPU when the shapes are supported and the pure-jnp reference
otherwise (CPU, TPU, unsupported shapes); "kernel" forces the Pallas kernel (with
``interpret=True`` it runs anywhere, for tests); "reference" forces the reference.
All functions can be called inside ``jax.jit``.

Conventions
-----------
* KV cache layout: k, v [B, n_kv, S, d]. Query heads n_heads = n_kv * group; query
  head h uses kv head h // group (HF GQA convention).
* Attention returns (out [B, n_heads, d] in q.dtype, lse [B, n_heads] float32); an
  empty key set gives out = 0, lse = -inf. ``merge_attention`` combines partial
  results over disjoint key sets exactly (never concatenate K/V copies).
* Paged K/V: an extent of E token blocks, k_blocks, v_blocks [E, n_kv, blk, d]; row b owns
  the blocks block_table[b, :num_blocks[b]] in sequence order (``paged_decode_attention``).
  Results over several extents fold left to right into an fp32 accumulator that starts as
  ``empty_attention(q)``, with ``merge_attention_into`` (exact no-op for an empty part).
* Top-k: score functions return [B, n_kv, N] float32 (higher = better, -inf invalid);
  ``select_topk`` returns (indices [B, n_kv, K] int32, num_valid [B, n_kv] int32)
  for ``sparse_attention``.
* HATA packed sign codes: r bits (r % 32 == 0) packed into uint32 words, code shape
  [..., r // 32]; bit j = 1 where (x @ W)_j > 0, stored in word j // 32 at bit
  position j % 32 (LSB first): word_w = sum_i bit_{32w+i} << i. ``hata_encode``
  writes this format; codes produced elsewhere (the HATA trainer) must match it.
* Row gather: ``gather_block_rows(x, block, offset)`` takes rows x[block, head, offset] of one extent
  x [E, n_kv, blk, d] (device or host memory) into [B, n_kv, K, d] device memory; 0 where block is
  outside [0, E). A headless extent x [E, blk, H] (activations) takes block, offset [B, K] -> [B, K, H].
* int4: group-wise asymmetric (FlexGen) along the last dim, group 64 by default, or per channel over
  axis -2 (``scales="channel"``: a K block's tokens, KIVI); packed split-half: byte j = code[j] | code[j + D//2] << 4. See ``quantize_int4``.
"""

from kvoffload.ops.attention import (  # noqa: F401
    PREFILL_IMPLS,
    decode_attention,
    decode_attention_int4,
    prefill_attention_chunk_cudnn,
    prefill_attention_chunk_kernel,
)
from kvoffload.ops.dispatch import IMPLS, kernel_default, use_kernel  # noqa: F401
from kvoffload.ops.gather import (  # noqa: F401
    INT_REFILL_KERNEL,
    gather_block_rows,
    gather_block_rows_path,
    gather_pool_rows,
    refill_block_rows,
    zero_copy_gather_supported,
)
from kvoffload.ops.matmul import FEW_ROWS_MAX, matmul_f32, stacked_linear  # noqa: F401
from kvoffload.ops.paged import (  # noqa: F401
    empty_attention,
    join_block_tables,
    merge_attention_into,
    paged_decode_attention,
    window_block_table,
)
from kvoffload.ops.recompute import RECOMPUTE_KERNEL_MIN_TOKENS, recompute_kv  # noqa: F401
from kvoffload.ops.scores import (  # noqa: F401
    hata_scores,
    quest_block_bounds,
    quest_page_scores,
    tokenselect_scores,
    topk_scores_exact,
)
from kvoffload.ops.selection import select_topk, topk_indices  # noqa: F401
from kvoffload.ops.sparse import rows_attention, sparse_attention, sparse_attention_path  # noqa: F401
from kvoffload.pallas.decode_attention import merge_attention  # noqa: F401
from kvoffload.pallas.quant import SCALES as INT4_SCALES  # noqa: F401
from kvoffload.pallas.quant import (  # noqa: F401
    QuantizedInt,
    dequantize,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from kvoffload.pallas.scores import hamming_distance, hata_encode, quest_page_minmax  # noqa: F401
from kvoffload.pallas.topk import TOPK_METHODS  # noqa: F401

__all__ = [
    "decode_attention", "merge_attention", "paged_decode_attention", "merge_attention_into",
    "empty_attention", "sparse_attention", "sparse_attention_path", "prefill_attention_chunk_kernel",
    "prefill_attention_chunk_cudnn", "PREFILL_IMPLS",
    "recompute_kv", "topk_scores_exact", "quest_page_minmax", "quest_page_scores", "quest_block_bounds",
    "hata_encode", "hata_scores", "hamming_distance", "tokenselect_scores", "select_topk", "TOPK_METHODS",
    "topk_indices", "quantize_int4", "quantize_int8", "dequantize", "pack_int4", "unpack_int4",
    "QuantizedInt", "INT4_SCALES", "decode_attention_int4", "kernel_default", "gather_block_rows",
    "gather_pool_rows", "refill_block_rows",
    "gather_block_rows_path", "zero_copy_gather_supported", "IMPLS", "use_kernel",
    "matmul_f32", "stacked_linear", "FEW_ROWS_MAX", "rows_attention", "window_block_table", "join_block_tables",
    "RECOMPUTE_KERNEL_MIN_TOKENS", "INT_REFILL_KERNEL",
]
