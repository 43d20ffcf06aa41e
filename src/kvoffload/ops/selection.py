"""The top-k of scores per KV head (`pallas.topk`), per device on its heads under a tensor-parallel mesh."""

from __future__ import annotations

from kvoffload.device import sharding as _sh
from kvoffload.pallas import topk as _tk


def select_topk(scores, k, *, lengths=None, num_sink=0, num_recent=0, page_size=1, counts=None, method="auto"):
    """`pallas.topk.select_topk` (the top-k per KV head, ascending, per-row counts); where the method resolves
    to "kernel" ("auto" on the GPU from 128K entries) its Pallas kernels run per device on its heads under a
    tensor-parallel mesh."""
    method = _tk.resolve_topk_method(method, scores.shape[-1])

    def run(s, n, c):
        return _tk.select_topk(s, k, lengths=n, num_sink=num_sink, num_recent=num_recent, page_size=page_size,
                               counts=c, method=method)

    if method != "kernel":
        return run(scores, lengths, counts)
    heads, rep = _sh.KV_SPEC, _sh.REPLICATED
    return _sh.per_shard(run, (heads, rep, heads), (heads, heads))(scores, lengths, counts)


def topk_indices(scores, k, *, lengths=None, num_sink=4, num_recent=64, page_size=1):
    """``select_topk`` with the library's default sink (4) / recent (64) windows."""
    return select_topk(scores, k, lengths=lengths, num_sink=num_sink,
                       num_recent=num_recent, page_size=page_size)
