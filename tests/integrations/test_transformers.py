"""canary.integrations.transformers on a config-built tiny Llama (no download): a clean run changes no token and
reports nothing; each engine fault the canary exists for is reported, naming the requests it concerns.

Skips without torch or transformers 5.17 (the ``[transformers]`` extra). The CPU tests run the reference backend
in fp32 (a few seconds in all); the ``gpu`` ones run bf16 with the engine's CUDA graphs, sync and async batching.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("5.17."):
    pytest.skip(f"transformers {transformers.__version__}: the integration is pinned to 5.17",
                allow_module_level=True)

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import canary.integrations.transformers as kvc  # noqa: E402

BLOCK = 16
# Lengths chosen so that every request crosses a block boundary while decoding (a fresh allocation to hijack).
PROMPTS = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate((20, 9, 30, 14))]


def tiny_model(device: str = "cpu", dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def configs(new_tokens: int = 24, forks: int = 1, **cb):
    # forks > 1: num_return_sequences, which transformers allows with sampling only (seeded in run())
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=forks > 1, eos_token_id=-1,
                           **({"num_return_sequences": forks} if forks > 1 else {}))
    cb = ContinuousBatchingConfig(**({"block_size": BLOCK, "num_blocks": 32, "max_batch_tokens": 64,
                                      "allow_block_sharing": False} | cb))
    return gen, cb


def tokens(results) -> dict:
    return {rid: list(r.generated_tokens) for rid, r in results.items()}


def run(model, *, inject=None, new_tokens: int = 24, canary: bool = True, cancel: str | None = None,
        callback=None, expect: int | None = None, options: dict | None = None, prompts=None, forks: int = 1,
        internal: dict | None = None, **cb):
    """One session through the manager API; ``inject(step, processor)`` runs before each engine step's canary,
    ``callback(manager)`` makes the canary's ``on_violation``; ``forks``: ``num_return_sequences`` (sampled, the
    requests queued before the loop starts so that the batches, hence the samples, are the same every run);
    ``internal``: the handle's test-only options (hf_session.Options) set after enable. Returns (results by request id, handle or None)."""
    gen, cbc = configs(new_tokens, forks, **cb)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    handle = None
    if canary:
        options = dict(options or {}, **({} if callback is None else {"on_violation": callback(manager)}))
        handle = kvc.enable(manager, **options)
        for k, v in (internal or {}).items():
            setattr(handle.options, k, v)
    manager.warmup()  # builds the batch processor here, so that a test can wrap its step
    processor = manager.batch_processor
    # The engine allocates its KV cache with torch.empty and its attention reads slots no step wrote (the trash
    # slot, the masked tail of a block): heap bytes an earlier test left there can be NaN, and a sampled run's
    # multinomial then fails every request ("probability tensor contains either inf, nan ..."; GPU run 132 met
    # the same). An engine fault the canary has no part in: zeroed here, before any request, for every run alike.
    for cache in (*processor.cache.key_cache, *processor.cache.value_cache):
        cache.zero_()
    if inject is not None or cancel is not None:
        inner = processor.model_runner.compute_batch
        count = [0]

        def compute_batch(m, batch):
            if inject is not None:
                inject(count[0], processor)
            if cancel is not None and count[0] == 3:
                manager.cancel_request(cancel)
            count[0] += 1
            return inner(m, batch)
        processor.model_runner.compute_batch = compute_batch
    if forks > 1:
        torch.manual_seed(1)  # the engine samples with torch's global generator
        ids = manager.add_requests(PROMPTS if prompts is None else prompts, max_new_tokens=new_tokens)
        manager.start()
    else:
        manager.start()
        ids = manager.add_requests(PROMPTS if prompts is None else prompts, max_new_tokens=new_tokens)
    results = _collect(manager, ids, forks * len(ids) - (cancel is not None) if expect is None else expect)
    manager.stop(block=True)
    if handle is not None:
        handle.close()
    manager.destroy()
    return results, handle


def _collect(manager, ids, expect: int | None = None) -> dict:
    """The finished results, ``expect`` of them (default: one per id; a cancelled request delivers nothing)."""
    results: dict = {}
    while len(results) < (len(ids) if expect is None else expect):
        got = manager.get_result(timeout=180)  # a first GPU session compiles the canary's kernels
        if got is None:
            break
        if got.is_finished():
            results[got.request_id] = got
    return results


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    results, _ = run(model, canary=False)
    return tokens(results)


