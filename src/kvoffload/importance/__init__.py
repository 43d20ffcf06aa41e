"""Learned components: head-importance gates (DuoAttention-style) and HATA hash codes.

Head importance (flax train state + optax AdamW, orbax checkpoints)::

    from kvoffload.importance import TrainConfig, train_importance, load_scores
    res = train_importance(model, TrainConfig(steps=500, max_length=8192, out_dir="runs/imp"))
    alpha = load_scores("runs/imp")                 # [L, n_kv] in [0, 1]

Deployment (CLO): ``binarize(alpha, 0.5)`` (full-head mask), ``clo_thresholds(alpha, eta, p)``
(per-head reuse thresholds), ``group_similarity(cos, weights)`` (GQA harmonic-mean aggregation).

HATA (SGD with momentum)::

    from kvoffload.importance import HataConfig, train_hata, load_projections
    res = train_hata(model, HataConfig(steps=300, out_dir="runs/hata"))
    w = load_projections("runs/hata")               # [L, n_kv, head_dim, r]; codes: ops.hata_encode

CLI: ``kvoffload train-importance`` / ``kvoffload train-hata`` (:mod:`kvoffload.importance.cli`).
"""

from kvoffload.importance.data import PasskeyBatch, PasskeyData, PasskeySample, collate
# the deployment side (reading the trained files, thresholds, codes) lives in kvoffload.plan.deploy (below the
# policies that use it); re-exported here as this package's documented API
from kvoffload.plan.deploy import (
    binarize,
    clo_lambda,
    clo_thresholds,
    encode_keys,
    encode_queries,
    group_scores,
    group_similarity,
    highest_mask,
    load_projections,
    load_scores,
    lowest_mask,
    query_scores,
)
from kvoffload.importance.evaluate import passkey_accuracy
from kvoffload.importance.gating import (
    distillation_loss,
    final_hidden,
    gated_attention,
    stack_layers,
    student_hidden,
    teacher_hidden,
)
from kvoffload.importance.hata import (
    HataConfig,
    HataResult,
    collect_qk,
    recall_per_layer,
    save_projections,
    train_hata,
)
from kvoffload.importance.train import (
    TrainConfig,
    TrainResult,
    lr_schedule,
    save_scores,
    train_importance,
)

__all__ = [
    "PasskeyData", "PasskeySample", "PasskeyBatch", "collate",
    "binarize", "lowest_mask", "highest_mask", "clo_lambda", "clo_thresholds", "group_similarity",
    "group_scores", "query_scores", "passkey_accuracy",
    "gated_attention", "teacher_hidden", "student_hidden", "distillation_loss", "final_hidden", "stack_layers",
    "TrainConfig", "TrainResult", "train_importance", "save_scores", "load_scores", "lr_schedule",
    "HataConfig", "HataResult", "train_hata", "collect_qk", "recall_per_layer", "encode_keys",
    "encode_queries", "save_projections", "load_projections",
]
