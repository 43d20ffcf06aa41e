"""A reference run (`full`) on the tiny model of a family, made once per test module: for fixtures parametrized
indirectly with the family ("opt" or "llama")."""

from kvoffload.models import tiny_random_model


def reference_for(cache: dict, family: str, make, seed: int = 1):
    """(family, model, *make(model)), computed on the first call for the family and kept in cache."""
    if family not in cache:
        model = tiny_random_model(family, seed=seed)
        cache[family] = (family, model, *make(model))
    return cache[family]