def test_clean_run_reports_nothing_and_changes_no_token(model, reference):
    owners = set()

    def inject(step, processor):  # who holds engine block 0: a real block, protected like any other
        owners.update(r for r, b in processor.cache.group_cache_managers[0].block_table.items() if 0 in b)

    results, handle = run(model, inject=inject)
    assert tokens(results) == reference and owners
    st = handle.stats()
    assert handle.violations == [] and st["violations"] == 0 and st["errors"] == []
    assert st["sessions"] == 1 and st["protected_requests"] == 4 and st["unprotected_requests"] == 0
    # every token fed to the model has its record: the prompts, then the generated tokens but the last
    assert st["written_entries"]["kv"] == sum(map(len, PROMPTS)) + 4 * 23
    assert st["verified_entries"]["kv"] > 0 and st["steps"] > 20 and st["host_us_per_step"]["steps"] == st["steps"]
    # sync batching: the accept runs in end_step, behind the forward, so part of the host time is not exposed
    assert st["exposed_us_per_step"]["steps"] == st["steps"]
    assert 0 < st["exposed_us_per_step"]["mean"] < st["host_us_per_step"]["mean"]


def test_requests_past_max_requests_run_unprotected_and_unharmed(model, reference):
    results, handle = run(model, options={"max_requests": 2})
    st = handle.stats()
    assert tokens(results) == reference and handle.violations == [] and st["errors"] == []
    # two rows: the other two requests (then those that take a freed row) run as padding rows the write skips
    assert st["protected_requests"] >= 2 and st["unprotected_requests"] >= 1
    assert st["protected_requests"] + st["unprotected_requests"] == 4


def test_the_device_path_on_cpu_tensors(model, reference):
    # The GPU's bookkeeping (the staged rows and lengths padded to a power of two, their cached views, the
    # engine's token buffers sliced per shape), on CPU tensors: what CI can run of it
    def inject(step, processor):
        if step == 8:
            s = _first_block(processor, "req_0") * BLOCK + 2
            flip_k_byte(processor, s)

    for fault in (None, inject):
        gen, cbc = configs()
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
        handle = kvc.enable(manager)
        handle.options.device_path = True
        manager.warmup()
        if fault is not None:
            inner, count = manager.batch_processor.model_runner.compute_batch, [0]

            def compute_batch(m, batch):
                fault(count[0], manager.batch_processor)
                count[0] += 1
                return inner(m, batch)
            manager.batch_processor.model_runner.compute_batch = compute_batch
        manager.start()
        out = _collect(manager, manager.add_requests(PROMPTS, max_new_tokens=24))
        manager.stop(block=True)
        handle.close()
        manager.destroy()
        if fault is None:
            assert tokens(out) == reference and handle.violations == [] and handle.stats()["errors"] == []
        else:
            assert [(v.position, v.request_ids) for v in handle.violations] == [(2, ("req_0",))]


def test_generate_batch_with_the_model_enabled(model, reference):
    gen, cb = configs()
    with kvc.enable(model) as handle:
        out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cb)
    assert tokens(out) == reference and handle.violations == [] and handle.stats()["sessions"] == 1
    assert "init_continuous_batching" not in vars(model)  # close() undid the model's patch
    assert tokens(model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cb)) == reference


def _first_block(processor, rid):
    return processor.cache.group_cache_managers[0].block_table[rid][0]


def flip_k_byte(processor, slot: int) -> None:
    """One bit of layer 0's K bytes of ``slot`` flipped (what a stray write does)."""
    processor.cache.key_cache[0].view(torch.uint8)[slot].view(-1)[5] ^= 0x10


def misread(processor) -> int | None:
    """This step's read index made to read req_1's slot of position 2 for req_0's position 2 (an engine's index
    construction gone wrong for one step); returns that slot, or None when the step reads no cache or misses
    either request."""
    io = processor.inputs_and_outputs
    batch = [fs.state.request_id for fs in io.requests_in_batch]
    if io.max_kv_read == 0 or not {"req_0", "req_1"} <= set(batch):
        return None
    starts = io.cumulative_seqlens_k["full_attention"]
    a, b = (int(starts[batch.index(r)]) + 2 for r in ("req_0", "req_1"))
    io.read_index_storage[0, a] = io.read_index_storage[0, b]
    return int(io.read_index_storage[0, b])


def decoding(io, rid: str) -> tuple[int, int] | None:
    """``(batch row, token index)`` of ``rid`` when it decodes in this step (one query token), else None."""
    batch = [fs.state.request_id for fs in io.requests_in_batch]
    if rid not in batch:
        return None
    r = batch.index(rid)
    q = [fs.query_length for fs in io.requests_in_batch]
    return (r, sum(q[:r])) if q[r] == 1 else None


