"""What a line's numbers mean: intervals per frame, aggregation over hits, the ``def`` row."""

from __future__ import annotations

import asyncio
import gc

import torch

import memlab

U8 = torch.uint8
RECORDED = ("allocated_bytes.all.peak", "allocated_bytes.all.allocated", "allocated_bytes.all.freed")
EXACT = ("hits", *RECORDED)


def inner():
    torch.nn.Linear(100, 100)


def outer():
    linear = torch.nn.Linear(100, 100)  # noqa: F841
    linear2 = torch.nn.Linear(100, 100)  # noqa: F841
    inner()


def test_published_pytorch_memlab_example_reads_the_same_on_cpu():
    lp = memlab.LineProfiler(outer, inner)
    with lp:
        outer()
    text = repr(lp.display())
    assert text == (
        "modelled (no CUDA GPU here): CUDA caching allocator replayed from cpu tensors "
        "(memlab.TensorTracker); no tensors existed before profiling\n"
        "\n"
        f"## outer  (tests/line_profiler/test_semantics.py:{outer.__code__.co_firstlineno})\n"
        "\n"
        "active_bytes reserved_bytes line  code\n"
        "         all            all\n"
        "        peak           peak\n"
        f"       0.00B          0.00B {outer.__code__.co_firstlineno:>4}  def outer():\n"
        f"      40.00K          2.00M {outer.__code__.co_firstlineno + 1:>4}"
        "      linear = torch.nn.Linear(100, 100)  # noqa: F841\n"
        f"      80.00K          2.00M {outer.__code__.co_firstlineno + 2:>4}"
        "      linear2 = torch.nn.Linear(100, 100)  # noqa: F841\n"
        f"     120.00K          2.00M {outer.__code__.co_firstlineno + 3:>4}      inner()\n"
        "\n"
        "\n"
        f"## inner  (tests/line_profiler/test_semantics.py:{inner.__code__.co_firstlineno})\n"
        "\n"
        "active_bytes reserved_bytes line  code\n"
        "         all            all\n"
        "        peak           peak\n"
        f"      80.00K          2.00M {inner.__code__.co_firstlineno:>4}  def inner():\n"
        f"     120.00K          2.00M {inner.__code__.co_firstlineno + 1:>4}      torch.nn.Linear(100, 100)\n"
    )


def helper_allocating_a_temporary():
    temporary = torch.empty(3000, dtype=U8)
    del temporary


def calls_unprofiled_helper():
    kept = torch.empty(1000, dtype=U8)
    helper_allocating_a_temporary()
    return kept


def test_an_unprofiled_call_is_inside_the_callers_line(exact, rows):
    lp = memlab.LineProfiler(calls_unprofiled_helper, columns=RECORDED)
    with lp:
        kept = calls_unprofiled_helper()
    assert rows(lp, calls_unprofiled_helper, (*EXACT, "delta")) == [
        ("def calls_unprofiled_helper():", 1, 0, 0, 0, 0),
        ("kept = torch.empty(1000, dtype=U8)", 1, 1000, 1000, 0, 1000),
        ("helper_allocating_a_temporary()", 1, 4000, 3000, 3000, 0),
        ("return kept", 1, 1000, 0, 0, 0),
    ]
    assert kept.numel() == 1000


def profiled_callee(n):
    block = torch.empty(n, dtype=U8)
    del block


def calls_profiled_callee():
    profiled_callee(2000)
    profiled_callee(500)


def test_a_profiled_call_is_inside_the_callers_line_and_has_its_own_rows(exact, rows):
    lp = memlab.LineProfiler(calls_profiled_callee, profiled_callee, columns=RECORDED)
    with lp:
        calls_profiled_callee()
    assert rows(lp, calls_profiled_callee, EXACT) == [
        ("def calls_profiled_callee():", 1, 0, 0, 0),
        ("profiled_callee(2000)", 1, 2000, 2000, 2000),
        ("profiled_callee(500)", 1, 500, 500, 500),
    ]
    assert rows(lp, profiled_callee, EXACT) == [
        ("def profiled_callee(n):", 2, 0, 0, 0),
        ("block = torch.empty(n, dtype=U8)", 2, 2000, 2500, 0),
        ("del block", 2, 2000, 0, 2500),
    ]


def loop(n):
    total = 0
    for i in range(n):
        block = torch.empty(100 * (i + 1), dtype=U8)
        total += block.numel()
    return total


