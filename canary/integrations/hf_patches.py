"""The patch set that hooks the canary into transformers 5.17's continuous batching (canary.integrations.transformers).

transformers 5.17 has no hook for code around the forward of ``ContinuousBatchingManager``'s generation loop,
nor for request admission, sampled tokens or freed blocks (its public extension points are the scheduler
class, logits processors and the output handlers, none of which sees the forward or the cache). So the canary
wraps ten methods, **on the instances it is given** (never on the classes: another manager, or the same model
without the canary, runs untouched), each listed in :data:`PATCHES` with what it does and why, and undone by
:meth:`Attachment.detach`. Each wrapper calls the original first or last and changes none of its arguments or
results; the canary changes no engine state.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

from .hf_session import Session

log = logging.getLogger("kv_canary")
_ABSENT = object()

# (where, what the wrapper does, why there): the table of docs/integrations/transformers.md
PATCHES = (
    ("model.init_continuous_batching", "enables the canary on each ContinuousBatchingManager the model creates "
     "(generate_batch, continuous_batching_context_manager)", "enable(model) must reach managers built later, "
     "inside generate_batch"),
    ("manager._create_batch_processor", "adopts each batch processor (the hooks below); inside a generation loop "
     "opens the session's canary: a CanaryManager bound over the processor's cache and its own read index",
     "the processor, its cache and IO buffers exist only once this returns; warm-up calls it too, and must run "
     "with every block"),
    ("manager._run_generation_loop", "marks the loop's thread; at its end closes the session's canary on that "
     "thread (the last step's report delivered before stop() returns)",
     "the canary's step calls run on one thread; a session is one loop"),
    ("processor.model_runner.compute_batch", "before_forward before the forward, after_kv_store after it, on the "
     "engine's compute stream; with sync batching, then the last update_batch's tokens accepted",
     "the one call around the forward, its KV stores and its CUDA-graph replay or capture; the model's attention "
     "is inside"),
    ("processor.update_batch", "after it: accept the tokens the engine appended to the batch's request states "
     "(sync batching: keep the batch, accepted in the next compute_batch behind its forward)",
     "where sampled tokens become the requests' tokens (after EOS / length handling), as host ints"),
    ("processor.cache.free_blocks", "after it: finish_request, the request's row freed",
     "every exit of a request from the cache goes through it: finished, cancelled, failed, soft reset"),
    ("processor.offloading_manager._offload_to_cpu", "after it: the records of the slots of each request it copied "
     "out gathered into the canary's rows of its CPU blocks, on the compute stream; that request's next "
     "free_blocks keeps it protected", "the one place the engine copies KV blocks to its CPU pool, with the blocks "
     "still in the request's block table (they are freed next)"),
    ("processor.offloading_manager.restore_scheduled_requests", "before it: the CPU blocks of each protected "
     "request it restores; after it: their rows scattered into the slots of the blocks it copied the KV into",
     "the one place the engine copies KV back from its CPU pool (into blocks just allocated), before the step "
     "that reads them"),
    ("processor.cache.mark_shareable_blocks_as_complete", "around it (prefix block sharing): a block of a "
     "protected request swapped in place for an existing block with the same tokens whose records are not the "
     "canary's gets the request's records (move_records)", "the one place the engine swaps a request's block for "
     "another (when the block completes)"),
    ("processor.cache.fork_request", "after it (num_return_sequences > 1): each child of a protected request "
     "admitted with its own row and its parent's expected tokens; the records of each block the child holds in "
     "place of its parent's (a copy) copied from the parent's block (move_records) once update_batch returns, "
     "after the engine's copy_cache", "the one place the engine forks a request's blocks (by reference or for a "
     "copy), with both block tables at hand and the children's states registered"),
)


def processor_table(session: Session) -> dict:
    """The engine's block table (request -> its blocks) of the session's one full-attention group."""
    return session.cache.group_cache_managers[0].block_table


class PatchSet:
    """Instance attributes shadowing methods, undone in reverse order. The patched objects are held weakly: a
    batch processor the engine dropped (and its CUDA graphs) is freed as it would be without the canary."""

    def __init__(self) -> None:
        self._undo: list[tuple[weakref.ref, str, Any]] = []

    def wrap(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        prev = vars(obj).get(name, _ABSENT)
        setattr(obj, name, make(getattr(obj, name)))
        self._undo.append((weakref.ref(obj), name, prev))

    def undo(self) -> None:
        while self._undo:
            ref, name, prev = self._undo.pop()
            obj = ref()
            if obj is None:
                continue
            if prev is _ABSENT:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, prev)


class Attachment:
    """The canary on one ``ContinuousBatchingManager``: its patches, and its current :class:`Session`."""

    def __init__(self, handle: Any, manager: Any):
        self.handle = handle
        self._manager = weakref.ref(manager)  # the manager's own wrappers hold this attachment: no cycle kept alive
        self.patches = PatchSet()
        self.session: Session | None = None
        self.loop_thread: int | None = None
        self._adopted: weakref.WeakSet = weakref.WeakSet()
        self.patches.wrap(manager, "_create_batch_processor", self._create_batch_processor)
        self.patches.wrap(manager, "_run_generation_loop", self._run_generation_loop)
        if manager.batch_processor is not None:  # warmed up before enable(): adopt it now
            self.adopt(manager.batch_processor)

    def detach(self) -> None:
        manager = self._manager()
        if manager is not None and manager.is_running():
            raise RuntimeError("kv-canary: close: expected the ContinuousBatchingManager stopped, got it running "
                               "(stop() it first: the canary's step calls run on its generation thread)")
        self.patches.undo()

    # -- the manager's two hooks ------------------------------------------------------------------------------
    def _create_batch_processor(self, orig: Callable) -> Callable:
        def create_batch_processor():
            processor = orig()
            self.adopt(processor)
            if self.loop_thread == threading.get_ident() and self.session is None:
                self.begin_session(processor)
            return processor
        return create_batch_processor

    def _run_generation_loop(self, orig: Callable) -> Callable:
        def run_generation_loop():
            self.loop_thread = threading.get_ident()
            try:
                orig()
            finally:
                self.loop_thread = None
                self.end_session()
        return run_generation_loop

    # -- the processor's hooks -----------------------------------------------------------------------------------------
    def adopt(self, processor: Any) -> None:
        if processor in self._adopted:
            return
        self._adopted.add(processor)
        self.patches.wrap(processor.model_runner, "compute_batch", self._compute_batch)
        self.patches.wrap(processor, "update_batch", self._update_batch)
        self.patches.wrap(processor.cache, "free_blocks", self._free_blocks)
        self.patches.wrap(processor.cache, "fork_request", self._fork_request)
        if getattr(processor.cache, "use_prefix_sharing", False):
            self.patches.wrap(processor.cache, "mark_shareable_blocks_as_complete", self._complete)
        offloading = getattr(processor, "offloading_manager", None)
        if offloading is not None:
            self.patches.wrap(offloading, "_offload_to_cpu", self._offload_to_cpu)
            self.patches.wrap(offloading, "restore_scheduled_requests", self._restore)

    def _compute_batch(self, orig: Callable) -> Callable:
        def compute_batch(model, batch_data):
            session = self.session
            step = None if session is None else session.begin_step()
            if step is None:  # no session (warm-up, no loop) or no protected row in the batch
                return orig(model, batch_data)
            try:
                orig(model, batch_data)
            except BaseException:
                session.abort_step(step)
                raise
            session.end_step(step)
        return compute_batch

    def _update_batch(self, orig: Callable) -> Callable:
        def update_batch():
            orig()
            if self.session is not None:
                self.session.on_update()
        return update_batch

    def _free_blocks(self, orig: Callable) -> Callable:
        def free_blocks(request_id):
            orig(request_id)
            if self.session is not None:
                self.session.on_free(request_id)
        return free_blocks

    def _fork_request(self, orig: Callable) -> Callable:
        def fork_request(source_request_id, destination_request_ids):
            out = orig(source_request_id, destination_request_ids)
            if self.session is not None:
                self.session.on_fork(source_request_id, list(destination_request_ids))
            return out
        return fork_request

    def _complete(self, orig: Callable) -> Callable:
        def mark_shareable_blocks_as_complete(state, num_complete_blocks):
            session = self.session
            if session is None or not num_complete_blocks:
                return orig(state, num_complete_blocks)
            before = list(processor_table(session).get(state.request_id, ()))
            out = orig(state, num_complete_blocks)
            session.on_complete(state, before)
            return out
        return mark_shareable_blocks_as_complete

    def _offload_to_cpu(self, orig: Callable) -> Callable:
        def offload_to_cpu(victims):
            done = orig(victims)
            session = self.session
            if session is not None and session.cpu_rows is not None and done:
                session.on_offload(done)
            return done
        return offload_to_cpu

    def _restore(self, orig: Callable) -> Callable:
        def restore_scheduled_requests(requests_in_batch):
            session = self.session
            plan = session.before_restore(requests_in_batch) if session is not None and \
                session.cpu_rows is not None else []
            out = orig(requests_in_batch)
            if plan:
                session.on_restore(plan)
            return out
        return restore_scheduled_requests

    # -- sessions ---------------------------------------------------------------------------------------------
    def begin_session(self, processor: Any) -> None:
        try:
            self.session = Session(processor, self.handle.options, self.handle.deliver, self.handle.torch)
        except Exception as exc:
            self.handle.errors.append(exc)
            raise
        self.handle.sessions += 1

    def end_session(self) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        try:
            session.close()
        except Exception as exc:  # noqa: BLE001 - the loop has ended: nothing is left to raise it to
            self.handle.errors.append(exc)
            log.error("kv-canary: closing the session's canary raised %r", exc)
        finally:
            self.handle.retire(session)
