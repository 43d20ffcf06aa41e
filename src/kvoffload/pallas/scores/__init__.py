"""The selection's scores per KV head (GQA group aggregated), one module a method: exact q.K scores
(`exact`), Quest page bounds (`quest`), HATA Hamming scores on packed sign codes (`hata`) and the TokenSelect
soft vote (`tokenselect`); `common` holds what they share. `pallas.topk` turns scores into indices.

Score functions return float32 [B, n_kv, N] (N = tokens or pages), higher = more relevant, -inf for invalid
positions (>= lengths or >= num_pages). Every score function has a pure-jnp ``*_reference`` and a Pallas
(Triton) ``*_kernel`` of the same signature (plus ``interpret``, ``poison`` and launch parameters). All tiles
are powers of two; other sizes are padded in registers with masked loads and stores.
"""

from kvoffload.pallas.scores.exact import (  # noqa: F401
    topk_scores_exact_kernel,
    topk_scores_exact_reference,
)
from kvoffload.pallas.scores.hata import (  # noqa: F401
    hamming_distance,
    hata_encode,
    hata_scores_kernel,
    hata_scores_reference,
    popcount_swar,
)
from kvoffload.pallas.scores.quest import (  # noqa: F401
    quest_block_bounds_kernel,
    quest_block_bounds_reference,
    quest_page_minmax,
    quest_page_scores_kernel,
    quest_page_scores_reference,
)
from kvoffload.pallas.scores.tokenselect import (  # noqa: F401
    tokenselect_scores_kernel,
    tokenselect_scores_reference,
)

__all__ = [
    "topk_scores_exact_kernel", "topk_scores_exact_reference",
    "hamming_distance", "hata_encode", "hata_scores_kernel", "hata_scores_reference", "popcount_swar",
    "quest_block_bounds_kernel", "quest_block_bounds_reference", "quest_page_minmax", "quest_page_scores_kernel",
    "quest_page_scores_reference", "tokenselect_scores_kernel", "tokenselect_scores_reference",
]
