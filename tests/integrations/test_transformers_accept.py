"""The transformers integration's accept behind the next forward (sync batching; canary/integrations/hf_accept.py)
against the accept in update_batch (the test-only option ``accept_behind_forward=False``): the same tokens, the
same reports line for line (step, slot, position, reasons, requests, writers) and no errors, over clean runs,
every fault of tests/integrations/test_transformers.py, forks, CPU offload, prefix sharing, failures and requests
dropped past the expected-token pool; and the two reports whose names depend on the step's planned counts (a
decode step's write row, a stolen block's CHAIN rows) name their writers either way. On the CPU (the reference
backend), with test_transformers.py's tiny model."""
from __future__ import annotations

import pytest

import test_transformers as T
from test_transformers import cpu_pool, model, run, torch  # noqa: F401  (module fixtures)

from canary.integrations import hf_session

BLOCK = T.BLOCK

@pytest.mark.parametrize("behind", [False, True], ids=["accept-in-update", "accept-behind-forward"])
def test_a_decode_write_row_names_its_writer(model, behind):
    at, seen = 10, []

    def inject(step, processor):
        io = processor.inputs_and_outputs
        row = T.decoding(io, "req_0") if step == at else None
        batch = [fs.state.request_id for fs in io.requests_in_batch]
        if row is None or "req_1" not in batch:
            return
        (r0, i), r1 = row, batch.index("req_1")
        past = io.requests_in_batch[r0].state.position_offset - 1
        starts = io.cumulative_seqlens_k["full_attention"]
        a = int(starts[r0]) + past - 1  # req_0's last cached position: the write's seed
        b = int(starts[r1]) + 2  # req_1's position 2
        io.read_index_storage[0, a] = io.read_index_storage[0, b]
        seen.append((past, int(io.write_index_storage[0, i])))

    _, handle = run(model, inject=inject, internal={"accept_behind_forward": behind})
    assert seen
    past, slot = seen[0]
    writes = [v for v in handle.violations if v.kernel == "write" and v.slot == slot]
    assert writes, [v.line() for v in handle.violations]
    assert writes[0].position == past and "WRITE_POSITION" in writes[0].reason_names
    assert writes[0].requests == (("req_0", past),), writes[0].line()


@pytest.mark.parametrize("behind", [False, True], ids=["accept-in-update", "accept-behind-forward"])
@pytest.mark.parametrize("how", ["double", "freed"])
def test_every_row_of_the_victim_names_the_thief(model, behind, how):
    # transformers.md's second fault: a block handed to a second request while the first still uses it is
    # reported on the first's positions, writers the second. The CHAIN rows (the first sighting of each slot the
    # thief writes, one step before its POSITION|VERIFY_TOKEN row) name the thief only when the step's planned
    # count covers the position the thief wrote in the step verified next.
    inject, got = T._hijack("req_2", how)
    _, handle = run(model, inject=inject, internal={"accept_behind_forward": behind})
    (thief, _), = got
    rows = [v for v in handle.violations if "req_2" in {r for r, _ in v.requests}]
    missing = [v.line() for v in rows if thief not in {r for r, _ in v.writers}]
    assert rows and not missing, "\n".join(missing)


def flip(step, processor):
    if step == 8:
        T.flip_k_byte(processor, T._first_block(processor, "req_0") * BLOCK + 2)


def wrong_slot(step, processor):
    if step == 8:
        T.misread(processor)


def stale_input(step, processor):
    if step not in (6, 10, 14):
        return
    io = processor.inputs_and_outputs
    q = [fs.query_length for fs in io.requests_in_batch]
    for i in range(len(q)):
        if q[i] == 1:
            j = sum(q[:i])
            io.input_ids[j] = (int(io.input_ids[j]) % 127) + 1


def block_list(step, processor):
    # a decoding request's last block replaced in its block table by another request's first block
    if step != 9:
        return
    cm = processor.cache.group_cache_managers[0]
    t = cm.block_table
    if len(t.get("req_2", [])) >= 2 and t.get("req_1"):
        t["req_2"][-1] = t["req_1"][0]


SCENARIOS = {
    "clean": dict(),
    "flip": dict(inject=flip),
    "wrong_slot": dict(inject=wrong_slot),
    "stale_input": dict(inject=stale_input),
    "block_list": dict(inject=block_list),
    "hijack_double": dict(hijack="double"),
    "hijack_freed": dict(hijack="freed"),
    "soft_reset_cancel": dict(cancel="req_1", num_blocks=8),
    "sharing16": dict(prompts="SHARED", allow_block_sharing=True, max_batch_tokens=16),
    "sharing_rows2": dict(prompts="SHARED", allow_block_sharing=True, max_batch_tokens=16,
                          options={"max_requests": 2}),
    "small_batch_tokens": dict(max_batch_tokens=8),
    "device_path": dict(internal={"device_path": True}),
}


def both_ways(model, make, summary=None) -> list:
    """``run(model, **make())`` with the accept in update_batch, then behind the next forward (``make`` is called
    for each run: fresh injectors); ``summary(results, handle)`` of each, by default :func:`outcome`."""
    out = []
    for behind in (False, True):
        kw = make()
        internal = dict(kw.pop("internal", {}), accept_behind_forward=behind)
        out.append((summary or outcome)(*run(model, internal=internal, **kw)))
    return out


