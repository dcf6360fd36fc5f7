"""Allocation history: where every byte was allocated, and PyTorch memory snapshots from any device.

:mod:`.recorder` keeps the bounded log of allocator events with interned Python stacks;
:mod:`.categories` defines what a block holds (parameter, gradient, activation, ...);
:mod:`.export` turns an allocator's state and log into ``torch.cuda.memory._snapshot()`` dicts and
pickles that PyTorch's viewer reads.
"""

from __future__ import annotations
