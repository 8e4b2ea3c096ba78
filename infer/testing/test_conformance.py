"""The conformance kit as pytest tests: run it on any installed backend with ::

    pytest --pyargs infer.testing --infer-backend mybackend

One test per op case and backend/dtype target (``infer_backend``, from the
kit's pytest plugin), plus the end-to-end tiny-model check. An op the
backend reports unsupported (:class:`~infer.errors.UnsupportedOpError`) is a
skip with the backend's reason; a wrong result is a failure that prints
hypothesis' smallest failing call.
"""

from __future__ import annotations

import warnings

import pytest

from infer.testing.cases import CASES, Case
from infer.testing.conformance import check_case
from infer.testing.tiny_model import VARIANTS, check_end_to_end


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_op(infer_backend, infer_examples: int, case: Case) -> None:
    result = check_case(case, infer_backend, max_examples=infer_examples)
    if result.status == "unsupported":
        pytest.skip(f"{infer_backend!r} does not support {case.name}: {result.detail}")
    if result.status == "wrong":
        pytest.fail(f"{infer_backend!r} is wrong on {case.name}:\n{result.detail}", pytrace=False)
    if result.unsupported_examples:
        warnings.warn(f"{infer_backend!r} {case.name}: {result.detail}", stacklevel=1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_end_to_end(infer_backend, variant: str) -> None:
    (result,) = check_end_to_end(infer_backend, variants=[variant])
    assert result.passed, result.describe()
