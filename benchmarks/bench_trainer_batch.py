"""Trainer batch search: memlab's ``max_batch_size(trainer)`` vs accelerate's ``find_executable_batch_size``.

The same Hugging Face ``Trainer`` (GPT-2 from a config, random tokens, bf16 autocast on CPU,
gradient accumulation 2, 3 optimizer steps) under the same memory capacity: a ``TensorTracker`` whose
modelled CUDA caching allocator has ``--capacity`` MiB raises ``torch.OutOfMemoryError`` as a GPU
of that size would.

* memlab: ``memlab.integrations.transformers.max_batch_size(trainer, capacity, steps=3)``, data-free
  estimates; then one real training at the size it returns, to check that it fits.
* accelerate: ``find_executable_batch_size`` (what ``TrainingArguments(auto_find_batch_size=True)``
  uses) starting at ``--start``: real trainings, reducing the batch after each out-of-memory error
  (accelerate 1.15: to 90 %, rounded down).

Run: ``python benchmarks/bench_trainer_batch.py`` (options: ``--capacity``, ``--start``,
``--layers``, ``--hidden``, ``--seq``). Prints one line per method (answer, effective batch, wall
time, out-of-memory errors raised) and a final ``RESULT`` line.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings

import torch

import memlab

MiB = 1 << 20


def make_trainer(options: argparse.Namespace, output: str, batch_size: int, accumulation: int) -> object:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=options.layers, n_embd=options.hidden, n_head=4, vocab_size=512, n_positions=options.seq
    )
    tokens = torch.randint(0, 512, (256, options.seq), generator=torch.Generator().manual_seed(1)).tolist()
    args = transformers.TrainingArguments(
        output_dir=output,
        max_steps=3,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        bf16=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data)


def train(trainer: object, capacity: int) -> None:
    """Three real optimizer steps under a tracker of ``capacity`` bytes (out of memory beyond it)."""
    with memlab.TensorTracker(capacity=capacity) as tracker:
        tracker.adopt(roots=[trainer.model])
        trainer.train()


def with_memlab(options: argparse.Namespace, capacity: int, output: str) -> tuple[int, int, float, int]:
    from memlab.integrations.transformers import max_batch_size

    trainer = make_trainer(options, output, options.start, options.accumulation)
    start = time.perf_counter()
    fit = max_batch_size(trainer, capacity, steps=3, device="cpu")
    elapsed = time.perf_counter() - start
    size, accumulation = fit.per_device_train_batch_size, fit.gradient_accumulation_steps
    train(make_trainer(options, output, size, accumulation), capacity)  # it fits: no error
    print(f"  memlab search: {fit!r}")
    return size, accumulation, elapsed, 0


def with_accelerate(options: argparse.Namespace, capacity: int, output: str) -> tuple[int, int, float, int]:
    from accelerate.utils import find_executable_batch_size

    ooms = []

    @find_executable_batch_size(starting_batch_size=options.start)
    def run(batch_size: int) -> int:
        try:
            train(make_trainer(options, output, batch_size, options.accumulation), capacity)
        except torch.OutOfMemoryError:
            ooms.append(batch_size)
            raise
        return batch_size

    start = time.perf_counter()
    found = run()
    elapsed = time.perf_counter() - start
    print(f"  accelerate tried: {[*ooms, found]} (out of memory at {ooms})")
    return found, options.accumulation, elapsed, len(ooms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=80, help="modelled GPU memory, MiB (default 80)")
    parser.add_argument("--start", type=int, default=48, help="the trainer's per-device batch (default 48)")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps (default 2)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    options = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    capacity = options.capacity * MiB
    print(
        f"GPT-2 {options.layers} layers, hidden {options.hidden}, seq {options.seq}, bf16 autocast on CPU, "
        f"3 steps; trainer's batch {options.start} x accumulation {options.accumulation} "
        f"(effective {options.start * options.accumulation}); capacity {options.capacity} MiB "
        f"(TensorTracker, CUDA caching allocator model, H100 cuBLAS workspaces)"
    )
    rows = {}
    with tempfile.TemporaryDirectory() as output:
        for name, method in (("memlab", with_memlab), ("accelerate", with_accelerate)):
            size, accumulation, elapsed, ooms = method(options, capacity, output)
            rows[name] = (size, accumulation, elapsed, ooms)
            print(
                f"{name:<11} per-device batch {size:>4}, accumulation {accumulation}, effective "
                f"{size * accumulation:>4}, {elapsed:6.1f} s, {ooms} out-of-memory errors"
            )
    memlab_row, accelerate_row = rows["memlab"], rows["accelerate"]
    print(
        f"RESULT memlab batch {memlab_row[0]} (effective {memlab_row[0] * memlab_row[1]}) in "
        f"{memlab_row[2]:.1f} s, 0 OOMs; accelerate batch {accelerate_row[0]} (effective "
        f"{accelerate_row[0] * accelerate_row[1]}) in {accelerate_row[2]:.1f} s, {accelerate_row[3]} OOMs"
    )


if __name__ == "__main__":
    main()
