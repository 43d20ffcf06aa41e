"""The policy interface and registry.

A policy owns where K/V (and stored activations) live and how attention reaches them. The engine
only calls `prefill` once and `decode_step` per token; layered policies share one layer-by-layer
driver. New policies register a name and appear everywhere (CLI, eval runner) without other changes.
"""

from __future__ import annotations

from typing import Any, Callable

_REGISTRY: dict[str, Callable[..., "Policy"]] = {}


class Policy:
    name = "base"

    def prefill(self, model, tokens, lengths, capacity: int) -> tuple[Any, Any]:
        """tokens [B, T] right-padded, lengths [B] (host numbers, as `generate` passes them, or a device
        array) -> (logits at each last token [B, V], state).
        capacity: the most tokens any sequence will hold (prompt + generated)."""
        raise NotImplementedError

    def decode_step(self, model, state, tokens) -> tuple[Any, Any]:
        """tokens [B] (the tokens just chosen) -> (next logits [B, V], new state)."""
        raise NotImplementedError

    @staticmethod
    def check_step_tokens(model, tokens):
        """Refuses decode-step tokens that are not integers (1.7 would be cast and run) or, when they are host
        values (a list, numpy), outside the vocabulary. A device array's values are not read: that would
        sync the host every step, and the engine's own tokens are sampled in range."""
        import numpy as np

        from kvoffload.errors import GenerationInputError

        on_device = type(tokens).__module__.startswith("jax")
        arr = tokens if on_device else np.asarray(tokens)
        if arr.dtype.kind not in "iu" or arr.ndim != 1:
            raise GenerationInputError(f"decode_step takes a 1-D array of integer token ids [B], got dtype "
                                       f"{arr.dtype} and shape {tuple(arr.shape)}")
        if not on_device:
            vocab = int(model.config.vocab_size)
            bad = arr[(arr < 0) | (arr >= vocab)]
            if bad.size:
                raise GenerationInputError(f"decode_step tokens outside the vocabulary (size {vocab}): "
                                           f"{bad[:5].tolist()}")

    def describe(self, state=None) -> dict:
        """What the policy did (e.g. split points, bytes moved); shown in traces and eval reports. state: the
        last state of a run (what `prefill` / `decode_step` returned), for what that run did."""
        return {"policy": self.name}


def register_policy(name: str):
    def deco(factory):
        _REGISTRY[name] = factory
        factory.name = name
        return factory

    return deco


def policy_schema(name: str) -> dict:
    """name -> `options.Option` of every option a registered policy takes: its factory's `option_schema()`
    (every pipeline policy), else its signature's keyword parameters, untyped (the factory checks them)."""
    import inspect

    from kvoffload.policies.options import Option, PolicyOptionError

    _load_builtin()
    if name not in _REGISTRY:
        raise PolicyOptionError(f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    factory = _REGISTRY[name]
    if hasattr(factory, "option_schema"):
        return factory.option_schema()
    params = inspect.signature(factory).parameters.values()
    return {p.name: Option(p.name, "any", "(untyped: checked by the policy)",
                           default=None if p.default is p.empty else p.default)
            for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_options(name: str, given, spelled: dict | None = None) -> dict:
    """The options `given` for policy `name` (a dict or (name, value) pairs; strings from a command line or
    Python values), parsed by its schema: one PolicyOptionError naming an unknown, repeated or bad option.
    spelled: how the user wrote each option (a flag such as --split-point)."""
    from kvoffload.policies.options import parse_options

    from kvoffload.policies.options import PolicyOptionError

    schema = policy_schema(name)
    return parse_options(name, schema, given, spelled, getattr(_REGISTRY[name], "option_error", PolicyOptionError))


def policy_options(name: str) -> tuple[str, ...]:
    """The option names a registered policy takes."""
    return tuple(policy_schema(name))


def available_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def make_policy(name: str, **options) -> Policy:
    """The registered policy `name` built with `options`, each checked against its schema (`policy_schema`)."""
    checked = check_options(name, options)  # loads the built-in policies first
    return _REGISTRY[name](**checked)


def _load_builtin():
    import importlib
    import os
    import pkgutil

    for mod in pkgutil.iter_modules([os.path.dirname(os.path.abspath(__file__))]):  # this package's modules
        if mod.name != "base":
            importlib.import_module(f"kvoffload.policies.{mod.name}")
