"""What canary.integrations.transformers costs transformers' continuous batching, per decode step.

    python benchmarks/bench_transformers.py [--device cpu|cuda] [--requests 96] [--max-batch 32]
                                            [--new-tokens 64] [--layers 4] [--hidden 256] [--rounds 3]
                                            [--cuda-graphs] [--async-batching] [--profile FILE] [--split FILE]
                                            [--dry]

A Llama built from its config (``--layers`` layers of ``--hidden`` width, random weights, nothing downloaded)
serves ``--requests`` prompts of 16 to 64 tokens through a ``ContinuousBatchingManager``, greedy, each with its
own ``max_new_tokens`` drawn from ``[new_tokens / 2, 3 * new_tokens / 2]``, at most ``--max-batch`` requests a
step: requests join and leave all through the run, so the batch changes size every few steps. Each round runs
the same requests once with the canary off and once with it on (``canary.integrations.transformers.enable``);
the canary-on tokens must equal the canary-off tokens and it must report no violation (the check, before
anything is recorded). The first round warms up (compiles, graph captures, allocator pools) and is not
recorded. Figures, each the median over the recorded rounds of a per-round median over decode steps (every
batch row one token):

- ``canary host time / decode step``: what the canary's hooks cost the engine's thread per decode step (the
  CanaryManager's calls included), from ``handle.stats()["host_us_per_decode_step"]``;
- ``glue host time / decode step``: of which outside the CanaryManager's calls (the integration's own);
- ``exposed host time / decode step``: of which with no forward queued on the GPU (before the forward's launch,
  after the engine's sync on it: ``exposed_us_per_decode_step``), the part a step's wall clock pays when the
  forward outlasts the rest;
- ``decode step, canary off`` / ``on``: the engine loop's period on decode steps (``ContinuousBatchProcessor.
  _generation_step`` entry to entry, timed by this benchmark: the step, its output transfer, the host's
  scheduling and the canary's hooks), and ``decode step overhead``: on / off - 1, in percent;
- the CanaryManager's ``graph_replays`` / ``graph_captures`` / ``direct_calls`` of the last round, in ``extra``;
- always, and alone without torch: ``padded batch shapes``, the batch shapes the integration's padding to powers of
  two leaves for 1 to ``--max-batch`` rows.

``--dry``: two requests of four new tokens on a two-layer model on the CPU (a smoke run; not a result). Writes
``transformers.json`` in ``--out`` (default: the results folder).
"""
from __future__ import annotations

import importlib.util
import platform
import time

import numpy as np

import harness

BLOCK = 16


def _batch(processor):
    io = processor.inputs_and_outputs
    if hasattr(io, "io_pairs"):
        io = io.io_pairs[io.current_pair].host_io
    return io.requests_in_batch


class StepClock:
    """The engine loop's period per step: ``_generation_step`` entry to entry (the batch is prepared just before
    it), and whether the step it closes was a decode step. Patched on the class, for both runs alike."""

    def __init__(self, cls):
        self.cls, self.orig = cls, cls._generation_step
        self.samples: list[tuple[bool, float]] = []
        self._last: tuple[bool, float] | None = None
        clock = self

        def _generation_step(processor, model):
            now = time.perf_counter()
            if clock._last is not None:
                clock.samples.append((clock._last[0], now - clock._last[1]))
            batch = _batch(processor)
            clock._last = (all(fs.query_length == 1 for fs in batch), now)
            return clock.orig(processor, model)
        cls._generation_step = _generation_step

    def reset(self) -> None:
        self.samples, self._last = [], None

    def decode_median_us(self) -> float:
        got = [dt for decode, dt in self.samples if decode]
        return float(np.median(got)) * 1e6 if got else float("nan")

    def close(self) -> None:
        self.cls._generation_step = self.orig


class HookProfile:
    """``--profile FILE``: a cProfile of the integration's four hooks only (the Session methods the engine's
    patches call), over the last round's canary-on run, written as text (by own time, then cumulative)."""

    HOOKS = ("begin_step", "end_step", "on_update", "on_free")

    def __init__(self, path: str):
        import cProfile

        from canary.integrations.hf_session import Session

        self.path, self.cls, self.prof, self.orig = path, Session, cProfile.Profile(), {}

    def start(self) -> None:
        prof = self.prof
        for name in self.HOOKS:
            fn = self.orig[name] = getattr(self.cls, name)

            def hook(*a, _fn=fn, **k):
                prof.enable()
                try:
                    return _fn(*a, **k)
                finally:
                    prof.disable()
            setattr(self.cls, name, hook)

    def stop(self) -> None:
        import io
        import pstats

        for name, fn in self.orig.items():
            setattr(self.cls, name, fn)
        buf = io.StringIO()
        st = pstats.Stats(self.prof, stream=buf)
        st.sort_stats("tottime").print_stats(70)
        st.sort_stats("cumulative").print_stats(70)
        with open(self.path, "w") as f:
            f.write(buf.getvalue())


