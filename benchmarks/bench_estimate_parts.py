"""What an estimate costs beyond the floor, and three of its parts: history, saved tensors, copies.

For three small training steps (an MLP, a ``torch.nn`` transformer, a GPT-2-like Hugging Face
model; AdamW, ``foreach=False`` as on CPU), CPU time (``time.process_time``, one thread) of:

- ``floor``: fake copies of the model, a fresh AdamW and the batch under a bare ``FakeTensorMode``
  (``FakeCopyMode``), then the step under it: what any data-free run costs (as
  ``bench_floor.py`` measures it); ``floor's copies``: the copying alone;
- ``estimate``: ``memlab.estimate`` of the step as it is;
- ``estimate, stacks=False``: the same run recording no Python stacks in the history
  (:func:`memlab.estimate.estimate.run_estimate`'s ``stacks``): what the stack walks cost;
- ``estimate, no pack``: the same run with the tracker's saved-tensor hook categorising nothing and
  returning the tensor itself (what the pack hook and its ``detach()`` cost; for measuring only: it
  leaks the graphs of saved outputs);
- ``estimate of a no-op``: ``memlab.estimate`` of a function that does nothing, given the same
  model, optimizer and batch (copying, adopting, setting up and reading the result);
- ``copies``: :class:`memlab.estimate.copies.Copier` copying the model, optimizer and batch under
  the fake mode, alone (what the floor's copies are to the floor).

First, one estimate counted: its stack walks (and the CPU time of one, measured inside the run at
the depth of a tracked allocation) and its saved tensors (those with a ``grad_fn`` are detached by
the pack hook, the rest kept as they are). Then each measure is taken ``--repeats`` times
(medians), the measures interleaved round by round so that load drift hits all of them; the whole
run is done twice. Ratios are within one process. ``PYTHONPATH=/path/to/other/checkout`` runs it
on another memlab (before and after a change).
Run: ``python benchmarks/bench_estimate_parts.py [--repeats N] [--only mlp|transformer|gpt2]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_estimate import train_step  # the training step every estimate benchmark times
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

import memlab
from memlab.estimate.copies import Copier, named_objects
from memlab.estimate.estimate import run_estimate
from memlab.estimate.tensor_copies import tensor_copier
from memlab.sources import device_memory
from memlab.sources.categorising import TrackerCategories


def mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    return model, (torch.randn(16, 64), torch.randint(0, 10, (16,)))


class Transformer(torch.nn.Module):
    def __init__(self, width: int = 64, layers: int = 2, vocab: int = 512) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def transformer() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return Transformer(), (torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32)))


class Gpt2(torch.nn.Module):
    """A GPT-2-like model (Hugging Face's ``GPT2LMHeadModel``, 2 layers, width 64) whose forward
    returns logits, so that one training step serves every model here."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def gpt2() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return Gpt2(), (torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32)))


def no_op(model: Any, optimizer: Any, inputs: Any, targets: Any) -> None:
    return None


MODELS = {"mlp": mlp, "transformer": transformer, "gpt2": gpt2}


def floor_copies(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """Fake copies of the model, a fresh AdamW over them and the batch, under one plain
    ``FakeTensorMode`` (``FakeCopyMode``: what any data-free run must make)."""
    mode = FakeTensorMode(static_shapes=True)
    with FakeCopyMode(mode):
        fake_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(fake_model.parameters(), lr=1e-3, foreach=False)
    return mode, fake_model, optimizer, [mode.from_tensor(t) for t in inputs]


def floor(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """The floor: the copies, then the step under the bare fake mode."""
    mode, fake_model, optimizer, fake_inputs = floor_copies(model, inputs)
    with mode:
        train_step(fake_model, optimizer, *fake_inputs)


@contextlib.contextmanager
def pack_returns_itself() -> Any:
    """For measuring only: the pack hook does nothing (see the module docstring)."""
    original = TrackerCategories._pack
    TrackerCategories._pack = lambda self, tensor: tensor  # type: ignore[method-assign]
    try:
        yield
    finally:
        TrackerCategories._pack = original  # type: ignore[method-assign]


def copy_only(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple[Any, ...]) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        copier = Copier(tensor_copier("fake", mode))
        copier.modules_first([*named_objects(train_step), inputs, {}])
        copier.function(train_step), copier(tuple((model, optimizer, *inputs))), copier({})


def measures(name: str) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    args = (model, optimizer, *inputs)
    device = torch.device("cpu")

    def no_pack() -> Any:
        with pack_returns_itself():
            return memlab.estimate(train_step, *args)

    return {
        "floor": lambda: floor(model, inputs),
        "floor's copies": lambda: floor_copies(model, inputs),
        "estimate": lambda: memlab.estimate(train_step, *args),
        "estimate, stacks=False": lambda: run_estimate(train_step, lambda: (args, {}), device, stacks=False),
        "estimate, no pack": no_pack,
        "estimate of a no-op": lambda: memlab.estimate(no_op, *args),
        "copies": lambda: copy_only(model, optimizer, inputs),
    }


def counted(name: str, repeats: int) -> dict[str, float]:
    """One estimate of ``name``'s step, counting its stack walks and saved tensors, with the CPU
    time of one walk measured inside it (at the depth of a tracked allocation: ``repeats`` x 200
    walks at its 20th allocation, the median)."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    counts = {"walks": 0, "saved": 0, "saved with a grad_fn": 0}
    walk_times: list[float] = []
    walk = device_memory.capture_stack

    def counting_walk() -> Any:
        counts["walks"] += 1
        if counts["walks"] == 20:
            for _ in range(repeats):
                start = time.process_time()
                for _ in range(200):
                    walk()
                walk_times.append((time.process_time() - start) / 200)
        return walk()

    pack = TrackerCategories._pack

    def counting_pack(self: Any, tensor: torch.Tensor) -> Any:
        counts["saved"] += 1
        counts["saved with a grad_fn"] += tensor.grad_fn is not None
        return pack(self, tensor)

    memlab.estimate(train_step, model, optimizer, *inputs)  # warm up
    device_memory.capture_stack, TrackerCategories._pack = counting_walk, counting_pack  # type: ignore[method-assign]
    try:
        memlab.estimate(train_step, model, optimizer, *inputs)
    finally:
        device_memory.capture_stack, TrackerCategories._pack = walk, pack  # type: ignore[method-assign]
    return {**counts, "walk s": statistics.median(walk_times)}


def median_times(name: str, repeats: int) -> dict[str, float]:
    found = measures(name)
    times: dict[str, list[float]] = {label: [] for label in found}
    for round_ in range(repeats + 1):  # the first round warms up (imports, caches)
        for label, fn in found.items():
            start = time.process_time()
            fn()
            elapsed = time.process_time() - start
            if round_:
                times[label].append(elapsed)
    return {label: statistics.median(values) for label, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=sorted(MODELS), action="append")
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}; loadavg {os.getloadavg()}")
    for name in options.only or list(MODELS):
        counts = counted(name, options.repeats)
        walks = counts["walks"] * counts["walk s"]
        print(
            f"{name}: {counts['walks']} stack walks per estimate, {counts['walk s'] * 1e6:.2f} us each "
            f"({walks * 1e3:.2f} ms); {counts['saved']} saved tensors, {counts['saved with a grad_fn']} "
            f"with a grad_fn (detached by the pack hook; the rest kept as they are)"
        )
        for run in (1, 2):
            medians = median_times(name, options.repeats)
            floor, full = medians["floor"], medians["estimate"]
            parts = ", ".join(
                f"{label} {value * 1e3:.1f} ms ({value / full:.0%})"
                for label, value in medians.items()
                if label != "estimate"
            )
            print(
                f"{name} (run {run}): estimate / floor = {full / floor:.2f} "
                f"(estimate {full * 1e3:.1f} ms, floor {floor * 1e3:.1f} ms); "
                f"stack walks {(full - medians['estimate, stacks=False']) / full:.1%} of the estimate, "
                f"pack hook {(full - medians['estimate, no pack']) / full:.1%}; {parts}"
            )
    print(f"loadavg {os.getloadavg()}")


if __name__ == "__main__":
    main()
