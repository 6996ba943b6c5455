"""One tensor-parallel rank of test_transformers_tp.py: a config-built tiny Llama sharded over the TP group (the
path ``from_pretrained(distributed_config=DistributedConfig(tp_size=N))`` takes: ``prepare_distribute_model``,
then ``maybe_distribute_model``), continuous batching through the manager API, three sessions: canary off, canary
on (clean), canary on with a K byte flipped on rank ``FLIP_RANK`` only. Writes ``rank{r}.json``.

``python tp_child.py RANK WORLD PORT OUT_DIR MODE``: ``cpu`` (gloo, fp32), ``cuda`` (NCCL, one GPU a rank, bf16,
the engine's CUDA graphs) or ``cuda-shared`` (every rank on GPU 0 over gloo, bf16, no CUDA graphs: NCCL refuses
two ranks on one GPU, and gloo's collectives cannot be captured).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from canary.replay.ranks import end as end_rank

BLOCK = 16
FLIP_STEP, FLIP_RANK = 8, 1
PROMPTS = [[(7 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate((20, 9, 30, 14))]
NEW_TOKENS = 24
MODES = {"cpu": ("gloo", "cpu", False), "cuda": ("nccl", "cuda", True), "cuda-shared": ("gloo", "cuda", False)}


def tiny_model(device: str, world: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    torch.manual_seed(0)  # every rank builds the same full weights; each keeps its shards (src_data_rank=None)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    dc, device_map, mesh = LlamaForCausalLM.prepare_distribute_model(DistributedConfig(tp_size=world))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = model.to(device=device_map, dtype=dtype)  # "cpu", or this rank's GPU (LOCAL_RANK)
    return LlamaForCausalLM.maybe_distribute_model(model, dc, mesh).eval()


def run(model, graphs: bool, canary: bool, flip: bool) -> dict:
    import canary.integrations.transformers as kvc
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
    extra = {"use_cuda_graph": graphs}
    cb = ContinuousBatchingConfig(block_size=BLOCK, num_blocks=32, max_batch_tokens=64, allow_block_sharing=False,
                                  **extra)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    delivered = []  # (report step, reasons) per delivery: what each rank's on_violation saw, and when
    handle = kvc.enable(manager, on_violation=lambda found: delivered.append(
        (found.step, sorted(r for v in found for r in v.reason_names)))) if canary else None
    manager.warmup()
    processor = manager.batch_processor
    rank = processor.distributed_helper.tp_local_rank
    flipped = []
    if flip and rank == FLIP_RANK:
        inner, count = processor.model_runner.compute_batch, [0]

        def compute_batch(m, batch):
            if count[0] == FLIP_STEP:  # req_0's position 2, layer 0's K, this rank's heads only
                s = processor.cache.group_cache_managers[0].block_table["req_0"][0] * BLOCK + 2
                stream = processor.inputs_and_outputs.compute_stream
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    processor.cache.key_cache[0].view(torch.uint8)[s].view(-1)[5] ^= 0x10
                flipped.append(int(s))
            count[0] += 1
            return inner(m, batch)
        processor.model_runner.compute_batch = compute_batch
    manager.start()
    manager.add_requests(PROMPTS, max_new_tokens=NEW_TOKENS)  # a no-op but on the TP driver (rank 0)
    results = {}  # every rank's engine delivers the results (each runs the same requests)
    while len(results) < len(PROMPTS):
        got = manager.get_result(timeout=300 if graphs or model.device.type == "cuda" else 120)  # GPU: compiles
        if got is None:
            break
        if got.is_finished():
            results[got.request_id] = list(got.generated_tokens)
    manager.stop(block=True)
    out = {"tokens": results, "flipped": flipped, "delivered": delivered}
    if handle is not None:
        handle.close()
        st = handle.stats()
        out["stats"] = {k: st[k] for k in ("violations", "errors", "ranks", "agreement", "steps", "sessions",
                                           "protected_requests", "written_entries")}
        out["violations"] = [{"reasons": list(v.reason_names), "slot": v.slot, "position": v.position,
                              "first_step": v.first_step, "requests": list(v.request_ids), "kernel": v.kernel,
                              "scope": getattr(v, "scope", None), "peers": list(getattr(v, "peers", ())),
                              "line": v.line()} for v in handle.violations]
    manager.destroy()
    return out


def main() -> None:
    rank, world, port, out, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5]
    backend, device, graphs = MODES[mode]
    gpu = rank if mode == "cuda" else 0
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(gpu))  # LOCAL_RANK: the GPU transformers' TP setup puts the rank on
    if device == "cuda":
        torch.cuda.set_device(gpu)
    dist.init_process_group(backend, rank=rank, world_size=world)
    model = tiny_model(device, world)
    result = {}
    for name, canary, flip in (("off", False, False), ("clean", True, False), ("flip", True, True)):
        result[name] = run(model, graphs, canary, flip)
        with open(out / f"rank{rank}.done", "a") as f:  # what the test reads when a rank dies: which runs ended
            f.write(name + "\n")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_rank(0)  # without the interpreter's teardown (its docstring says why)