def test_a_flipped_k_byte_is_reported_on_its_slot_and_request(model):
    at, slot = 8, []

    def inject(step, processor):
        if step == at:
            s = _first_block(processor, "req_0") * BLOCK + 2  # req_0's position 2
            flip_k_byte(processor, s)
            slot.append(s)

    _, handle = run(model, inject=inject)
    (v,) = [v for v in handle.violations if v.slot == slot[0]]
    assert v.reason_names == ("REAL_KV",) and v.position == 2 and v.request_ids == ("req_0",)
    assert at <= v.first_step <= at + 2


def test_a_wrong_slot_in_the_engines_read_index_is_reported(model):
    # The engine's index construction goes wrong for one step: req_0's position 2 reads req_1's slot of position
    # 2. The canary verifies the index attention reads (no mirror of the block lists), so it sees it.
    seen = []

    def inject(step, processor):
        slot = misread(processor) if step == 8 else None
        if slot is not None:
            seen.append(slot)

    _, handle = run(model, inject=inject)
    assert seen, "step 8 read no cache"
    named = [v for v in handle.violations if v.slot == seen[0] and v.position == 2]
    assert named and named[0].first_step in (8, 9), [v.line() for v in handle.violations]
    # req_0's expected token against req_1's record: the read of req_0 went wrong (the report names the requests
    # whose index maps the slot when it is read, a step later: req_1, its owner, once the index is right again)
    assert "VERIFY_TOKEN" in named[0].reason_names and "CHAIN" in named[0].reason_names
    assert (named[0].expected_token, named[0].stored_token) == (PROMPTS[0][2], PROMPTS[1][2])


@pytest.mark.parametrize("behind", [True, False], ids=["accept-behind-forward", "accept-in-update"])
def test_a_token_the_model_reads_but_did_not_sample_is_reported(model, behind):
    # The engine's input for req_0 in one decode step is not the token it sampled (a stale or overwritten
    # input_ids slot). The write records what the model read; the next step's verify holds it against the token
    # the engine accepted, which with sync batching is accepted only behind the next forward (Session.
    # accept_kept): it must still be there for that verify, one step after the bad write.
    at, seen = 10, []

    def inject(step, processor):
        io = processor.inputs_and_outputs
        row = decoding(io, "req_0") if step == at else None
        if row is None:
            return
        i = row[1]
        sampled = int(io.input_ids[i])
        io.input_ids[i] = (sampled % 127) + 1 if sampled != 127 else 1
        seen.append((int(io.position_ids[i]), sampled, int(io.input_ids[i])))

    _, handle = run(model, inject=inject, internal={"accept_behind_forward": behind})
    assert seen, "req_0 was not decoding at step 10"
    position, sampled, read = seen[0]
    named = [v for v in handle.violations if v.position == position and v.request_ids == ("req_0",)]
    assert named, [v.line() for v in handle.violations]
    v = named[0]
    assert "VERIFY_TOKEN" in v.reason_names and (v.expected_token, v.stored_token) == (sampled, read)
    assert v.first_step == at + 1


def test_a_callback_can_cancel_the_requests_it_names(model, reference):
    def inject(step, processor):
        if step == 8:
            processor.cache.key_cache[1].view(torch.uint8)[_first_block(processor, "req_3") * BLOCK].view(-1)[0] ^= 1

    def callback(manager):
        def on_violation(found):
            for rid in {r for v in found for r in v.request_ids}:
                manager.cancel_request(rid)
        return on_violation

    results, handle = run(model, inject=inject, callback=callback, expect=3)
    assert {v.request_ids for v in handle.violations} == {("req_3",)}
    assert sorted(results) == ["req_0", "req_1", "req_2"]  # req_3 cancelled; the others run to the end, unharmed
    assert {rid: tokens(results)[rid] for rid in results} == {rid: reference[rid] for rid in results}


def _hijack(victim, how):
    """An inject that, at step 5, hands ``victim``'s first block to the next request allocating one: ``how`` is
    "double" (the allocator returns the block although the victim holds it) or "freed" (the victim's block goes
    back to the free list while the victim still reads it). Returns (inject, [(who got it, the step of its first
    write into it)]): the allocation runs while the engine schedules the step after the last one injected."""
    got, seen = [], [0]

    def inject(step, processor):
        seen[0] = step
        if step != 5:
            return
        cm = processor.cache.group_cache_managers[0]
        bm = processor.cache._block_manager
        block = cm.block_table[victim][0]
        orig = cm.allocate_blocks
        if how == "freed":
            bm.free_blocks([block], shareable=False)
            bm._uninit_block_ids.remove(block)
            bm._uninit_block_ids.appendleft(block)  # handed out next

        def allocate_blocks(n, request_id, block_manager):
            done = orig(n, request_id, block_manager)
            table = cm.block_table.get(request_id, [])
            if not got and done and request_id != victim:
                if how == "double":  # the allocator's bug: the victim's block instead of a free one
                    block_manager.free_blocks([table[-1]], shareable=False)
                    table[-1] = block
                if block in table:
                    got.append((request_id, seen[0] + 1))
            return done
        cm.allocate_blocks = allocate_blocks

    return inject, got


