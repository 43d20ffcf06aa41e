"""Pallas (Triton) kernels of kvoffload, each beside a pure-jnp reference of the same
signature. Use them through :mod:`kvoffload.ops`, which picks one by platform."""

from kvoffload.pallas.decode_attention import (  # noqa: F401
    decode_attention_kernel,
    decode_attention_reference,
    merge_attention,
)
from kvoffload.pallas.gather import (  # noqa: F401
    gather_rows_kernel,
    gather_rows_reference,
    gather_rows_reference_host,
)
from kvoffload.pallas.paged_attention import (  # noqa: F401
    empty_attention,
    merge_attention_into,
    paged_decode_attention_kernel,
    paged_decode_attention_reference,
)
from kvoffload.pallas.quant import (  # noqa: F401
    QuantizedInt,
    decode_attention_int4_kernel,
    decode_attention_int4_reference,
    dequantize,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from kvoffload.pallas.recompute import recompute_kv_kernel, recompute_kv_reference  # noqa: F401
from kvoffload.pallas.sparse_attention import (  # noqa: F401
    sparse_attention_kernel,
    sparse_attention_reference,
)
from kvoffload.pallas.scores import (  # noqa: F401
    hata_encode,
    hata_scores_reference,
    quest_page_minmax,
    quest_page_scores_reference,
    tokenselect_scores_reference,
    topk_scores_exact_kernel,
    topk_scores_exact_reference,
)
from kvoffload.pallas.topk import select_topk  # noqa: F401

__all__ = [
    "decode_attention_kernel", "decode_attention_reference", "merge_attention",
    "paged_decode_attention_kernel", "paged_decode_attention_reference", "merge_attention_into",
    "empty_attention", "gather_rows_kernel", "gather_rows_reference", "gather_rows_reference_host",
    "QuantizedInt", "decode_attention_int4_kernel", "decode_attention_int4_reference",
    "dequantize", "pack_int4", "quantize_int4", "quantize_int8", "unpack_int4",
    "recompute_kv_kernel", "recompute_kv_reference",
    "sparse_attention_kernel", "sparse_attention_reference",
    "hata_encode", "hata_scores_reference", "quest_page_minmax", "quest_page_scores_reference",
    "select_topk", "tokenselect_scores_reference", "topk_scores_exact_kernel",
    "topk_scores_exact_reference",
]
