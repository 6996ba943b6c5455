"""Detect a corrupted KV byte end to end: plan, write the canary after each step's KV stores, verify the next
step's prefix, and read the violation. Host NumPy by default (runs anywhere); ``--device cuda`` runs the same
steps on the GPU with CuPy arrays (``pip install cupy-cuda13x 'cuda-core[cu13]'``).

    python examples/detect_corruption.py [--device cuda]
"""
import argparse

import numpy as np

from canary import CanaryPlanner, CanaryState, CanaryRecords, VerifyPlan, WritePlan, real_kv

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
args = parser.parse_args()
if args.device == "cuda":
    import cupy as xp

    device = 0
else:
    xp, device = np, "cpu"

# A toy engine: request row 1 owns slots 116.. of a 256-slot KV pool of 64 bytes (K and V, fp16) per token.
num_slots, bytes_per_token = 256, 64
kv = xp.zeros((num_slots, bytes_per_token // 2), dtype=xp.float16)
req_to_token = xp.asarray(np.arange(100, 100 + 4 * 16, dtype=np.int32).reshape(4, 16))
verify_plan = VerifyPlan.allocate(verify_capacity=64, device=device, max_reqs=req_to_token.shape[0])
write_plan = WritePlan.allocate(write_req_capacity=4, device=device)
planner = CanaryPlanner(verify_plan_out=verify_plan, write_plan_out=write_plan, req_to_token=req_to_token)
state = CanaryState.allocate(num_slots=num_slots, ring_capacity=64, device=device)
canary = CanaryRecords(state, real_kv([(kv, 1, bytes_per_token)]))  # hash every byte of each token's KV
tokens = [11, 12, 13, 14, 15, 16]


def step(prefix: int, extend: int) -> None:
    """One engine step for request row 1: verify its cached prefix, store the new tokens' KV, write the canary."""
    i64 = lambda v: xp.asarray(np.array(v, dtype=np.int64))  # noqa: E731
    planner.plan(req_pool_indices=i64([1]), prefix_lens=i64([prefix]), extend_seq_lens=i64([extend]))
    canary.verify(verify_plan)  # before attention reads the prefix
    slots = req_to_token[1, prefix : prefix + extend].astype(xp.int64)
    kv[slots] = xp.asarray(np.random.default_rng(prefix).standard_normal((extend, kv.shape[1])), dtype=xp.float16)
    canary.write(write_plan, out_cache_loc=slots, input_ids=i64(tokens[prefix : prefix + extend]),
                 positions=xp.arange(prefix, prefix + extend, dtype=xp.int64))  # after the KV stores


step(0, 4)  # prefill 4 tokens
step(4, 1)  # decode: verifies the 4 cached tokens
print("clean steps:", len(canary.drain()), "violations")
slot = int(req_to_token[1, 2])
kv.view(xp.uint8)[slot, 5] ^= 0x10  # one flipped bit in the KV of position 2
step(5, 1)  # the next decode verifies the prefix again
report = canary.drain()
print("after the flip:", len(report), "violation(s)")
for v in report:
    print(" ", v)
