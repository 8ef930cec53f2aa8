from __future__ import annotations

import warnings

import pytest

from lens_parallel.models import TOY_MODELS, load_model

FAMILIES = tuple(TOY_MODELS)
_MODELS: dict = {}


def get_model(spec: str):
    """Load each model once per test session (toys build in about a second; smollm2 in a few)."""
    if spec not in _MODELS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODELS[spec] = load_model(spec)
    return _MODELS[spec]


@pytest.fixture(params=FAMILIES)
def toy(request):
    return get_model(request.param)
