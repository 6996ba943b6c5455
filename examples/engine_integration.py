"""What an engine adds to switch the KV canary on: bind a CanaryManager once, call it twice per forward, and tell
it the tokens each request really has. A toy single-request engine runs three steps, then a stray write flips a
bit of a cached token's KV and the next step reports it. CuPy arrays on a GPU by default; ``--device cpu`` runs
the same code on NumPy arrays with the reference backend.

    python examples/engine_integration.py [--device cpu]
"""
import argparse
import logging

import numpy as np

from canary import CanaryManager, KVGroup

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
args = parser.parse_args()
device = args.device
if device is None:
    try:
        import cupy
        device = "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # noqa: BLE001 - no CuPy, no driver: the host path
        device = "cpu"
if device == "cuda":
    import cupy as xp
    dev = 0
else:
    xp, dev = np, "cpu"
logging.basicConfig(format="%(message)s", level=logging.INFO)

# The engine's own buffers: req_to_token [max_reqs, max_seq_len] int32 and a K / V pool of 64 bytes per token.
req_to_token = xp.asarray(np.arange(4 * 16, dtype=np.int32).reshape(4, 16) + 100)
k_pool = xp.zeros((256, 32), dtype=xp.float16)
v_pool = xp.zeros((256, 32), dtype=xp.float16)
i64 = lambda v: xp.asarray(np.asarray(v, dtype=np.int64))  # noqa: E731

# --- 1. once per engine / rank --------------------------------------------------------------------------------
canary = CanaryManager(
    [KVGroup(name="full", req_to_token=req_to_token, num_slots=256, verify_capacity=4096,
             real_kv_sources=[(k_pool, 1, 64), (v_pool, 1, 64)])],
    max_batch_size=8, device=dev, on_violation="log")
canary.warmup()
canary.add_request("req-1", [11, 12, 13, 14])                       # 2. when a request arrives


def forward(prefix: int, tokens: list[int]) -> None:
    n = len(tokens)
    canary.before_forward(req_pool_indices=i64([1]), prefix_lens=i64([prefix]), extend_seq_lens=i64([n]),
                          request_ids=["req-1"])                   # 3. before attention reads the KV
    loc = req_to_token[1, prefix:prefix + n].astype(xp.int64)
    k_pool[loc] = xp.asarray(np.random.default_rng(prefix).standard_normal((n, 32)), dtype=xp.float16)  # KV store
    v_pool[loc] = k_pool[loc] * 2
    canary.after_kv_store(out_cache_loc=loc, input_ids=i64(tokens), positions=i64(range(prefix, prefix + n)))  # 4.


forward(0, [11, 12, 13, 14])                                          # prefill
canary.accept_tokens("req-1", [15])                                   # 5. the tokens the sampler accepted
forward(4, [15])
canary.accept_tokens("req-1", [16])
forward(5, [16])
canary.accept_tokens("req-1", [17])
canary.flush()  # only for the demo: wait for the reports so far (an engine never needs to)
print("clean steps: violations", canary.stats()["violations_by_reason"])
k_pool.view(xp.uint8)[int(req_to_token[1, 2]), 5] ^= 0x10            # a stray write into position 2's K bytes
forward(6, [17])                                                      # its verify sees it...
forward(7, [])                                                        # ...reported at the next step boundary
canary.finish_request("req-1")                                        # 6. when the request ends
print("after the flip: violations", canary.stats()["violations_by_reason"])