class HookSplit:
    """``--split FILE``: wall time of the integration's hooks and of the manager calls and internals under them,
    over the last round's canary-on run (a perf_counter pair around each wrapped function: far less intrusive than
    a profiler), written as text: calls a decode-or-prefill step, median us a call, mean us a step. A wrapped
    function's time includes the wrapped functions it calls."""

    HOOKED = (
        ("canary.integrations.hf_session", "Session", ("begin_step", "end_step", "on_update", "accept_kept", "on_free",
                                                        "_stage", "_admit")),
        ("canary.manager.manager", "CanaryManager", ("before_forward", "after_kv_store", "accept_tokens_batch",
                                                      "accept_tokens", "add_request", "finish_request", "_launch",
                                                      "_note_entries", "_handle_reports")),
        ("canary.manager.steps", "Steps", ("begin", "eager_plan_and_verify", "eager_write", "end", "plan_and_verify",
                                           "write", "check_request_ids", "check_lengths", "batch_size")),
        ("canary.manager.streams", "StreamResolver", ("resolve", "_explicit")),
        ("canary.manager.eager", "EagerGraphs", ("launch", "observe")),
        ("canary.manager.intake", "TokenIntake", ("accept_batch", "rows")),
        ("canary.manager.pool", "RequestPool", ("accept_batch", "add", "finish")),
        ("canary.manager.decode", "ReportDecoder", ("handle_reports", "decode")),
        ("canary.manager.staging", "CudaStaging", ("stage", "stage_device_append", "stage_append",
                                                   "launch_deferred")),
        ("canary.manager.steps", None, ("open_pages",)),
        ("canary.manager.manager", None, ("check_bound", "step_arrays")),
    )

    def __init__(self, path: str):
        self.path, self.orig, self.times = path, [], {}

    def start(self) -> None:
        import importlib

        perf = time.perf_counter
        for mod_name, cls_name, names in self.HOOKED:
            owner = importlib.import_module(mod_name)
            if cls_name is not None:
                owner = getattr(owner, cls_name)
            for name in names:
                where = owner
                if cls_name is not None:  # the class of the MRO that defines it (a mixin's method too)
                    where = next((c for c in owner.__mro__ if name in c.__dict__), None)
                fn = None if where is None else where.__dict__.get(name) if cls_name else getattr(owner, name, None)
                kind = type(fn) if isinstance(fn, (staticmethod, classmethod)) else None
                inner = fn.__func__ if kind is not None else fn
                if inner is None or not callable(inner):
                    continue
                label = f"{cls_name or mod_name.rsplit('.', 1)[1]}.{name}"
                got = self.times.setdefault(label, [])

                def timed(*a, _fn=inner, _got=got, **k):
                    t = perf()
                    try:
                        return _fn(*a, **k)
                    finally:
                        _got.append(perf() - t)
                self.orig.append((where, name, fn))
                setattr(where, name, timed if kind is None else kind(timed))

    def stop(self, steps: int) -> None:
        for owner, name, fn in reversed(self.orig):
            setattr(owner, name, fn)
        lines = [f"{'function':<44} {'calls/step':>10} {'us/call p50':>12} {'us/step':>9}   ({steps} steps)"]
        for label, got in sorted(self.times.items(), key=lambda kv: -sum(kv[1])):
            if got:
                lines.append(f"{label:<44} {len(got) / steps:>10.2f} {np.median(got) * 1e6:>12.2f} "
                             f"{sum(got) * 1e6 / steps:>9.2f}")
        with open(self.path, "w") as f:
            f.write("\n".join(lines) + "\n")


