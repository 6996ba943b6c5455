"""Plan one step of a toy batch with the NumPy reference (runs anywhere), then read the plan.

    python examples/quickstart.py
"""
import numpy as np

from canary import CanaryPlanner, PlanStatus, VerifyPlan, WritePlan

# A KV pool of 4 request rows (row 0 is the padding row) x 8 token positions; slot ids are made up.
req_to_token = np.arange(100, 132, dtype=np.int32).reshape(4, 8)
# max_reqs allocates the cursors that let a step with more than 16 entries verify a rotating sample of them.
verify = VerifyPlan.allocate(verify_capacity=16, max_reqs=req_to_token.shape[0])
write = WritePlan.allocate(write_req_capacity=4)
planner = CanaryPlanner(verify_plan_out=verify, write_plan_out=write, req_to_token=req_to_token)

# Three batch rows: request row 1 decodes after 3 cached tokens, row 2 prefills 2 more after 2, and a
# CUDA-graph padding row (req_pool_indices 0) whose lengths are garbage and are never trusted.
planner.plan(
    req_pool_indices=np.array([1, 2, 0], dtype=np.int64),
    prefix_lens=np.array([3, 2, 999], dtype=np.int64),
    extend_seq_lens=np.array([1, 2, -7], dtype=np.int64),
)
n = int(verify.verify_num_valid[0])
print("status:", PlanStatus(int(verify.status[0])).name, "enable:", int(verify.enable[0]))
print("verify slots:    ", verify.verify_slot_indices[:n])
print("positions:       ", verify.verify_expected_positions[:n])
print("predecessors:    ", verify.verify_prev_slot_indices[:n])
print("write offsets:   ", write.write_offsets)
print("write seed slots:", write.write_seed_slot_indices[: int(write.write_num_valid_reqs[0])])
