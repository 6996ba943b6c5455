"""The sampled tokens of transformers' continuous batching accepted as the requests' expected tokens (a mixin of
:class:`canary.integrations.hf_session.Session`): after the engine's ``update_batch``, or with sync batching
behind the next forward's launch (:meth:`Accepts.accept_kept`)."""
from __future__ import annotations

import time


def bucket(n: int, cap: int) -> int:
    """The power of two at or above ``n`` (at most ``cap``, at least 1): the padded size of a batch dimension,
    so that a batch that changes size every few steps reuses a handful of shapes (and the manager's graphs)."""
    return min(cap, 1 << max(0, n - 1).bit_length())


class Accepts:
    """Session state it uses: ``canary``, ``live``, ``cols``, ``staged``, ``max_batch``, ``defer_accept``,
    ``_kept``, ``_fork_moves``, ``move_fork_records``, ``_ios``, ``_drop``; ``_t`` / ``_m`` / ``_x`` host time."""

    def on_update(self) -> None:
        """The engine appended the tokens it kept to the states of the batch it just updated: accept them (and
        copy the records of the blocks its forks copied, the engine's copy being queued by now). Sync batching:
        only the batch is kept here; its tokens are accepted in the next :meth:`end_step`, behind the next
        forward's launch (:meth:`accept_kept`)."""
        if self._fork_moves[0]:
            self.move_fork_records()
        t = time.perf_counter()
        kept, self._kept = self._kept, None
        if kept is not None:  # the last batch's (no end_step since: a step without a protected row)
            self._accept(kept)
        batch = self._ios()[0].requests_in_batch
        if self.defer_accept:
            # The states hold these tokens until the engine's next update_batch, which comes after the next
            # end_step; every hook that could end or move a request first accepts them (accept_kept).
            self._kept = list(batch)
        else:
            self._accept(batch)
        took = time.perf_counter() - t
        self._t += took
        self._x += took

    def accept_kept(self, fed: bool = False) -> None:
        """Accept the tokens of the batch :meth:`on_update` kept (none kept: nothing). Why the next step's verify
        does not need them (SPEC 3.2): a step verifies positions below its ``prefix_lens``, whose tokens were
        sampled two steps or more before it; the token sampled by step N is read back (as an expected token) by
        step N + 2's verify, which comes after step N + 1's ``end_step``. ``fed`` (end_step, right after the
        ``after_kv_store`` of the step that read them as inputs): ``fed_to_last_step``, so that this step's
        report names the requests for the positions it wrote, as when they were accepted before it (attribution
        counts a request's positions by the tokens its step planned with: canary/manager/attribution.py)."""
        batch, self._kept = self._kept, None
        if batch is not None:
            t = time.perf_counter()
            self._accept(batch, fed)
            self._t += time.perf_counter() - t

    def _accept(self, batch: list, fed: bool = False) -> None:
        # One token a row, in the batch's row order and padded as its step was (None: a row that took none here):
        # the next step over the same batch appends them on the device, and every accept of a batch size has the
        # same shape (the manager's graphs hold its scatter)
        rids, toks, more, one = [], [], [], False
        room = self.cols + 1  # the expected-token pool's columns
        live = self.live
        for fs in batch:
            st = fs.state
            rid = st.request_id
            rec = live.get(rid)
            rids.append(None)
            toks.append(0)
            if rec is None or rec.state is not st:
                continue
            gen = st.generated_tokens
            k = len(gen) - rec.generated
            if k and len(st.initial_tokens) + len(gen) > room:  # no max_new_tokens, past the pool: unprotected
                self._drop(rid)
                continue
            if k == 1:
                rids[-1] = rid
                toks[-1] = gen[-1]
                one = True
            elif k > 1:
                more.append((rid, gen[rec.generated:]))
            rec.generated = len(gen)
        if self.staged:
            pad = bucket(len(rids), self.max_batch) - len(rids)
            rids += [None] * pad
            toks += [0] * pad
        m = time.perf_counter()
        if one:
            self.canary.accept_tokens_batch(rids, toks, fed_to_last_step=fed)
        for rid, tokens in more:
            self.canary.accept_tokens(rid, tokens)
        self._m += time.perf_counter() - m