def test_repeated_lines_take_the_max_of_peaks_the_sum_of_totals_and_count_hits(exact, rows):
    lp = memlab.LineProfiler(loop, columns=(*RECORDED, "allocated_bytes.all.current"))
    with lp:
        loop(3)
    # block i+1 is created while block i is alive: 100+200, then 200+300.
    assert rows(lp, loop, (*EXACT, "allocated_bytes.all.current", "delta")) == [
        ("def loop(n):", 1, 0, 0, 0, 0, 0),
        ("total = 0", 1, 0, 0, 0, 0, 0),
        ("for i in range(n):", 4, 300, 0, 0, 300, 0),
        ("block = torch.empty(100 * (i + 1), dtype=U8)", 3, 500, 600, 300, 300, 300),
        ("total += block.numel()", 3, 300, 0, 0, 300, 0),
        ("return total", 1, 300, 0, 0, 300, 0),
    ]


def decorated_twice(fn):
    return fn


@decorated_twice
@decorated_twice
def with_decorators():
    return torch.empty(10, dtype=U8)


def test_the_entry_row_is_on_the_def_line_never_on_a_decorator(exact, rows):
    lp = memlab.LineProfiler(with_decorators, columns=RECORDED)
    with lp:
        with_decorators()
    assert rows(lp, with_decorators, ("hits", "allocated_bytes.all.peak")) == [
        ("@decorated_twice", None, None),
        ("@decorated_twice", None, None),
        ("def with_decorators():", 1, 0),
        ("return torch.empty(10, dtype=U8)", 1, 10),
    ]


def recurse(n):
    block = torch.empty(1000 * (n + 1), dtype=U8)
    if n:
        recurse(n - 1)
    del block
    return n


def test_recursion_keeps_one_interval_per_frame(exact, rows):
    lp = memlab.LineProfiler(recurse, columns=(*RECORDED, "allocated_bytes.all.current"))
    with lp:
        recurse(3)
    # Live bytes when each level starts: 0 (n=3), 4000 (n=2), 7000 (n=1), 9000 (n=0).
    # The outermost recursive call line holds the whole deeper subtree (3000+2000+1000); the
    # deeper ones are inside it and add nothing to the line's totals again.
    assert rows(lp, recurse, (*EXACT, "allocated_bytes.all.current")) == [
        ("def recurse(n):", 4, 9000, 0, 0, 9000),  # current: at the last entry
        ("block = torch.empty(1000 * (n + 1), dtype=U8)", 4, 10000, 10000, 0, 10000),
        ("if n:", 4, 10000, 0, 0, 10000),
        ("recurse(n - 1)", 3, 10000, 3000 + 2000 + 1000, 3000 + 2000 + 1000, 4000),
        ("del block", 4, 10000, 0, 10000, 0),
        ("return n", 4, 9000, 0, 0, 0),
    ]


def descend(n):
    page = torch.empty(4096, dtype=U8)
    tag = torch.empty(512, dtype=U8)
    if n:
        descend(n - 1)
        tag = torch.empty(512, dtype=U8)
    return n + page.numel() * 0 + tag.numel() * 0


def test_recursion_counts_each_allocation_once_per_line(exact, rows):
    lp = memlab.LineProfiler(descend, columns=RECORDED)
    with lp:
        descend(9)
    # Ten frames made 10 x 4 KiB + 19 x 512 B in all. Each line that makes a tensor counts it
    # once; the call line holds what the nine deeper frames made (9 x 4 KiB + 17 x 512 B) once,
    # not again at every level, and they freed it all before it ended.
    deeper = 9 * 4096 + 17 * 512
    assert rows(lp, descend, (*EXACT[:1], *RECORDED[1:], "delta")) == [
        ("def descend(n):", 10, 0, 0, 0),
        ("page = torch.empty(4096, dtype=U8)", 10, 10 * 4096, 0, 10 * 4096),
        ("tag = torch.empty(512, dtype=U8)", 10, 10 * 512, 0, 10 * 512),
        ("if n:", 10, 0, 0, 0),
        ("descend(n - 1)", 9, deeper, deeper, 0),
        ("tag = torch.empty(512, dtype=U8)", 9, 9 * 512, 9 * 512, 0),
        ("return n + page.numel() * 0 + tag.numel() * 0", 10, 0, 0, 0),
    ]
    made_here = [row[2] for row in rows(lp, descend, ("hits", "allocated_bytes.all.allocated"))]
    assert sum(made_here) - deeper == 10 * 4096 + 19 * 512  # every line but the call: each byte once


def ping(n):
    block = torch.empty(1000, dtype=U8)
    if n:
        pong(n - 1)
    return block.numel()


def pong(n):
    block = torch.empty(100, dtype=U8)
    return ping(n) + block.numel()


