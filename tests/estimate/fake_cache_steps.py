"""Run as a script: three estimates of an LSTM, a GRU and a transformer training step in one fresh
process, printed as JSON (each estimate's memory_stats and its allocator events, action and size,
in order), for tests/estimate/test_fake_cache.py."""

from __future__ import annotations

import json

import torch

import memlab


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    out = model(x)
    (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def events(estimate: memlab.Estimate) -> list[list[object]]:
    (trace,) = [trace for trace in estimate.tracker.snapshot()["device_traces"] if trace]
    return [[event["action"], event["size"]] for event in trace]


def models() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    return {
        "lstm": (torch.nn.LSTM(64, 64, num_layers=2, batch_first=True), torch.randn(8, 32, 64)),
        "gru": (torch.nn.GRU(64, 64, num_layers=2, batch_first=True), torch.randn(8, 32, 64)),
        "transformer": (
            torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
            torch.randn(8, 32, 64),
        ),
    }


if __name__ == "__main__":
    stats = {}
    for name, (model, x) in models().items():
        optimizer = torch.optim.AdamW(model.parameters())
        estimates = [memlab.estimate(step, model, optimizer, x, device="cuda") for _ in range(3)]
        stats[name] = [{"stats": e.stats, "events": events(e)} for e in estimates]
    print(json.dumps(stats))
