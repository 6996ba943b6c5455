"""A torch engine with the KV canary inside a CUDA graph: a CanaryManager over torch tensors (zero-copy), its
before_forward / after_kv_store captured once with the step's static buffers, then replayed after the inputs
are refilled in place; begin_step / end_step (the host halves) run around each replay. Needs a GPU, torch and
the [cuda13] extra.

    python examples/torch_cuda_graph.py
"""
import torch

from canary import CanaryManager, KVGroup

dev = torch.device("cuda")
max_reqs, max_seq_len, bs, num_slots = 65, 4096, 64, 65 * 4096
i64 = dict(dtype=torch.int64, device=dev)
# Row r holds slots r * max_seq_len + position: every request has its own slots.
req_to_token = (torch.arange(max_reqs * max_seq_len, dtype=torch.int32, device=dev)).reshape(max_reqs, max_seq_len)
k_pool = torch.zeros((num_slots, 64), dtype=torch.bfloat16, device=dev)
canary = CanaryManager([KVGroup(name="full", req_to_token=req_to_token, num_slots=num_slots, verify_capacity=1 << 18,
                                real_kv_sources=[(k_pool, 1, 128)])],
                       max_batch_size=bs, device=0, library="torch", on_violation="raise")
canary.warmup()

# The engine's static step buffers, refilled in place every step (one decode token per request).
rpi = torch.arange(1, bs + 1, **i64)
prefix = torch.zeros(bs, **i64)
extend = torch.ones(bs, **i64)
loc, ids, pos = torch.zeros(bs, **i64), torch.zeros(bs, **i64), torch.zeros(bs, **i64)
ids_of = lambda p: (rpi * 7 + p) % 32000  # noqa: E731 - the toy "model": token at (request, position)
rids = [f"req-{r}" for r in range(1, bs + 1)]


def fill(step: int) -> None:
    prefix.fill_(step)
    loc.copy_(rpi * max_seq_len + step)
    pos.fill_(step)
    ids.copy_(ids_of(step))


def step_body() -> None:
    canary.before_forward(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend, request_ids=rids)
    k_pool[loc] = ids.to(torch.bfloat16)[:, None]  # the forward's KV store
    canary.after_kv_store(out_cache_loc=loc, input_ids=ids, positions=pos)


for r in range(bs):
    canary.add_request(rids[r], [int(ids_of(0)[r])])
fill(0)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    step_body()  # step 0 eagerly: warms the launch path
    for r in range(bs):
        canary.accept_tokens(rids[r], [int(ids_of(1)[r])])
    graph = torch.cuda.CUDAGraph()
    fill(1)
    with torch.cuda.graph(graph, stream=side):
        step_body()  # captured: only the launches are recorded

for step in range(1, 4):
    fill(step)
    canary.begin_step(rids)
    graph.replay()
    canary.end_step()
    for r in range(bs):
        canary.accept_tokens(rids[r], [int(ids_of(step + 1)[r])])
    canary.flush()
    st = canary.stats()
    print(f"step {step}: violations {st['violations_by_reason']}, protected tokens {st['protected_tokens']}, "
          f"verified {st['verified_entries']['full']}")
canary.close()