def test_mutual_recursion_counts_a_deeper_frame_once_in_each_enclosing_line(exact, rows):
    lp = memlab.LineProfiler(ping, pong, columns=RECORDED)
    with lp:
        ping(2)
    # ping(2) > pong(1) > ping(1) > pong(0) > ping(0). ping's call line of ping(2) encloses
    # 100 + 1000 + 100 + 1000 (that of ping(1) is inside it); pong's of pong(1), 1000 + 100 + 1000.
    # Entries at 0, 1100 and 2200 bytes; 3200 at most (three pings and two pongs alive).
    assert rows(lp, ping, EXACT) == [
        ("def ping(n):", 3, 2200, 0, 0),
        ("block = torch.empty(1000, dtype=U8)", 3, 3200, 3000, 0),
        ("if n:", 3, 3200, 0, 0),
        ("pong(n - 1)", 2, 3200, 2200, 2200),
        ("return block.numel()", 3, 3200, 0, 0),
    ]
    assert rows(lp, pong, EXACT) == [
        ("def pong(n):", 2, 2100, 0, 0),
        ("block = torch.empty(100, dtype=U8)", 2, 2200, 200, 0),
        ("return ping(n) + block.numel()", 2, 3200, 2100, 2100),
    ]


def test_recursion_peaks_match_the_true_peak_of_each_interval_at_every_depth(exact, rows):
    # One profile per depth: the rows of depth d must be the hand-computed peaks of that run.
    for depth in range(4):
        lp = memlab.LineProfiler(recurse, columns=("allocated_bytes.all.peak",))
        with lp:
            recurse(depth)
        total = sum(1000 * (k + 1) for k in range(depth + 1))
        deepest_start = total - 1000
        assert rows(lp, recurse, ("hits", "allocated_bytes.all.peak")) == [
            ("def recurse(n):", depth + 1, deepest_start),
            ("block = torch.empty(1000 * (n + 1), dtype=U8)", depth + 1, total),
            ("if n:", depth + 1, total),
            ("recurse(n - 1)", depth or None, total if depth else None),
            ("del block", depth + 1, total),
            ("return n", depth + 1, deepest_start),
        ], depth


def numbers(n):
    for i in range(n):
        block = torch.empty(1000, dtype=U8)
        yield i
        del block


def test_a_generator_keeps_its_state_across_yields_and_excludes_the_consumer(exact, rows):
    lp = memlab.LineProfiler(numbers, columns=RECORDED)
    kept = []
    with lp:
        for _ in numbers(2):
            kept.append(torch.empty(500, dtype=U8))  # the consumer, not the generator
    assert rows(lp, numbers, EXACT) == [
        ("def numbers(n):", 1, 0, 0, 0),
        ("for i in range(n):", 3, 1000, 0, 0),
        ("block = torch.empty(1000, dtype=U8)", 2, 1500, 2000, 0),
        ("yield i", 2, 2000, 0, 0),
        ("del block", 2, 2000, 0, 2000),
    ]


class Small:
    size = 1000

    def make(self):
        return torch.empty(self.size, dtype=U8)


class Large:
    size = 5000

    def make(self):
        return torch.empty(self.size, dtype=U8)


def test_methods_with_identical_bodies_in_two_classes_have_separate_rows(exact, rows):
    lp = memlab.LineProfiler(Small.make, Large.make, columns=RECORDED)
    with lp:
        Small().make()
        Small().make()
        Large().make()
    assert rows(lp, Small.make, EXACT) == [
        ("def make(self):", 2, 0, 0, 0),
        ("return torch.empty(self.size, dtype=U8)", 2, 1000, 2000, 0),
    ]
    assert rows(lp, Large.make, EXACT) == [
        ("def make(self):", 1, 0, 0, 0),
        ("return torch.empty(self.size, dtype=U8)", 1, 5000, 5000, 0),
    ]
    text = repr(lp.display(columns=RECORDED))
    assert "## Small.make" in text and "## Large.make" in text


async def fetch(n):
    block = torch.empty(n, dtype=U8)
    await asyncio.sleep(0)
    return block.numel()


async def gather_two():
    return await asyncio.gather(fetch(1000), fetch(3000))


def test_interleaved_coroutines_keep_separate_frame_state(exact, rows):
    lp = memlab.LineProfiler(fetch, columns=RECORDED)
    with lp:
        assert asyncio.run(gather_two()) == [1000, 3000]
    # The second coroutine starts while the first one's block is alive, and both blocks are
    # alive while either sleeps. Locals are released after the frame returns: no line frees them.
    assert rows(lp, fetch, EXACT) == [
        ("async def fetch(n):", 2, 1000, 0, 0),
        ("block = torch.empty(n, dtype=U8)", 2, 4000, 4000, 0),
        ("await asyncio.sleep(0)", 2, 4000, 0, 0),
        ("return block.numel()", 2, 4000, 0, 0),
    ]


