"""Issue 12's blind spots, kernel level (helpers/blind_spots.py): rejected draft tokens left in the KV, and a
``req_to_token`` row recycled while a stale forward still reads it. Both leave self-consistent records that
only the expected-token check sees: the first needs a pool of accepted tokens only, the second a pool keyed by
request identity (``expected_token_pool_indices``, SPEC 3.2). The reference here; the Numba twin under the CUDA
simulator in tests/numba_sim; the GPU backends below (marker ``gpu``).
"""
from __future__ import annotations

import pytest
from helpers.blind_spots import row_recycle, spec_reject
from helpers.gpu_guard import backend_or_skip

from canary import FailReason

TOKEN = int(FailReason.VERIFY_TOKEN)


def test_spec_reject_reports_the_rejected_positions_only():
    assert spec_reject() == [(6, TOKEN), (7, TOKEN)]


def test_spec_reject_is_blind_without_accepted_tokens():
    assert spec_reject(with_pool=False) == []


def test_row_recycle_is_caught_with_the_pool_keyed_by_identity():
    assert row_recycle(keyed_by_identity=True) == [(p, TOKEN) for p in range(6)]


def test_row_recycle_is_blind_with_the_pool_keyed_by_the_row():
    """Today's default: pool row X is recycled with req_to_token row X, so it holds B's tokens, which match B's
    records that A's stale forward reads. The blind spot the identity-keyed pool closes."""
    assert row_recycle(keyed_by_identity=False) == []


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_gpu_spec_reject(backend):
    pytest.importorskip("cupy")
    backend_or_skip(backend)
    assert spec_reject(backend, "cupy") == [(6, TOKEN), (7, TOKEN)]
    assert spec_reject(backend, "cupy", with_pool=False) == []


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_gpu_row_recycle(backend):
    pytest.importorskip("cupy")
    backend_or_skip(backend)
    assert row_recycle(backend, "cupy", keyed_by_identity=True) == [(p, TOKEN) for p in range(6)]
    assert row_recycle(backend, "cupy", keyed_by_identity=False) == []
