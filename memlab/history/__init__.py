"""Allocation history: where every byte was allocated, and PyTorch memory snapshots from any device.

:mod:`.recorder` keeps the bounded log of allocator events with interned Python stacks;
:mod:`.categories` defines what a block holds (parameter, gradient, activation, ...);
:mod:`.export` writes and reads the ``torch.cuda.memory._snapshot()`` pickles that PyTorch's
viewer reads (an allocator model builds its dict: :mod:`memlab.sources.allocator.snapshot`).
"""

from __future__ import annotations
