"""Today's decompose, causal null, GQA, dominance, compression, attribution, sensitivity and explorer outputs equal
the reference written by lens_parallel 0.6.0 before these analyses moved onto the one engine
(``tests/golden/make_golden.py``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from .golden import make_golden

GOLDEN = make_golden.HERE


@pytest.fixture(scope="module")
def frames():
    return make_golden.frames()


@pytest.fixture(scope="module")
def arrays():
    return make_golden.arrays()


def test_tables_equal_the_reference(frames):
    names = sorted(p.stem for p in GOLDEN.glob("*.csv"))
    assert sorted(frames) == names
    for name in names:
        expected = pd.read_csv(GOLDEN / f"{name}.csv")
        got = pd.read_csv(pd.io.common.StringIO(frames[name].to_csv(index=False, float_format="%.17g")))
        pd.testing.assert_frame_equal(got, expected, check_exact=True, obj=name)


def test_arrays_equal_the_reference(arrays):
    with np.load(GOLDEN / "arrays.npz") as reference:
        assert sorted(arrays) == sorted(reference.files)
        for name in reference.files:
            np.testing.assert_array_equal(arrays[name], reference[name], err_msg=name)
