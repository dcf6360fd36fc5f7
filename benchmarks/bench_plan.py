"""How long ``memlab.plan`` takes, and what it chooses, for Llama-style models built from configs.

For each model (a Hugging Face ``LlamaForCausalLM`` from a config, random weights, never
downloaded): the step's estimate as it is, then a plan for budgets of 80 % and 60 % of it (and,
with ``--exhaustive``, every count of checkpointed blocks estimated one by one, to check that the
plan's choice is the least count that fits). Wall-clock and CPU seconds of each ``plan`` call
(``time.perf_counter``, ``time.process_time``), the configurations it estimated (a capped rerun
not counted), its verdict (its choice, the extra FLOPs and roofline time it reports) and, with
``--exhaustive``, the least count of blocks that fits checkpointed as the plan checkpoints them
(selectively or whole). One torch thread. Issue 28's goal: a 32-layer Llama-style config (small
width) plans in under 10 s on this machine.
Run: ``PYTHONPATH=. python benchmarks/bench_plan.py [--exhaustive]`` from the repository root.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import transformers

import memlab
from memlab.plan.checkpointing import candidate_blocks, checkpoint, uncheckpoint
from tests.plan.test_hugging_face import train_step  # the Llama step the tests plan

VOCAB = 1024

CONFIGS = {
    "llama-32-layers-width-128": dict(num_hidden_layers=32, hidden_size=128, intermediate_size=384),
    "llama-8-layers-width-512": dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1536),
}


def make(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        **CONFIGS[name],
    )
    model = transformers.LlamaForCausalLM(config)
    return model, torch.optim.AdamW(model.parameters()), torch.randint(0, VOCAB, (8, 512))


def exhaustive(model, optimizer, tokens, budget: int, selective: bool) -> int | None:
    """The least count of first blocks checkpointed (``selective``: selectively, as the plan chose)
    whose step fits ``budget``, trying every count."""
    blocks = [module for _, module in candidate_blocks(model)]
    for count in range(len(blocks) + 1):
        checkpoint(blocks[:count], selective)
        try:
            if memlab.estimate(train_step, model, optimizer, tokens, steps=2).fits(budget):
                return count
        finally:
            uncheckpoint(blocks[:count])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--exhaustive", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # the layers' "Caching is incompatible" notice
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, loadavg {os.getloadavg()}")
    for name in CONFIGS:
        model, optimizer, tokens = make(name)
        start = time.perf_counter()
        as_it_is = memlab.estimate(train_step, model, optimizer, tokens, steps=2).peak_reserved
        one = time.perf_counter() - start
        print(
            f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters; one estimate {one:.2f} s; "
            f"as it is {as_it_is / 2**20:.0f} MiB reserved"
        )
        for share in (0.8, 0.6):
            budget = int(as_it_is * share)
            wall, cpu = time.perf_counter(), time.process_time()
            found = memlab.plan(train_step, model, optimizer, tokens, budget=budget, steps=2)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            line = (
                f"  budget {share:.0%}: {wall:.1f} s wall, {cpu:.1f} s CPU, {found.estimated} estimated; "
                f"{repr(found).splitlines()[0].split(': ', 1)[1]}"
            )
            if options.exhaustive:
                least = exhaustive(model, optimizer, tokens, budget, found.settings.selective)
                line += f"; exhaustive search: {least}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
