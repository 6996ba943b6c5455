"""The KV canary inside Hugging Face transformers' continuous batching: one call switches it on.

A tiny Llama built from its config (random weights, nothing downloaded) answers a few requests through
``model.generate_batch``; the canary verifies every cached token of every step and prints its report. With
``--flip`` a stray write flips one byte of a cached token's K while the engine runs, and the canary names the
request it hit. CPU (fp32, the reference backend) by default where no GPU is visible; ``--device cuda`` runs
bf16 with the engine's CUDA graphs (the canary's CuPy backend). Needs ``pip install ".[transformers]"`` in the checkout.

    python examples/transformers_continuous_batching.py [--device cpu|cuda] [--flip]
"""
import argparse
import contextlib
import logging

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import canary.integrations.transformers as kv_canary

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--flip", action="store_true", help="flip a byte of req_0's cached K at the sixth step")
args = parser.parse_args()
logging.basicConfig(format="%(message)s", level=logging.WARNING)
cuda = args.device == "cuda"

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
model = LlamaForCausalLM(config).to(args.device, torch.bfloat16 if cuda else torch.float32).eval()
prompts = [[(11 * i + j) % 250 + 1 for j in range(8 + 7 * i)] for i in range(5)]
generation = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=-1)
batching = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=128, allow_block_sharing=False,
                                    use_cuda_graph=cuda)

def stray_write_at_step_6(model):
    """A stand-in for an engine bug (demo only, not part of the integration): at the sixth step, flip one bit of
    req_0's cached K (layer 1, position 3), on the engine's compute stream."""
    init, steps = model.init_continuous_batching, [0]

    def init_and_hook(*a, **kw):
        manager = init(*a, **kw)
        manager.warmup()  # builds the batch processor now (generate_batch's own warm-up then has nothing to do)
        processor = manager.batch_processor
        inner = processor.model_runner.compute_batch

        def compute_batch(m, batch):
            steps[0] += 1
            if steps[0] == 6:
                cache, stream = processor.cache, processor.inputs_and_outputs.compute_stream
                slot = cache.group_cache_managers[0].block_table["req_0"][0] * cache.block_size + 3
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    cache.key_cache[1].view(torch.uint8)[slot].view(-1)[0] ^= 0x40
            return inner(m, batch)
        processor.model_runner.compute_batch = compute_batch
        return manager
    model.init_continuous_batching = init_and_hook


# --- the user's code: one call, then the engine as usual --------------------------------------------------------
handle = kv_canary.enable(model)                        # every manager the model creates now carries the canary
if args.flip:
    stray_write_at_step_6(model)
out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
stats = handle.stats()
handle.close()
# ------------------------------------------------------------------------------------------------------------------

print(f"{len(out)} requests, {sum(len(r.generated_tokens) for r in out.values())} tokens generated "
      f"on {args.device}")
print(f"canary: {stats['steps']} steps, {stats['protected_requests']} requests protected, "
      f"{stats['verified_entries']['kv']} cached tokens verified, {stats['written_entries']['kv']} written")
print(f"canary: host time per step {stats['host_us_per_step']['mean']:.0f} us "
      f"(this integration's own {stats['glue_us_per_step']['mean']:.0f} us)")
print(f"violations: {stats['violations']} {stats['violations_by_reason']}")
for v in handle.violations:
    print(f"  step {v.first_step}: slot {v.slot} position {v.position} {'|'.join(v.reason_names)} "
          f"layer {v.layer} requests {list(v.request_ids)}")
