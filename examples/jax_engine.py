"""A small JAX decode loop over a paged KV cache with the KV canary on JAX arrays (DLPack, zero-copy).

Two requests prefill, then decode greedily; the engine calls the CanaryManager around every forward with its own
JAX arrays. JAX arrays are read-only, so everything the manager writes (plans, canary records, the
expected-token pool) lives in arrays the manager allocated itself; it only reads the engine's. At step 6 the
engine feeds request "b" a token the sampler did not accept (a rejected draft left in the KV): the next verify
reports VERIFY_TOKEN for that request. CPU JAX arrays and the reference backend; on a GPU pass device=0.

Real-KV hashing is off here: a JAX step returns a *new* KV array (functional update), while the manager binds
real-KV sources by pointer once (docs/integration.md, "JAX").

    python -m pip install jax && python examples/jax_engine.py
"""
import logging
import sys

try:
    import jax
except ModuleNotFoundError:
    sys.exit("jax_engine.py needs JAX: python -m pip install jax")

jax.config.update("jax_enable_x64", True)  # the manager's step inputs are int64
# Host JAX arrays with the reference backend, also where JAX finds a GPU (a JAX-on-GPU engine passes device=0 to
# CanaryManager instead; that path is the same calls on device arrays).
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from canary import CanaryManager, KVGroup  # noqa: E402

logging.basicConfig(format="%(message)s", level=logging.INFO)
PAGE, PAGES, MAX_SEQ, HEADS, DIM, VOCAB = 4, 32, 32, 2, 8, 97

# Static page table: each request owns 8 pages from the start, so req_to_token never moves (bound by pointer).
table = np.zeros((3, MAX_SEQ), dtype=np.int32)  # row 0: padding
for row, first_page in ((1, 1), (2, 9)):
    pages = first_page + np.arange(MAX_SEQ // PAGE)
    table[row] = (pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
req_to_token = jnp.asarray(table)
rows = {"a": 1, "b": 2}
prompts = {"a": [5, 17, 42, 8, 3], "b": [11, 2, 64]}

key = jax.random.PRNGKey(0)
embed = jax.random.normal(key, (VOCAB, HEADS * DIM), dtype=jnp.float32)
k_cache = jnp.zeros((PAGES * PAGE, HEADS, DIM), dtype=jnp.float32)
v_cache = jnp.zeros((PAGES * PAGE, HEADS, DIM), dtype=jnp.float32)


@jax.jit
def forward(k_cache, v_cache, loc, ids, table_rows, lens):
    """Store the new tokens' K / V, attend over each row's cache, return the next token of each row."""
    x = embed[ids].reshape(-1, HEADS, DIM)
    k_cache = k_cache.at[loc].set(x)
    v_cache = v_cache.at[loc].set(x * 0.5)
    k, v = k_cache[table_rows], v_cache[table_rows]  # [rows, MAX_SEQ, HEADS, DIM]
    mask = jnp.arange(MAX_SEQ)[None, :] < lens[:, None]
    q = k[jnp.arange(lens.shape[0]), lens - 1]
    scores = jnp.where(mask[:, :, None], jnp.einsum("bhd,bshd->bsh", q, k), -1e9)
    out = jnp.einsum("bsh,bshd->bhd", jax.nn.softmax(scores, axis=1), v).reshape(lens.shape[0], -1)
    return k_cache, v_cache, jnp.argmax(out @ embed.T, axis=-1)


canary = CanaryManager([KVGroup(name="full", req_to_token=req_to_token, num_slots=PAGES * PAGE, verify_capacity=1024)],
                       max_batch_size=2, device="cpu", on_violation="log")
canary.warmup()
for rid, prompt in prompts.items():
    canary.add_request(rid, prompt)

lens = {rid: 0 for rid in prompts}  # tokens in the cache
feed = {rid: list(p) for rid, p in prompts.items()}  # the tokens the next forward reads
for step in range(9):
    order = list(prompts)
    if step == 6:
        feed["b"] = [(feed["b"][0] + 1) % VOCAB]  # the fault: not the token the sampler accepted
    rpi = jnp.asarray([rows[r] for r in order], dtype=jnp.int64)
    prefix = jnp.asarray([lens[r] for r in order], dtype=jnp.int64)
    extend = jnp.asarray([len(feed[r]) for r in order], dtype=jnp.int64)
    canary.before_forward(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend, request_ids=order)
    loc = jnp.concatenate([req_to_token[rows[r], lens[r]:lens[r] + len(feed[r])] for r in order]).astype(jnp.int64)
    ids = jnp.asarray([t for r in order for t in feed[r]], dtype=jnp.int64)
    pos = jnp.asarray([lens[r] + i for r in order for i in range(len(feed[r]))], dtype=jnp.int64)
    new_lens = jnp.asarray([lens[r] + len(feed[r]) for r in order], dtype=jnp.int64)
    k_cache, v_cache, nxt = forward(k_cache, v_cache, loc, ids, req_to_token[rpi], new_lens)
    canary.after_kv_store(out_cache_loc=loc, input_ids=ids, positions=pos)
    for r, t in zip(order, np.asarray(nxt).tolist()):
        lens[r] += len(feed[r])
        canary.accept_tokens(r, [t])  # what the sampler kept
        feed[r] = [t]
    if step == 5:
        canary.flush()  # only for the demo: the reports so far
        print("clean steps: violations", canary.stats()["violations_by_reason"])
canary.flush()
stats = canary.stats()
print("after the fault: violations", stats["violations_by_reason"])
print("requests named:", sorted({rid for v in canary.open_violations for rid in v.request_ids}))
for rid in prompts:
    canary.finish_request(rid)