@pytest.mark.parametrize("how", ["double", "freed"])
def test_a_block_given_to_a_second_request_is_reported_naming_both(model, how):
    inject, got = _hijack("req_2", how)
    _, handle = run(model, inject=inject)
    assert got and got[0][0] != "req_2", got
    (thief, wrote), = got
    # the victim reads its block again the step after the thief's first write into it: reported there, naming
    # the victim as the owner of the position and the thief as the writer of the slot
    named = [v for v in handle.violations if "req_2" in {r for r, _ in v.requests} and thief in v.request_ids]
    assert named, [v.line() for v in handle.violations]
    assert all(v.kernel == "verify" and thief in {r for r, _ in v.writers} for v in named)
    assert wrote < min(v.first_step for v in named) <= wrote + 2


def test_cancel_and_soft_reset_keep_the_canary_clean(model):
    # 8 blocks (7 with the canary's) for 4 requests growing to 13 blocks: decoding requests starve and are
    # evicted (soft reset: their KV dropped, their tokens prefilled again later under the same id)
    results, handle = run(model, cancel="req_1", num_blocks=8)
    st = handle.stats()
    assert handle.violations == [] and st["errors"] == []
    assert st["protected_requests"] > 4  # a soft-reset request comes back as a new request under its id
    assert sorted(results) == ["req_0", "req_2", "req_3"] and all(r.error is None for r in results.values())
    assert st["protected_tokens"] == 0  # every request finished in the canary too (cancelled, reset, done)


# -- CPU offload -----------------------------------------------------------------------------------------------
# 8 blocks for 4 requests growing to 13 blocks: decoding requests starve and the engine offloads some to its CPU
# pool (cpu_offload_space > 0), restoring them into other blocks when they are scheduled again
OFFLOAD = dict(num_blocks=8, cpu_offload_space=0.001)


@pytest.fixture
def cpu_pool(monkeypatch):
    """The engine allocates its CPU pool pinned, which torch refuses without an accelerator: unpinned there."""
    if not torch.cuda.is_available():
        empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))


@pytest.fixture(scope="module")
def offload_reference(model):
    pool = pytest.MonkeyPatch()
    if not torch.cuda.is_available():
        empty = torch.empty
        pool.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    try:
        results, _ = run(model, canary=False, **OFFLOAD)
    finally:
        pool.undo()
    return tokens(results)


def _offloaded(processor):
    """{request: its CPU blocks} of the requests waiting in the engine's CPU pool now."""
    return dict(processor.offloading_manager._request_id_to_cpu_blocks)


def test_cpu_offload_and_restore_keep_the_canary_clean(model, reference, offload_reference, cpu_pool):
    seen = set()

    def inject(step, processor):
        seen.update(_offloaded(processor))

    results, handle = run(model, inject=inject, **OFFLOAD)
    st = handle.stats()
    assert seen, "the engine offloaded nothing"
    assert tokens(results) == offload_reference == reference
    assert handle.violations == [] and st["errors"] == [] and st["move_faults"] == {}
    # every request protected from its first token to its last: offloaded ones kept their row, none soft reset
    assert st["protected_requests"] == 4 and st["unprotected_requests"] == 0 and st["protected_tokens"] == 0
    assert st["offloaded_requests"] == st["restored_requests"] >= len(seen)


def test_restored_kv_without_its_records_is_reported(model, cpu_pool, monkeypatch):
    # The control of the test above: the same run with the records left behind (no scatter at the restore) is
    # reported at every restored request's first read, so a clean offload run is clean because the records moved
    from canary.integrations import hf_session

    monkeypatch.setattr(hf_session.Session, "on_restore", lambda self, plan: None)
    _, handle = run(model, **OFFLOAD)
    assert handle.violations and handle.stats()["offloaded_requests"] >= 1


def test_a_byte_flipped_in_the_cpu_pool_is_reported_naming_the_request(model, cpu_pool):
    hit = []

    def inject(step, processor):
        waiting = _offloaded(processor)
        if hit or not waiting:
            return
        rid, cpu = next(iter(waiting.items()))
        # position 2 of the request (offset 2 of its first block), layer 0's K, in the engine's CPU copy
        processor.offloading_manager._cpu_key_cache[0][cpu[0], 2].view(torch.uint8).view(-1)[3] ^= 0x20
        hit.append(rid)

    results, handle = run(model, inject=inject, **OFFLOAD)
    assert hit and len(results) == 4
    named = [v for v in handle.violations if v.position == 2 and hit[0] in v.request_ids]
    assert named and all(v.reason_names == ("REAL_KV",) for v in named), [v.line() for v in handle.violations]
    assert {r for v in handle.violations for r in v.request_ids} == {hit[0]}