def outcome(results, handle) -> tuple:
    """Tokens, report lines, errors and the protection counts of a run."""
    st = handle.stats()
    return (T.tokens(results), [v.line() for v in handle.violations], st["errors"], st["protected_tokens"],
            st["protected_requests"], st["unprotected_requests"])


def scenario(name: str) -> dict:
    kw = dict(SCENARIOS[name])
    how = kw.pop("hijack", None)
    if how:
        kw["inject"] = T._hijack("req_2", how)[0]
    if kw.get("prompts") == "SHARED":
        kw["prompts"] = T.SHARED
    return kw


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_reports_either_way(model, name):
    a, b = both_ways(model, lambda: scenario(name))
    assert a[2] == [] and b[2] == []
    assert a == b, "\n".join(["update:"] + a[1] + ["behind:"] + b[1])


def cpu_flip():
    hit = []

    def inject(step, processor):
        waiting = T._offloaded(processor)
        if hit or not waiting:
            return
        rid, cpu = next(iter(waiting.items()))
        processor.offloading_manager._cpu_key_cache[0][cpu[0], 2].view(torch.uint8).view(-1)[3] ^= 0x20
        hit.append(rid)
    return inject


def shared_flip(where):
    hit = []
    rid = "req_2" if where == "shared" else "req_2__child#0"

    def inject(step, processor):
        table = processor.cache.group_cache_managers[0].block_table
        if not hit and "req_2__child#1" in table:
            s = table[rid][0] * BLOCK + 2
            T.flip_k_byte(processor, s)
            hit.append(s)
    return inject


MOVES = {
    "forks2_copied": lambda: dict(forks=2, num_blocks=64),
    "forks3_shared": lambda: dict(forks=3, allow_block_sharing=True, num_blocks=64),
    "forks3_starved_shared": lambda: dict(forks=3, num_blocks=8, allow_block_sharing=True),
    "forks3_starved_offload": lambda: dict(forks=3, num_blocks=8, cpu_offload_space=0.001),
    "offload": lambda: dict(num_blocks=8, cpu_offload_space=0.001),
    "offload_cancel": lambda: dict(num_blocks=8, cpu_offload_space=0.001, cancel="req_2", expect=3),
    "offload_cpu_flip": lambda: dict(num_blocks=8, cpu_offload_space=0.001, inject=cpu_flip()),
    "fork_flip_shared": lambda: dict(forks=3, allow_block_sharing=True, num_blocks=64, inject=shared_flip("shared")),
    "fork_flip_copied": lambda: dict(forks=3, num_blocks=64, inject=shared_flip("copied")),
}


@pytest.mark.parametrize("name", list(MOVES))
def test_same_reports_either_way_when_kv_moves(model, cpu_pool, name):
    a, b = both_ways(model, MOVES[name])
    assert a[2] == [] and b[2] == []
    assert a == b, "\n".join(["update:"] + a[1] + ["behind:"] + b[1])


def bad_index(step, processor):
    io = processor.inputs_and_outputs
    batch = [fs.state.request_id for fs in io.requests_in_batch]
    if step != 8 or io.max_kv_read == 0 or "req_0" not in batch:
        return
    at = int(io.cumulative_seqlens_k["full_attention"][batch.index("req_0")]) + 2
    io.read_index_storage[0, at] = processor.cache.key_cache[0].shape[0] + 1000


def summary(results, handle):
    st = handle.stats()
    return ({r: (len(x.generated_tokens), x.error is not None) for r, x in results.items()},
            [v.line() for v in handle.violations], [e.split("(")[0] for e in st["errors"]], st["protected_tokens"],
            st["steps"])


@pytest.mark.parametrize("case", ["forward_raises", "store_raises", "raise_mode"])
def test_same_outcome_either_way_when_a_step_fails(model, monkeypatch, case):
    orig = hf_session.Session.end_step

    def make() -> dict:
        if case == "forward_raises":
            return dict(expect=4, inject=bad_index)
        if case == "raise_mode":
            return dict(expect=4, inject=flip, options={"on_violation": "raise"})
        n = [0]  # store_raises: the ninth end_step of each run

        def end_step(self, step):
            n[0] += 1
            if n[0] == 9:
                raise RuntimeError("after_kv_store failed")
            return orig(self, step)
        monkeypatch.setattr(hf_session.Session, "end_step", end_step)
        return dict(expect=4)

    a, b = both_ways(model, make, summary)
    assert a == b


@pytest.mark.parametrize("cols", [30, 33, 40])
def test_requests_dropped_past_the_pool_either_way(model, monkeypatch, cols):
    orig = hf_session.Session._admit

    def admit(self, rid, state, past, forked=False):
        keep, state.max_new_tokens = state.max_new_tokens, None  # as an unbounded request
        try:
            return orig(self, rid, state, past, forked)
        finally:
            state.max_new_tokens = keep

    monkeypatch.setattr(hf_session.Session, "_admit", admit)
    a, b = both_ways(model, lambda: dict(options={"max_seq_len": cols}))
    assert a[2] == [] and b[2] == [] and a[1] == [] and b[1] == []
    assert a == b