def model_runs(args, bench: harness.Bench) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    import canary.integrations.transformers as kv_canary

    cuda = args.device == "cuda"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).to(args.device, torch.bfloat16 if cuda else torch.float32).eval()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 500, size=int(rng.integers(16, 65))).tolist() for _ in range(args.requests)]
    lo, hi = max(1, args.new_tokens // 2), max(1, 3 * args.new_tokens // 2)
    limits = [int(rng.integers(lo, hi + 1)) for _ in range(args.requests)]
    gen = GenerationConfig(max_new_tokens=hi, do_sample=False, eos_token_id=-1)
    blocks = args.max_batch * (-(-(64 + hi) // BLOCK)) + 8

    def once(canary: bool):
        cb = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=blocks, max_batch_tokens=512,
                                      max_requests_per_batch=args.max_batch, allow_block_sharing=False,
                                      use_cuda_graph=args.cuda_graphs,
                                      use_async_batching=args.async_batching if cuda else False)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        handle = kv_canary.enable(manager) if canary else None
        manager.warmup()
        clock.reset()
        manager.start()
        for i, (p, n) in enumerate(zip(prompts, limits)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        out: dict = {}
        while len(out) < len(prompts):
            got = manager.get_result(timeout=60)
            if got is None:
                raise harness.CheckFailed(f"engine: {len(out)} of {len(prompts)} requests finished")
            if got.is_finished():
                out[got.request_id] = list(got.generated_tokens)
        manager.stop(block=True)
        stats = None
        if handle is not None:
            stats = handle.stats()
            handle.close()
        manager.destroy()
        return out, clock.decode_median_us(), stats

    clock = StepClock(ContinuousBatchProcessor)
    prof = HookProfile(args.profile) if args.profile else None
    split = HookSplit(args.split) if args.split else None
    rounds = bench.rounds(3)
    host, glue, exposed, off, on, last = [], [], [], [], [], None
    try:
        for r in range(rounds + 1):  # the first round warms up: not recorded
            ref, t_off, _ = once(False)
            if prof is not None and r == rounds:
                prof.start()
            if split is not None and r == rounds:
                split.start()
            got, t_on, stats = once(True)
            if prof is not None and r == rounds:
                prof.stop()
            if split is not None and r == rounds:
                split.stop(stats["host_us_per_step"]["steps"])
            if got != ref:
                raise harness.CheckFailed("tokens: the canary-on run generated other tokens than the canary-off run")
            if stats["violations"] or stats["errors"]:
                raise harness.CheckFailed(f"canary: expected a clean run, got {stats['violations']} violations, "
                                          f"errors {stats['errors']}")
            host.append(stats["host_us_per_decode_step"]["p50"])
            glue.append(stats["glue_us_per_decode_step"]["p50"])
            exposed.append(stats["exposed_us_per_decode_step"]["p50"])
            off.append(t_off)
            on.append(t_on)
            last = stats
    finally:
        clock.close()
    shape = dict(device=args.device, requests=args.requests, max_batch=args.max_batch, new_tokens=args.new_tokens,
                 layers=args.layers, hidden=args.hidden, cuda_graphs=args.cuda_graphs,
                 async_batching=args.async_batching, decode_steps=last["host_us_per_decode_step"]["steps"])
    bench.figure("canary host time / decode step", harness.Timing.of(host[1:]), key="transformers.host_per_step",
                 **shape)
    bench.figure("glue host time / decode step", harness.Timing.of(glue[1:]), key="transformers.glue_per_step",
                 **shape)
    bench.figure("exposed host time / decode step", harness.Timing.of(exposed[1:]),
                 key="transformers.exposed_per_step", **shape)
    bench.figure("decode step, canary off", harness.Timing.of(off[1:]), **shape)
    bench.figure("decode step, canary on", harness.Timing.of(on[1:]), **shape)
    ratios = [100.0 * (b / a - 1.0) for a, b in zip(off[1:], on[1:])]
    bench.figure("decode step overhead", harness.Timing.of(ratios, unit="%"), unit="%",
                 key="transformers.step_overhead", **shape)
    bench.extra.update(torch=torch.__version__, transformers=__import__("transformers").__version__,
                       manager={k: last.get(k) for k in ("graph_replays", "graph_captures", "direct_calls",
                                                          "graph_misses", "stream_handshakes", "steps")},
                       host_us_per_step=last["host_us_per_step"])


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--cuda-graphs", action="store_true", help="the engine's CUDA graphs (GPU)")
    ap.add_argument("--async-batching", action="store_true", help="the engine's async batching (GPU)")
    ap.add_argument("--profile", metavar="FILE", help="a cProfile of the integration's hooks over the last round "
                    "(text; the figures are then inflated by the profiler: do not record them)")
    ap.add_argument("--split", metavar="FILE", help="wall time of the hooks and of the manager's calls and internals "
                    "under them over the last round (text; a timer pair a call: the figures are inflated a little)")
    ap.add_argument("--name", default="transformers", help="the results file's name: transformers, or transformers-<variant> for another configuration")
    args = ap.parse_args(argv)
    bench = harness.Bench(args.name, args, "host clock: the canary's hooks per decode step (perf_counter around "
                          "each hook, summed per step) and the engine loop's period per decode step, each the "
                          "median over a round's decode steps, then the median of rounds; each round runs canary "
                          "off then on over the same requests")
    if bench.dry:
        args.device, args.requests, args.max_batch, args.new_tokens, args.layers, args.hidden = "cpu", 2, 2, 4, 2, 64
    # Always, and alone without torch: how many batch shapes the integration's padding leaves for batches of 1 to
    # --max-batch rows (each shape is one captured graph per manager call; unpadded, one per batch size)
    from canary.integrations.hf_session import bucket

    bench.figure(f"padded batch shapes, 1 to {args.max_batch} rows",
                 float(len({bucket(n, args.max_batch) for n in range(1, args.max_batch + 1)})), unit="shapes",
                 key="transformers.batch_shapes", max_batch=args.max_batch)
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        if not bench.dry:
            bench.figure("canary host time / decode step", None, error=f"{', '.join(missing)} not installed (pip "
                         f"install 'kv-canary[transformers]')")
        print(f"transformers runs skipped: {', '.join(missing)} not installed")
    else:
        try:
            model_runs(args, bench)
        except Exception as exc:  # noqa: BLE001 - recorded as a failed figure
            bench.figure("canary host time / decode step", None, error=f"{type(exc).__name__}: {exc}"[:500])
    bench.extra.update(python=platform.python_version(), numpy=np.__version__, machine=platform.machine())
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
