"""Weights as a run places them: W_K / W_V split from the rest (streamed first), the layers resident or streamed
from host memory, parameters sharded over a mesh, and the eager moves between memories."""

from __future__ import annotations

import dataclasses

from kvoffload.device import memory as M
from kvoffload.device import sharding as S

KV_FIELDS = S.KV_FIELDS


def split_layer(lp):
    """(W_K/W_V part, the rest) of one layer's params (same dataclass, other fields None)."""
    fields = [f.name for f in dataclasses.fields(lp)]
    kv = dataclasses.replace(lp, **{f: None for f in fields if f not in KV_FIELDS})
    rest = dataclasses.replace(lp, **{f: None for f in fields if f in KV_FIELDS})
    return kv, rest


def join_layer(kv, rest):
    return dataclasses.replace(rest, **{f: getattr(kv, f) for f in KV_FIELDS if hasattr(kv, f)})


def without_layers(params):
    return dataclasses.replace(params, layers=())


class WeightPlacement:
    """`LayerPipeline`'s weights and moves (uses its opts, hooks, mesh, dev, rep, host_kind, x_by_token)."""

    def resident(self, model) -> int:
        """Layers whose weights stay on the GPU although the others stream (resident_layers)."""
        return min(self.opts.resident_layers, model.config.num_layers) if self.opts.offload_weights else 0

    def params(self, model):
        """The model's parameters as this run places them: as they are on one device; on a mesh sharded
        Megatron-style (device/sharding.py; a no-op for parameters already placed so)."""
        if self.mesh is None:
            return model.params
        key = id(model.params)
        if key not in self._sharded_params:
            S.check_divisible(model.config, self.tp)
            on_host = M.on_host(model.params.layers)
            self._sharded_params = {key: S.shard_params(model.params, self.mesh,
                                                        layers_kind=self.host_kind if on_host else None,
                                                        replicate_kv=self.replicate_kv(model))}
        return self._sharded_params[key]

    def replicate_kv(self, model) -> bool:
        """Whether each device keeps W_K / W_V whole: token-split activations recomputed from resident weights
        (streamed weights move their head shard, gathered whole once per layer over NVLink: `gathers_kv`)."""
        return (self.x_by_token and not self.opts.offload_weights and not M.on_host(model.params.layers)
                and self.hooks.recomputes(self, model))

    def gathers_kv(self, groups, plans, layer: int) -> bool:
        """Whether this step gathers the layer's streamed W_K / W_V head shards whole before its programs: on a
        mesh with activations split by token, where some GPU batch recomputes an extent of the layer (each
        device recomputes every head of its tokens). Once per layer: a gather inside the layer program
        would run again in every GPU batch's program."""
        return (self.x_by_token and self.opts.offload_weights
                and any(any(self.hooks.token_recompute(self, gr, pl, layer)) for gr, pl in zip(groups, plans)))

    def local(self, values):
        """Small host-made values as the programs take them: as they are on one device (uncommitted), on a
        mesh replicated over it (under jax.distributed a process's own arrays cannot enter a global program)."""
        return values if self.mesh is None else S.put(values, self.rep)

    def to_device(self, tree):
        """An eager move to device memory: on a mesh each array keeps its sharding (each device moves
        its shard over its own link)."""
        return M.to_device(tree, self.dev) if self.mesh is None else M.to_kind(tree, "device")

    def to_host(self, tree):
        return M.to_host(tree, self.dev) if self.mesh is None else M.to_host_like(tree, self.host_kind or "device")

    def layers(self, model):
        """Per layer: its weights where the run keeps them (host memory for streamed layers)."""
        layers = self.params(model).layers
        if not self.opts.offload_weights:
            return layers
        r = self.resident(model)
        key = (id(model.params), r)
        if key not in self._host_layers:
            streamed = layers[r:] if M.on_host(layers[r:]) else self.to_host(layers[r:])
            kept = self.to_device(layers[:r]) if r else ()
            self._host_layers = {key: tuple(kept) + tuple(streamed)}
        return self._host_layers[key]
