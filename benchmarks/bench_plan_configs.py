"""``memlab estimate CONFIG --plan``: how long a plan of a real-size model takes, data-free, and what
it chooses, for GPT-2 124M, Llama-3.2-1B and Llama-3-8B configs (``tests/data/configs/``) on an
H100 and an A100-40GB (their memory less 512 MiB for the CUDA context as the budget).

Each job is a batch that does not fit as it is (two AdamW steps in a row, bf16 autocast):

- GPT-2 124M: 64 x 1024 tokens, float32 weights;
- Llama-3.2-1B: 16 x 2048 tokens, float32 weights;
- Llama-3-8B: 8 x 2048 tokens, bfloat16 weights (float32 ones and their AdamW states, 128 GB, fit
  neither GPU; on the A100-40GB the bfloat16 ones do not either: the plan says so).

Per job: wall and CPU seconds of the whole plan (``memlab.cli.main`` in this process, imports done
before), the configurations it estimated, its verdict (what changes, extra FLOPs and roofline
time) and the peak reserved bytes planned. The plan's choice is not checked against an exhaustive
search here (``bench_plan.py --exhaustive`` does that on small models: each estimate of these
costs seconds).
Run: ``PYTHONPATH=. python benchmarks/bench_plan_configs.py`` from the repository root (``--jobs
gpt2-124m`` to pick). Needs ``transformers``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "data" / "configs"
JOBS = {
    "gpt2-124m": ["--batch-size", "64", "--seq-len", "1024"],
    "llama-3.2-1b": ["--batch-size", "16", "--seq-len", "2048"],
    "llama-3-8b": ["--batch-size", "8", "--seq-len", "2048", "--dtype", "bfloat16"],
}
GPUS = ("H100", "A100-40GB")
GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--gpus", nargs="+", default=list(GPUS))
    arguments = parser.parse_args()
    import torch
    import transformers

    from memlab.cli import main as cli

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, loadavg {os.getloadavg()}")
    for job in arguments.jobs:
        for gpu in arguments.gpus:
            argv = ["estimate", str(CONFIGS / job), *JOBS[job], "--autocast", "bf16", "--steps", "2"]
            argv += ["--gpu", gpu, "--plan", "--json"]
            out = io.StringIO()
            wall, cpu = time.perf_counter(), time.process_time()
            with contextlib.redirect_stdout(out):
                cli(argv)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            plan = json.loads(out.getvalue())["plan"]
            verdict = plan["text"].splitlines()[0].split(": ", 1)[1]
            print(
                f"{job} on {gpu}: {wall:.1f} s wall ({cpu:.1f} CPU s), {plan['estimated']} estimated; "
                f"{verdict}; planned peak {plan['peak_reserved'] / GiB:.2f} GiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
