"""Configurations measured to lose accuracy warn when chosen (AccuracyWarning); accepted defaults do not."""

import warnings

import pytest

from kvoffload.errors import AccuracyWarning
from kvoffload.policies import make_policy


def _warnings(name, **options):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        make_policy(name, **options)
    return [str(w.message) for w in got if issubclass(w.category, AccuracyWarning)]


@pytest.mark.parametrize("name,options", [("clo", {}), ("clo", {"retrieval": "quest"}), ("tokenselect", {}),
                                          ("offload", {}), ("clo", {"retrieval": "quest", "topk": 4096})])
def test_defaults_and_quest_at_its_floor_do_not_warn(name, options):
    assert _warnings(name, **options) == []


@pytest.mark.parametrize("options,words", [
    ({"retrieval": "quest", "topk_min": 1024}, "fewer than 2048"),
    ({"retrieval": "quest", "topk": 256}, "fewer than 2048"),
    ({"retrieval": "hata"}, "random projections"),
    ({"host_dtype": "int4"}, "int4"),
])
def test_measured_losses_warn_naming_them(options, words):
    got = _warnings("clo", **options)
    assert len(got) == 1 and words in got[0]
