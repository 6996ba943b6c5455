"""Host time per engine step that canary.integrations.transformers adds to transformers' continuous batching.

    python benchmarks/bench_transformers.py [--device cpu|cuda] [--requests 32] [--new-tokens 64] [--rounds 3]
                                            [--cuda-graphs] [--async-batching] [--dry]

A Llama built from its config (``--layers`` layers of ``--hidden`` width, random weights, nothing downloaded)
answers ``--requests`` prompts of 16 to 64 tokens through ``model.generate_batch``, greedy, ``--new-tokens``
each; every round runs once without the canary and once with it (``canary.integrations.transformers.enable``).
The canary-on run's tokens must equal the canary-off run's and it must report no violation (the check, before
anything is recorded). Figures, each the median of the rounds:

- ``canary host time / step``: what the canary's hooks cost the engine's thread per step (the CanaryManager's
  calls included: on the CPU the reference backend's NumPy kernels, on a GPU their launches), the mean over the
  round's steps (``handle.stats()["host_us_per_step"]``);
- ``glue host time / step``: of which outside the CanaryManager's calls (this integration's own bookkeeping);
- ``generate_batch wall / step``, canary off and on: the whole call over its steps (one session: the canary's
  manager is built and warmed up in it, and the engine's warm-up too).

Always, and alone when transformers is not installed: ``slot table / decode step``, the host cost of mirroring a
decode batch of ``--requests`` requests into the canary's ``req_to_token`` (``SlotTable.sync`` and ``.gather``
per request, a block allocated every 16 steps, one gather), on a synthetic batch.

``--dry``: two requests of four new tokens on a two-layer model (a smoke run; not a result). Writes
``transformers.json`` in ``--out`` (default: the results folder).
"""
from __future__ import annotations

import importlib.util
import platform
import time

import numpy as np

import harness

from canary.integrations.hf_slots import SlotTable

BLOCK = 16


def slot_table_step(requests: int, steps: int) -> harness.Timing:
    """us per decode step of ``requests`` requests mirrored into a SlotTable: what ``Session.begin_step`` does
    with it (a list compare per request, a sync when a block was added, one gather of the step's slots)."""
    table = SlotTable(requests + 1, 8192, BLOCK)
    rng = np.random.default_rng(0)
    blocks = {r: [int(b) for b in rng.choice(np.arange(1, 1 << 16), size=4, replace=False)] for r in range(requests)}
    lens = {r: int(rng.integers(16, 64)) for r in range(requests)}
    rows = {r: table.admit(r) for r in range(requests)}
    rpi = np.asarray([rows[r] for r in range(requests)], dtype=np.int64)
    loc = np.empty(requests, dtype=np.int64)
    samples = []
    for _ in range(steps):
        for r in range(requests):  # the engine's allocation, outside the clock
            lens[r] += 1
            if lens[r] > len(blocks[r]) * BLOCK:
                blocks[r].append(int(rng.integers(1, 1 << 16)))
        t0 = time.perf_counter_ns()
        pre = []
        for r in range(requests):
            b = blocks[r]
            if b != table.mirrored[r]:
                table.sync(r, rows[r], b)
            pre.append(lens[r] - 1)
        table.gather(rpi, np.asarray(pre, dtype=np.int64), loc)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    want = [blocks[r][(lens[r] - 1) // BLOCK] * BLOCK + (lens[r] - 1) % BLOCK for r in range(requests)]
    if loc.tolist() != want:
        raise harness.CheckFailed("slot table: the gathered slots differ from the engine's block lists")
    return harness.Timing.of(samples)


def model_runs(args, bench: harness.Bench) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import canary.integrations.transformers as kv_canary

    cuda = args.device == "cuda"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).to(args.device, torch.bfloat16 if cuda else torch.float32).eval()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 500, size=int(rng.integers(16, 65))).tolist() for _ in range(args.requests)]
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1)
    blocks = args.requests * (-(-(64 + args.new_tokens) // BLOCK)) + 2

    def batching():
        return ContinuousBatchingConfig(block_size=BLOCK, num_blocks=blocks, max_batch_tokens=512,
                                        allow_block_sharing=False, use_cuda_graph=args.cuda_graphs,
                                        use_async_batching=args.async_batching if cuda else False)

    def once(canary: bool):
        handle = kv_canary.enable(model) if canary else None
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=batching())
        wall = time.perf_counter() - t0
        stats = None
        if handle is not None:
            stats = handle.stats()
            handle.close()
        return {k: list(v.generated_tokens) for k, v in out.items()}, wall, stats

    rounds = bench.rounds(3)
    host, glue, wall_off, wall_on, steps = [], [], [], [], 0
    for _ in range(rounds + 1):  # the first round warms up (kernel compiles, allocator pools): not recorded
        ref, t_off, _ = once(False)
        got, t_on, stats = once(True)
        if got != ref:
            raise harness.CheckFailed("tokens: the canary-on run generated other tokens than the canary-off run")
        if stats["violations"] or stats["errors"]:
            raise harness.CheckFailed(f"canary: expected a clean run, got {stats['violations']} violations, "
                                      f"errors {stats['errors']}")
        steps = stats["steps"]
        host.append(stats["host_us_per_step"]["mean"])
        glue.append(stats["glue_us_per_step"]["mean"])
        wall_off.append(t_off / steps * 1e6)
        wall_on.append(t_on / steps * 1e6)
    shape = dict(device=args.device, requests=args.requests, new_tokens=args.new_tokens, layers=args.layers,
                 hidden=args.hidden, cuda_graphs=args.cuda_graphs, async_batching=args.async_batching, steps=steps)
    bench.figure("canary host time / step", harness.Timing.of(host[1:]), key="transformers.host_per_step", **shape)
    bench.figure("glue host time / step", harness.Timing.of(glue[1:]), key="transformers.glue_per_step", **shape)
    bench.figure("generate_batch wall / step, canary off", harness.Timing.of(wall_off[1:]), **shape)
    bench.figure("generate_batch wall / step, canary on", harness.Timing.of(wall_on[1:]), **shape)
    bench.extra.update(torch=torch.__version__, transformers=__import__("transformers").__version__)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--cuda-graphs", action="store_true", help="the engine's CUDA graphs (GPU)")
    ap.add_argument("--async-batching", action="store_true", help="the engine's async batching (GPU)")
    args = ap.parse_args(argv)
    bench = harness.Bench("transformers", args, "host clock: the canary's hooks per engine step (perf_counter "
                          "around each hook, summed per step, mean over the steps of a generate_batch), median of "
                          "rounds; each round runs canary off then on over the same prompts")
    if bench.dry:
        args.device, args.requests, args.new_tokens, args.layers, args.hidden = "cpu", 2, 4, 2, 64
    bench.attempt(f"slot table / decode step, {args.requests} requests",
                  lambda: slot_table_step(args.requests, 64 if bench.dry else 2048), key="transformers.slot_table",
                  requests=args.requests)
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        if not bench.dry:
            bench.figure("canary host time / step", None, error=f"{', '.join(missing)} not installed (pip install "
                         f"'kv-canary[transformers]')")
        print(f"transformers runs skipped: {', '.join(missing)} not installed")
    else:
        try:
            model_runs(args, bench)
        except Exception as exc:  # noqa: BLE001 - recorded as a failed figure
            bench.figure("canary host time / step", None, error=f"{type(exc).__name__}: {exc}"[:500])
    bench.extra.update(python=platform.python_version(), numpy=np.__version__, machine=platform.machine())
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