def test_records_stay_one_row_per_line_however_many_events(exact):
    lp = memlab.LineProfiler(loop)
    with lp:
        loop(10_000)
    record = lp._records.functions[loop.__code__]
    assert sorted(record.rows) == [
        0,
        *range(loop.__code__.co_firstlineno + 1, loop.__code__.co_firstlineno + 6),
    ]
    assert all(len(row) == len(record.rows[0]) for row in record.rows.values())


def test_a_profile_every_function_inside_a_profiler_keeps_that_profilers_peaks(global_profiler, capsys):
    @memlab.profile_every(1)
    def layer():
        torch.nn.Linear(100, 100)  # made and freed within the line: only a window peak sees it

    def model():
        first = torch.nn.Linear(100, 100)  # noqa: F841
        second = torch.nn.Linear(100, 100)  # noqa: F841
        layer()

    lp = memlab.LineProfiler(model, layer)
    with lp:
        model()
    # the decorators' profiler samples the same tracker at every line of layer(); its windows must
    # not eat the peaks of lp's own window (the 40.00K of layer()'s Linear inside model's last line)
    assert [row[1] for row in lp.to_dataframe(model).itertuples(index=False)] == [
        0,
        40 * 1024,
        80 * 1024,
        120 * 1024,
    ]
    assert [row[1] for row in lp.to_dataframe(layer).itertuples(index=False)][-2:] == [80 * 1024, 120 * 1024]
    report = capsys.readouterr().out.splitlines()  # profile_every's own report, from the same tracker
    assert [line.split()[0] for line in report[-3:-1]] == ["80.00K", "120.00K"]


def one_line(): return torch.empty(1024, 1024)  # fmt: skip


def test_a_one_line_function_shows_its_body_on_the_def_line(exact, rows):
    lp = memlab.LineProfiler(one_line, columns=RECORDED)
    with lp:
        made = one_line()
    assert rows(lp, one_line, EXACT) == [
        ("def one_line(): return torch.empty(1024, 1024)  # fmt: skip", 1, 4 << 20, 4 << 20, 0),
    ]
    assert made.shape == (1024, 1024)


def test_tensors_alive_before_profiling_are_in_the_def_row_as_on_a_gpu():
    gc.collect()  # garbage of earlier tests would be adopted too, as a GPU would still hold it
    with torch.device("meta"):
        layer = torch.nn.Linear(100, 100)

    def grow(batch=None):
        return torch.empty(1000, dtype=U8, device="meta")

    lp = memlab.LineProfiler(grow, target_gpu="meta", columns=("active_bytes.all.peak",))
    with lp:
        kept = grow()
    assert lp.source_line() == (
        "modelled: CUDA caching allocator replayed from meta tensors (memlab.TensorTracker); "
        "2 tensor storages (40.00K) existed before profiling"
    )
    # the layer: 40 448 B + 512 B; then grow's 1000 B as a 1 KiB block
    assert [row[1] for row in lp.to_dataframe(grow).itertuples(index=False)] == [40_960, 40_960 + 1024]
    batch = torch.empty(2048, dtype=U8, device="meta")  # made between calls and passed to the next
    with lp:
        grow(batch)
    assert lp.source_line().endswith("existed before profiling, 1 more was adopted at later calls")
    peaks = [row[1] for row in lp.to_dataframe(grow).itertuples(index=False)]
    assert peaks == [40_960 + 1024 + 2048, 40_960 + 1024 + 2048 + 1024]
    del layer, kept, batch


held_by_a_global = None


def uses_what_it_reaches(batch):
    return batch.numel()


def test_a_later_call_adopts_what_globals_and_callers_locals_hold():
    global held_by_a_global
    gc.collect()
    lp = memlab.LineProfiler(
        uses_what_it_reaches, target_gpu="meta", columns=("allocated_bytes.all.current",)
    )
    batch = torch.empty(1000, dtype=U8, device="meta")
    with lp:
        uses_what_it_reaches(batch)
    at_first_call = lp.to_dataframe(uses_what_it_reaches).iloc[0, 1]
    # Made between the calls: one held only by this module's global, one by this (calling) frame.
    held_by_a_global = torch.empty(1 << 20, dtype=U8, device="meta")
    held_by_the_caller = torch.empty(2048, dtype=U8, device="meta")
    with lp:
        uses_what_it_reaches(batch)
    assert lp.to_dataframe(uses_what_it_reaches).iloc[0, 1] - at_first_call == (1 << 20) + 2048
    assert lp.source_line().endswith(", 2 more were adopted at later calls")
    held_by_a_global = None
    del held_by_the_caller
