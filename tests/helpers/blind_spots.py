"""The canary's two blind spots of issue 12 as kernel-level scenarios, on any backend and array library.

Both leave KV records that are self-consistent (chain, positions, real KV): only the expected-token check can
see them, and only when the expected-token pool holds the right tokens in the right row.

- :func:`spec_reject`: speculative decoding leaves rejected draft tokens in the KV (an engine bug). The draft
  tokens' records are written by the write kernel (``input_ids`` = the drafts); the pool holds the ACCEPTED
  tokens only. The next verify reports ``VERIFY_TOKEN`` exactly at the rejected positions.
- :func:`row_recycle`: overlap scheduling frees request A's ``req_to_token`` row X and hands it to request B
  while a stale forward of A still reads it. Keyed by the row (today's default), the pool row X is recycled
  with it (B's tokens overwrite A's) and nothing fires; keyed by request identity
  (``expected_token_pool_indices``) A's pool row still holds A's tokens and verify reports ``VERIFY_TOKEN``.

Each returns the violations of the final verify as ``(position, reasons)`` pairs, sorted (the GPU ring's order
is decided by atomics). ``backend``: a canary / planner backend name; ``xp``: ``"numpy"`` (host arrays; the
reference, or Numba under its simulator) or ``"cupy"`` (device 0).
"""
from __future__ import annotations

import numpy as np

from helpers.plan_cases import to_numpy, to_xp

from canary import CanaryPlanner, CanaryRecords, CanaryState, VerifyPlan, WritePlan, scatter_expected_tokens

MAX_SEQ_LEN = 16
NUM_SLOTS = 64


class _Engine:
    """One canary, one planner over ``req_to_token`` [3, 16] and a pool of ``pool_rows`` rows, on ``xp``."""

    def __init__(self, backend: str, xp: str, pool_rows: int = 4):
        self.xp, self.backend = xp, backend
        device = "cpu" if xp == "numpy" else 0
        self.r2t_host = np.zeros((3, MAX_SEQ_LEN), dtype=np.int32)
        self.r2t = to_xp(self.r2t_host, xp)
        self.pool = to_xp(np.zeros((pool_rows, MAX_SEQ_LEN), dtype=np.int32), xp)
        self.vp = VerifyPlan.allocate(verify_capacity=64, device=device, max_reqs=self.r2t_host.shape[0])
        self.wp = WritePlan.allocate(write_req_capacity=2, device=device)
        self.planner = CanaryPlanner(verify_plan_out=self.vp, write_plan_out=self.wp, req_to_token=self.r2t,
                                     req_to_verify_expected_tokens=self.pool, backend=backend)
        self.canary = CanaryRecords(CanaryState.allocate(num_slots=NUM_SLOTS, ring_capacity=64, device=device),
                                    backend=backend)

    def a(self, values, dtype=np.int64):
        return to_xp(np.asarray(values, dtype=dtype), self.xp)

    def set_row(self, row: int, slots) -> None:
        """The engine's allocator: ``req_to_token[row, :len(slots)] = slots``."""
        self.r2t_host[row, : len(slots)] = slots
        self.r2t[row, : len(slots)] = self.a(slots, np.int32)

    def step(self, *, row: int, prefix: int, tokens=(), valid_len: int, pool_row: int | None = None,
             pool_tokens=None, pool_start: int | None = None) -> list[tuple[int, int]]:
        """Plan one step of one request; verify its prefix; write ``tokens`` at positions ``prefix...``; scatter
        ``pool_tokens`` (default: ``tokens``) into the pool row (``pool_row``: ``expected_token_pool_indices``;
        ``None``: keyed by ``row``) from column ``pool_start`` (default ``prefix``). Returns the verify's
        violations as sorted ``(position, reasons)`` pairs (the write's asserts are off: nothing to expect)."""
        e = len(tokens)
        rpi = self.a([row])
        q = None if pool_row is None else self.a([pool_row])
        self.planner.plan(req_pool_indices=rpi, prefix_lens=self.a([prefix]), extend_seq_lens=self.a([e]),
                          req_to_verify_expected_tokens_valid_lens=self.a([valid_len]),
                          expected_token_pool_indices=q, check=True)
        self.canary.verify(self.vp)
        found = sorted((v.position, int(v.reasons)) for v in self.canary.drain())
        if e:
            pos = np.arange(prefix, prefix + e)
            self.canary.write(self.wp, out_cache_loc=self.a(self.r2t_host[row, pos]), input_ids=self.a(tokens),
                              positions=self.a(pos))
            assert list(self.canary.drain()) == []
        pool_tokens = tokens if pool_tokens is None else pool_tokens
        if len(pool_tokens):
            start = prefix if pool_start is None else pool_start
            scatter_expected_tokens(req_to_verify_expected_tokens=self.pool,
                                    req_pool_indices=rpi if q is None else q, tokens=self.a(pool_tokens),
                                    token_offsets=self.a([0, len(pool_tokens)]), column_starts=self.a([start]),
                                    backend=self.backend)
        return found

    def pool_row(self, q: int) -> np.ndarray:
        return to_numpy(self.pool)[q]


def spec_reject(backend: str = "reference", xp: str = "numpy", *, with_pool: bool = True) -> list[tuple[int, int]]:
    """A request on row 1 (pool row 1) prefills tokens 0..3; a target-verify step writes the drafts D4..D7 at
    positions 4..7; D4, D5 are accepted, D6, D7 rejected, and the pool gets the accepted sequence: D4, D5, then
    the target's own tokens B6, B7 at positions 6, 7 (the bonus token and the next step's). The engine bug: the
    rejected drafts' KV stays where the request's positions 6, 7 are read. The next step verifies positions
    0..7. ``with_pool=False``: the pool holds the drafts as written (a pool filled from ``input_ids``), which is
    what no pool at all sees too."""
    eng = _Engine(backend, xp)
    eng.set_row(1, list(range(1, 9)))
    prompt, drafts, accepted = [10, 11, 12, 13], [14, 15, 16, 17], [14, 15, 26, 27]
    assert eng.step(row=1, prefix=0, tokens=prompt, valid_len=0) == []
    assert eng.step(row=1, prefix=4, tokens=drafts, valid_len=4, pool_tokens=accepted if with_pool else drafts) == []
    return eng.step(row=1, prefix=8, valid_len=8)


def row_recycle(backend: str = "reference", xp: str = "numpy", *, keyed_by_identity: bool) -> list[tuple[int, int]]:
    """Request A (req_to_token row 1, pool row 2 when keyed by identity) prefills 6 tokens on slots 1..6 and
    finishes; row 1 is handed to request B (pool row 3), which prefills its own 6 tokens on slots 11..16. A
    stale forward of A then verifies row 1 with A's length. Keyed by the row, pool row 1 now holds B's tokens."""
    eng = _Engine(backend, xp)
    qa, qb = (2, 3) if keyed_by_identity else (None, None)
    eng.set_row(1, list(range(1, 7)))
    assert eng.step(row=1, prefix=0, tokens=[100, 101, 102, 103, 104, 105], valid_len=0, pool_row=qa) == []
    eng.set_row(1, list(range(11, 17)))  # A finished; its row is reused while A's forward still reads it
    assert eng.step(row=1, prefix=0, tokens=[200, 201, 202, 203, 204, 205], valid_len=0, pool_row=qb) == []
    return eng.step(row=1, prefix=6, valid_len=6, pool_row=qa)
