"""A torch engine calling kv-canary zero-copy: torch tensors in and out, the plan captured in a CUDA graph
and replayed after the step inputs are refilled in place. Needs a GPU, torch and the [cuda13] extra.

    python examples/torch_cuda_graph.py
"""
import torch

from canary import CanaryPlanner, VerifyPlan, WritePlan

dev = torch.device("cuda")
max_reqs, max_seq_len, bs, capacity = 65, 4096, 64, 1 << 18
req_to_token = torch.randint(1, 1 << 20, (max_reqs, max_seq_len), dtype=torch.int32, device=dev)
i64 = dict(dtype=torch.int64, device=dev)
verify = VerifyPlan(
    verify_slot_indices=torch.empty(capacity, **i64), verify_expected_tokens=torch.empty(capacity, **i64),
    verify_expected_positions=torch.empty(capacity, **i64), verify_prev_slot_indices=torch.empty(capacity, **i64),
    verify_num_valid=torch.empty(1, dtype=torch.int32, device=dev),
    enable=torch.empty(1, dtype=torch.int32, device=dev), status=torch.empty(1, dtype=torch.int32, device=dev),
    # The sampling state (SPEC 3.7): zeroed once, then owned by the planner for the engine's lifetime.
    verify_cursors=torch.zeros(max_reqs, **i64),
)
write = WritePlan(write_offsets=torch.empty(bs + 1, **i64), write_seed_slot_indices=torch.empty(bs, **i64),
                  write_num_valid_reqs=torch.empty(1, dtype=torch.int32, device=dev))
planner = CanaryPlanner(verify_plan_out=verify, write_plan_out=write, req_to_token=req_to_token)
planner.warmup()

# The engine's static step buffers, refilled in place every step.
rpi = torch.arange(1, bs + 1, **i64)
prefix = torch.randint(0, 2048, (bs,), **i64)
extend = torch.ones(bs, **i64)

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    planner.plan(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend)  # warm the launch path
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    planner.plan(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend)

for step in range(3):
    prefix.copy_(torch.randint(0, 2048, (bs,), **i64))  # the next step's lengths, same buffer
    graph.replay()
    torch.cuda.synchronize()
    n = int(verify.verify_num_valid[0])
    assert n == int(prefix.sum()) and int(verify.status[0]) == 0
    print(f"step {step}: {n} verify entries, enable={int(verify.enable[0])}, first slots {verify.verify_slot_indices[:4].tolist()}")