def test_a_restore_into_the_wrong_blocks_is_reported(model, cpu_pool):
    # The engine restores a request's first two blocks swapped (its KV, and the records that follow it, land in
    # each other's block) while its block table keeps the right order: the positions read there are wrong
    swapped = []

    def inject(step, processor):
        om = processor.offloading_manager
        if step or "restore_scheduled_requests" in getattr(om, "_test_wrapped", ()):
            return
        inner = om.restore_scheduled_requests
        table = processor.cache.group_cache_managers[0].block_table

        def restore_scheduled_requests(batch):
            victims = [fs.state.request_id for fs in batch if fs.state.is_cpu_offloaded]
            rid = next((r for r in victims if len(om._request_id_to_cpu_blocks[r]) >= 2), None)
            if swapped or rid is None:
                return inner(batch)
            blocks = table[rid]
            blocks[0], blocks[1] = blocks[1], blocks[0]
            try:
                inner(batch)
            finally:
                blocks[0], blocks[1] = blocks[1], blocks[0]
            swapped.append(rid)
        om.restore_scheduled_requests = restore_scheduled_requests
        om._test_wrapped = ("restore_scheduled_requests",)

    _, handle = run(model, inject=inject, **OFFLOAD)
    assert swapped, "no restore of two blocks or more"
    named = [v for v in handle.violations if swapped[0] in v.request_ids]
    assert named and {v.position for v in named} >= {0, BLOCK}, [v.line() for v in handle.violations]
    assert all("POSITION" in v.reason_names for v in named if v.position in (0, BLOCK))


