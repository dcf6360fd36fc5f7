"""``memlab estimate CONFIG``: the whole command, from a config.json to the printed answer, for
Llama-style 1B, 8B and 70B configs (``tests/data/configs/``), beside the floor and the formulas.

For each config, in fresh processes (so that time and host memory are that run's alone):

- the command: ``memlab estimate CONFIG --seq-len 2048 --autocast bf16 --json`` (one AdamW step at
  1 x 2048 tokens, float32 weights, bf16 autocast, an H100 modelled), run by ``memlab.cli.main`` in
  a fresh interpreter as ``python -m memlab`` runs it: wall seconds from the interpreter's start to
  its exit, CPU seconds (user + system: what the run costs when other processes share the cores),
  and its peak resident set (``ru_maxrss``);
- the floor: the same step, the model built the same way (``no_init_weights``) under a bare
  ``FakeTensorMode``, with no tracker, no copies, no allocator model: what any data-free run of
  this step costs (imports included);
- the closed-form numbers the command prints (params x 16 B, accelerate's, DeepSpeed ZeRO-3's).

``--max-batch-size`` adds the 8B's batch search (``--max-batch-size``, the same step with bfloat16
weights on an H200, where a float32 AdamW step of 8B parameters does not fit at any batch).

Run: ``python benchmarks/bench_estimate_command.py`` (``--configs llama-3-8b`` to pick, ``--repeat 3``
for the least time of three runs, ``--max-batch-size`` for the search, ``--profile CONFIG`` for a
cProfile of the command).
Needs ``transformers``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "data" / "configs"
COMMAND = ["--seq-len", "2048", "--autocast", "bf16", "--json"]
GiB = 2**30

FLOOR = """
import sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
import transformers
from transformers.modeling_utils import no_init_weights
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
with FakeTensorMode(allow_non_fake_inputs=True):
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, config.vocab_size, (1, 2048))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def run_child(argv: list[str]) -> tuple[float, float, int, str]:
    """Wall seconds, CPU seconds, peak resident bytes and stdout of ``argv`` run through this
    script's ``--child`` mode (which reports its own CPU time and ``ru_maxrss`` on stderr's last
    line). CPU seconds say what the run costs when other processes share the machine's cores."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--child", *argv], capture_output=True, text=True, cwd=ROOT, check=False
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    cpu, rss = done.stderr.strip().splitlines()[-1].split()
    return seconds, float(cpu), int(rss), done.stdout


def best(argv: list[str], repeat: int) -> tuple[float, float, int, str]:
    """:func:`run_child` ``repeat`` times: the least wall and CPU seconds (other processes only
    ever add time), the largest resident set, the last output."""
    runs = [run_child(argv) for _ in range(repeat)]
    return min(r[0] for r in runs), min(r[1] for r in runs), max(r[2] for r in runs), runs[-1][3]


def child(argv: list[str]) -> None:
    """Run ``python -m memlab ...`` or the floor in this process (``--child``), then print its CPU
    seconds and peak resident set in bytes on stderr."""
    import resource

    sys.path.insert(0, str(ROOT))  # this checkout's memlab, not an installed one
    try:
        if argv[0] == "floor":
            sys.argv = ["floor", argv[1]]
            exec(compile(FLOOR, "floor", "exec"), {"__name__": "__floor__"})
        else:
            from memlab.cli import main

            status = main(argv)
            if status:
                sys.exit(status)
    finally:
        sys.stdout.flush()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        print(f"{usage.ru_utime + usage.ru_stime} {usage.ru_maxrss * 1024}", file=sys.stderr)


def profile(config: str) -> None:
    """cProfile of the whole command for ``config`` in this process: where the time goes."""
    sys.path.insert(0, str(ROOT))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    from memlab.cli import main

    main(["estimate", str(CONFIGS / config), *COMMAND])
    profiler.disable()
    print(f"\n{time.perf_counter() - start:.2f} s under cProfile", file=sys.stderr)
    stats = pstats.Stats(profiler, stream=sys.stderr)
    stats.sort_stats("cumulative").print_stats(40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["llama-3.2-1b", "llama-3-8b", "llama-3-70b"])
    parser.add_argument("--max-batch-size", action="store_true", help="also time the 8B's batch search")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the least time is shown")
    parser.add_argument("--profile", metavar="CONFIG", help="print a cProfile of the command for CONFIG")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child is not None:
        child(arguments.child)
        return
    if arguments.profile:
        profile(arguments.profile)
        return
    import torch
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} CPUs")
    print(f"uptime before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(
        "one AdamW step, 1 x 2048 tokens, float32 weights, bf16 autocast, H100; fresh process each, "
        f"least of {arguments.repeat} run(s)"
    )
    print(
        "config | params | command s (CPU s) | command host GiB | floor s (CPU s) | floor host GiB | "
        "peak allocated GiB | peak reserved GiB | params x 16 B GiB | accelerate GiB | ZeRO-3 GiB"
    )
    for config in arguments.configs:
        path = str(CONFIGS / config)
        seconds, cpu, rss, out = best(["estimate", path, *COMMAND], arguments.repeat)
        answer = json.loads(out)
        floor_s, floor_cpu, floor_rss, _ = best(["floor", path], arguments.repeat)
        forms = answer["formulas"]
        print(
            f"{config} | {answer['parameters'] / 1e9:.2f}B | {seconds:.1f} ({cpu:.1f}) | {rss / GiB:.2f} | "
            f"{floor_s:.1f} ({floor_cpu:.1f}) | {floor_rss / GiB:.2f} | "
            f"{answer['peak_allocated'] / GiB:.1f} | {answer['peak_reserved'] / GiB:.1f} | "
            f"{forms['model_states'] / GiB:.1f} | {forms['accelerate'] / GiB:.1f} | "
            f"{forms['deepspeed_zero3'] / GiB:.1f}",
            flush=True,
        )
    if arguments.max_batch_size:
        path = str(CONFIGS / "llama-3-8b")
        argv = ["estimate", path, *COMMAND, "--dtype", "bfloat16", "--max-batch-size", "--gpu", "H200"]
        seconds, cpu, rss, out = run_child(argv)
        answer = json.loads(out)
        print(
            f"llama-3-8b, bfloat16 weights, --max-batch-size on an H200: {answer['max_batch_size']} "
            f"({answer['max_batch_size_estimates']} estimates), {seconds:.1f} s ({cpu:.1f} CPU s), "
            f"{rss / GiB:.2f} GiB host",
            flush=True,
        )

    print(f"uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