# -- prefix block sharing --------------------------------------------------------------------------------------
# Two blocks of prompt shared by the four requests: a request scheduled once the first one's blocks are complete
# finds them (a prefix hit: it reads them from its first step); blocks completed by two requests at once are
# swapped in place for one of them
PREFIX = [(5 * j) % 120 + 3 for j in range(2 * BLOCK)]
SHARED = [PREFIX + [(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate((8, 3, 12, 5))]


@pytest.mark.parametrize("batch_tokens", [16, 64])
def test_prefix_sharing_keeps_the_canary_clean(model, batch_tokens):
    cb = dict(allow_block_sharing=True, max_batch_tokens=batch_tokens)
    ref, _ = run(model, canary=False, prompts=SHARED, **cb)
    shared = []

    def inject(step, processor):
        shared.append(processor.cache._total_prefix_length)

    results, handle = run(model, inject=inject, prompts=SHARED, **cb)
    st = handle.stats()
    assert shared[-1] > 0, "the engine shared no block"
    assert tokens(results) == tokens(ref) and handle.violations == [] and st["errors"] == []
    # the prefix hits are protected from their first step (the shared blocks verified against their own prompts)
    assert st["protected_requests"] == 4 and st["unprotected_requests"] == 0 and st["prefix_hits"] >= 1
    assert st["verified_entries"]["kv"] > 0


@pytest.mark.parametrize("batch_tokens", [16, 64])
def test_a_whole_prompt_prefix_hit_stays_clean(model, batch_tokens):
    # Prompts of exactly the shared blocks: the engine keeps one prompt token to compute and stores its KV again
    # into the shared block's last slot, which the other requests read in the same step (its bytes differ in the
    # last bits: another batch shape). The canary's verify runs ahead of the forward and the write after it, so
    # the record follows the new bytes; a verify behind the forward reported REAL_KV here (a reverted change).
    prompts = [PREFIX + [9, 8, 7, 6, 5], PREFIX, PREFIX, PREFIX + [1]]
    cb = dict(allow_block_sharing=True, max_batch_tokens=batch_tokens)
    ref, _ = run(model, canary=False, prompts=prompts, **cb)
    results, handle = run(model, prompts=prompts, **cb)
    st = handle.stats()
    assert tokens(results) == tokens(ref) and st["errors"] == []
    assert handle.violations == [], [v.line() for v in handle.violations]
    assert st["prefix_hits"] >= 1


def test_a_forward_that_raises_still_reports_its_bad_index(model):
    # A read index past the KV tensor makes the engine's gather raise inside the forward, which fails the batch:
    # the canary planned and verified that step ahead of the forward, so the slot is still reported (SLOT_RANGE),
    # naming the request: the report that explains the crash.
    seen = []

    def inject(step, processor):
        io = processor.inputs_and_outputs
        batch = [fs.state.request_id for fs in io.requests_in_batch]
        if step != 8 or io.max_kv_read == 0 or "req_0" not in batch:
            return
        at = int(io.cumulative_seqlens_k["full_attention"][batch.index("req_0")]) + 2
        io.read_index_storage[0, at] = processor.cache.key_cache[0].shape[0] + 1000
        seen.append(at)

    _, handle = run(model, inject=inject, expect=4)
    assert seen, "the batch at step 8 held no req_0"
    named = [v for v in handle.violations if "req_0" in v.request_ids]
    assert named and all("SLOT_RANGE" in v.reason_names for v in named), [v.line() for v in handle.violations]


@pytest.mark.parametrize("batch_tokens", [16, 64])
def test_prefix_sharing_with_unprotected_writers_stays_clean(model, batch_tokens):
    # Two canary rows for four requests: blocks an unprotected request wrote hold no records of the canary's, so
    # a prefix hit on them runs unprotected and a protected block swapped for one of them brings its records
    cb = dict(allow_block_sharing=True, max_batch_tokens=batch_tokens)
    ref, _ = run(model, canary=False, prompts=SHARED, **cb)
    results, handle = run(model, prompts=SHARED, options={"max_requests": 2}, **cb)
    st = handle.stats()
    assert tokens(results) == tokens(ref) and handle.violations == [] and st["errors"] == []
    assert st["unprotected_requests"] >= 1


def test_a_corrupted_shared_block_is_reported_for_its_readers(model):
    hit, readers = [], set()

    def inject(step, processor):
        table = processor.cache.group_cache_managers[0].block_table
        if not hit:
            holders = [r for r, b in table.items() if b and b[0] == table.get("req_0", [None])[0]]
            if len(holders) >= 2:
                s = table["req_0"][0] * BLOCK + 2  # position 2 of the shared prefix
                flip_k_byte(processor, s)
                hit.append(s)
        if hit:
            readers.update(fs.state.request_id for fs in processor.inputs_and_outputs.requests_in_batch
                           if table.get(fs.state.request_id, [None])[0] * BLOCK + 2 == hit[0])

    _, handle = run(model, inject=inject, prompts=SHARED, allow_block_sharing=True, max_batch_tokens=16)
    assert hit and len(readers) >= 2
    named = {r for v in handle.violations if v.slot == hit[0] for r in v.request_ids}
    assert all(v.reason_names == ("REAL_KV",) for v in handle.violations if v.slot == hit[0])
    assert named == readers, [v.line() for v in handle.violations]


# -- forks (num_return_sequences > 1) ----------------------------------------------------------------------------
# transformers forks a request with children once its prompt but the last token is prefilled: each child gets the
# parent's complete shareable blocks by reference and a copy of the others (all of them with sharing off), then
# every one of them prefills the last token and samples on its own
FORK_POOL = dict(num_blocks=64)  # 12 requests of up to 4 blocks: none starved (no soft reset in the counts)


def _children(rid: str, forks: int) -> set:
    return {f"{rid}__child#{i}" for i in range(forks - 1)}


@pytest.mark.parametrize("forks", [2, 3])
@pytest.mark.parametrize("sharing", [False, True], ids=["copied", "shared"])
def test_forks_keep_the_canary_clean(model, forks, sharing):
    ref, _ = run(model, canary=False, forks=forks, allow_block_sharing=sharing, **FORK_POOL)
    held = []

    def inject(step, processor):  # a child reading one of its parent's blocks (shared) or a copy of it
        table = processor.cache.group_cache_managers[0].block_table
        held.extend(c for c in _children("req_2", forks) if c in table and table[c][0] == table.get("req_2", [-1])[0])

    results, handle = run(model, inject=inject, forks=forks, allow_block_sharing=sharing, **FORK_POOL)
    st = handle.stats()
    assert sorted(results) == sorted({f"req_{i}" for i in range(4)} | {c for i in range(4)
                                                                      for c in _children(f"req_{i}", forks)})
    assert tokens(results) == tokens(ref) and handle.violations == [] and st["errors"] == []
    assert any(tokens(results)[c] != tokens(results)["req_2"] for c in _children("req_2", forks))  # sampled apart
    # every child protected from its fork, its own row; copies: the blocks at the fork (19, 8, 29, 13 prompt
    # tokens), all of them copied with sharing off, the last (incomplete) one each with it on
    assert st["protected_requests"] == 4 * forks and st["unprotected_requests"] == 0 and st["protected_tokens"] == 0
    assert st["forked_requests"] == 4 * (forks - 1)
    assert st["copied_blocks"] == (forks - 1) * (4 if sharing else 6)
    assert bool(held) == sharing and st["move_faults"] == {}


@pytest.mark.parametrize("pool", [dict(allow_block_sharing=True), dict(cpu_offload_space=0.001)],
                         ids=["soft-reset-shared", "offload"])
def test_forks_in_a_starved_pool_keep_the_canary_clean(model, pool, cpu_pool):
    # 8 blocks for 12 requests: the engine forks only the children it has blocks for (the others join the queue
    # as new requests, admitted at position 0), and evicts (soft reset) or offloads some of them later
    ref, _ = run(model, canary=False, forks=3, num_blocks=8, **pool)
    results, handle = run(model, forks=3, num_blocks=8, **pool)
    st = handle.stats()
    assert len(results) == 12 and tokens(results) == tokens(ref)
    assert handle.violations == [] and st["errors"] == [] and st["unprotected_requests"] == 0
    assert 1 <= st["forked_requests"] < 8 and st["protected_tokens"] == 0


def test_fork_copies_without_their_records_are_reported(model, monkeypatch):
    # The control of the test above: the same run with the records left behind (no copy with the fork's KV) is
    # reported at the children's first reads of their copied blocks, and names no parent
    from canary.integrations import hf_session

    def drop(self):
        self._fork_moves = ([], [])
    monkeypatch.setattr(hf_session.Session, "move_fork_records", drop)
    _, handle = run(model, forks=2)
    named = {r for v in handle.violations for r in v.request_ids}
    assert named == {f"req_{i}__child#0" for i in range(4)}, [v.line() for v in handle.violations]


@pytest.mark.parametrize("where", ["shared", "copied"])
def test_a_flipped_k_byte_a_fork_child_reads_is_reported_naming_its_readers(model, where):
    # shared: position 2 of req_2's first block, complete at the fork, held by the parent and its two children;
    # copied (sharing off): position 2 of child#0's own copy of its parent's first block
    hit, readers = [], set()
    rid = "req_2" if where == "shared" else "req_2__child#0"

    def inject(step, processor):
        table = processor.cache.group_cache_managers[0].block_table
        if not hit and "req_2__child#1" in table:
            s = table[rid][0] * BLOCK + 2
            flip_k_byte(processor, s)
            hit.append(s)
        if hit:
            readers.update(fs.state.request_id for fs in processor.inputs_and_outputs.requests_in_batch
                           if table.get(fs.state.request_id, [-1])[0] * BLOCK + 2 == hit[0])

    results, handle = run(model, inject=inject, forks=3, allow_block_sharing=where == "shared", **FORK_POOL)
    assert hit and len(results) == 12
    assert readers == ({"req_2"} | _children("req_2", 3) if where == "shared" else {rid})
    named = {r for v in handle.violations for r in v.request_ids}
    assert named == readers, [v.line() for v in handle.violations]
    assert all(v.reason_names == ("REAL_KV",) and v.slot == hit[0] and v.position == 2 for v in handle.violations)


def test_a_fork_copy_into_the_wrong_blocks_is_reported(model):
    # The engine's copy_cache writes a child's first two copied blocks into each other (its destinations
    # swapped) while the child's block table keeps them in order: the positions the child reads there are wrong
    swapped = []

    def inject(step, processor):
        cache = processor.cache
        if step or "copy_cache" in vars(cache):
            return
        inner, table = cache.copy_cache, cache.group_cache_managers[0].block_table

        def copy_cache(src, dst):
            dst = list(dst)
            for child in (r for r in table if "__child#" in r and len(table[r]) >= 2 and not swapped):
                i, j = dst.index(table[child][0]), dst.index(table[child][1])
                dst[i], dst[j] = dst[j], dst[i]
                swapped.append(child)
            return inner(src, dst)
        cache.copy_cache = copy_cache

    _, handle = run(model, inject=inject, forks=2)
    assert swapped, "no fork copied two blocks or more"
    # the records followed the child's block table, not the engine's copy: right tokens and positions, the other
    # block's KV bytes
    assert {r for v in handle.violations for r in v.request_ids} == {swapped[0]}, [v.line() for v in handle.violations]
    assert {v.position for v in handle.violations} >= {0, 1, BLOCK, BLOCK + 1}
    assert all(v.reason_names == ("REAL_KV",) and v.position < 2 * BLOCK for v in handle.violations)


def test_generate_batch_with_forks(model):
    gen, cb = configs(forks=2)
    with kvc.enable(model) as handle:
        out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cb)
    st = handle.stats()
    # generate_batch returns the parents' results only (transformers 5.17 orders them by the ids add_requests
    # returned); the children ran, protected
    assert sorted(out) == [f"req_{i}" for i in range(4)] and all(len(r.generated_tokens) == 24 for r in out.values())
    assert handle.violations == [] and st["errors"] == [] and st["forked_requests"] == 4
    assert st["protected_requests"] == 8


def test_refusals_name_the_fix(model, monkeypatch):
    gen, cb = configs()
    monkeypatch.setattr(model.config, "sliding_window", 8, raising=False)  # as a Mistral's config has it
    with kvc.enable(model):
        with pytest.raises(ValueError, match=r"^kv-canary: init_continuous_batching: .*sliding-window .*full "
                                             r"attention only"):
            model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cb)


def test_other_versions_are_refused_unless_forced(model, monkeypatch):
    # the module object import returns now (transformers swaps its lazy module in sys.modules on first use)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.18.0")
    with pytest.raises(RuntimeError, match=r"^kv-canary: enable: expected transformers 5\.17\.x .* force=True"):
        kvc.enable(model)
    kvc.enable(model, force=True).close()


def test_bad_options_and_targets():
    with pytest.raises(ValueError, match="^kv-canary: on_violation"):
        kvc.enable(object(), on_violation="print")
    with pytest.raises(ValueError, match="^kv-canary: layers"):
        kvc.enable(object(), layers="some")
    with pytest.raises(TypeError, match="^kv-canary: target"):
        kvc.enable(object())


def test_one_handle_per_model_and_manager(model):
    with kvc.enable(model):
        with pytest.raises(RuntimeError, match="^kv-canary: enable: expected a LlamaForCausalLM without the canary"):
            kvc.enable(model)
    kvc.enable(model).close()  # free again once closed


def test_the_example_runs_and_reports_the_flip():
    example = Path(__file__).resolve().parents[2] / "examples" / "transformers_continuous_batching.py"
    done = subprocess.run([sys.executable, str(example), "--device", "cpu", "--flip"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "5 requests, 160 tokens generated on cpu" in done.stdout
    assert "violations: 1 {'REAL_KV': 1}" in done.stdout
    assert "slot 3 position 3 REAL_KV layer 1 requests ['req_0']" in done.stdout


def test_importing_the_integration_imports_neither_torch_nor_transformers():
    code = ("import sys, canary.integrations.transformers as t\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- GPU: bf16, the engine's CUDA graphs, sync and async batching ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_cuda_graphs_clean_and_flipped(use_async):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    gpu = tiny_model("cuda", torch.bfloat16)
    opts = dict(use_cuda_graph=True, use_async_batching=use_async)
    ref, _ = run(gpu, canary=False, **opts)
    results, handle = run(gpu, **opts)
    assert tokens(results) == tokens(ref) and handle.violations == [] and handle.stats()["errors"] == []
    slot = []

    def inject(step, processor):
        if step == 8:  # on the compute stream: ordered behind the last forward and before the next
            s = _first_block(processor, "req_0") * BLOCK + 2
            with torch.cuda.stream(processor.inputs_and_outputs.compute_stream):
                flip_k_byte(processor, s)
            slot.append(s)

    _, handle = run(gpu, inject=inject, **opts)
    assert [v.request_ids for v in handle.violations if v.slot == slot[0]] == [("req_0",)]


@pytest.mark.gpu
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_cuda_graphs_forks_clean_and_flipped(use_async, request):
    # forks on the GPU: the records of the copied blocks move on the compute stream after the engine's copy_cache
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    if not os.environ.get("KV_CANARY_FRESH_PROCESS"):
        # In its own process: transformers 5.17's warm-up samples (do_sample, which forks need) from logits over
        # cache memory it never wrote; bytes an earlier test left in torch's caching allocator can make them NaN,
        # torch.multinomial then raises a device-side assert, and the CUDA context is lost for every later test.
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                               f"{__file__}::{request.node.name}"], capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, KV_CANARY_FRESH_PROCESS="1"))
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        return
    gpu = tiny_model("cuda", torch.bfloat16)
    opts = dict(use_cuda_graph=True, use_async_batching=use_async, forks=3, **FORK_POOL)
    for sharing in (False, True):
        ref, _ = run(gpu, canary=False, allow_block_sharing=sharing, **opts)
        results, handle = run(gpu, allow_block_sharing=sharing, **opts)
        st = handle.stats()
        assert len(results) == 12 and tokens(results) == tokens(ref)
        assert handle.violations == [] and st["errors"] == [] and st["forked_requests"] >= 1
    slot = []

    def inject(step, processor):
        table = processor.cache.group_cache_managers[0].block_table
        if not slot and "req_2__child#0" in table:  # on the compute stream, as in test_cuda_graphs_clean_and_flipped
            s = table["req_2__child#0"][0] * BLOCK + 2
            with torch.cuda.stream(processor.inputs_and_outputs.compute_stream):
                flip_k_byte(processor, s)
            slot.append(s)

    _, handle = run(gpu, inject=inject, allow_block_sharing=False, **opts)
    assert slot and {r for v in handle.violations if v.slot == slot[0] for r in v.request_ids} == {"req_2__child#0"}
