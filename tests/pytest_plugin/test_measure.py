"""One call measured in this process (no pytest run inside): peaks, leftovers and their sites."""

from __future__ import annotations

import torch

from memlab.pytest_plugin.marks import LeakLimit, MemoryLimit, check_leaks, check_memory
from memlab.pytest_plugin.measure import Measurement, measured

MiB = 1024 * 1024


def seven_lines() -> list[torch.Tensor]:
    a = torch.empty(7 * MiB // 4)
    b = torch.empty(6 * MiB // 4)
    c = torch.empty(5 * MiB // 4)
    d = torch.empty(4 * MiB // 4)
    e = torch.empty(3 * MiB // 4)
    f = torch.empty(2 * MiB // 4)
    g = torch.empty(1 * MiB // 4)
    return [a, b, c, d, e, f, g]


def test_the_sites_at_the_peak_add_up_to_the_peak():
    with measured() as measurement:
        kept = seven_lines()
        del kept
    assert (measurement.allocated_peak, measurement.leaked, measurement.device) == (28 * MiB, 0, "cpu")
    sites = measurement.peak_sites("allocated")
    assert [(s.line, s.nbytes, s.tensors) for s in sites] == [(14 + i, (7 - i) * MiB, 1) for i in range(7)]
    assert sum(s.nbytes for s in sites) == measurement.allocated_peak
    assert sites[0].where() == f"{__file__}:14"
    assert sites[0].code() == "a = torch.empty(7 * MiB // 4)"


def test_a_failure_names_five_sites_and_sums_up_the_rest():
    with measured() as measurement:
        kept = seven_lines()
    message = check_memory(MemoryLimit(MiB), measurement, root=__file__.rsplit("/", 1)[0])
    assert message.splitlines() == [
        "Test was limited to 1.00M of allocated tensor memory but peaked at 28.00M on cpu",
        "Allocations held at the peak, most bytes first:",
        "      7.00M in 1 tensor   test_measure.py:14  a = torch.empty(7 * MiB // 4)",
        "      6.00M in 1 tensor   test_measure.py:15  b = torch.empty(6 * MiB // 4)",
        "      5.00M in 1 tensor   test_measure.py:16  c = torch.empty(5 * MiB // 4)",
        "      4.00M in 1 tensor   test_measure.py:17  d = torch.empty(4 * MiB // 4)",
        "      3.00M in 1 tensor   test_measure.py:18  e = torch.empty(3 * MiB // 4)",
        "      3.00M at 2 more sites",
    ]
    assert check_memory(MemoryLimit(28 * MiB), measurement) is None
    assert len(kept) == 7


def test_leftovers_are_what_the_call_made_and_did_not_free():
    before = torch.empty(MiB)  # made before: never counted
    with measured(leaks=True) as measurement:
        kept = torch.empty(MiB // 4)
        torch.empty(MiB)  # freed at once
    assert (measurement.allocated_peak, measurement.leaked) == (5 * MiB, MiB)
    assert [(s.line, s.nbytes) for s in measurement.leak_sites()] == [(57, MiB)]
    assert before.numel() + kept.numel() == MiB + MiB // 4


def test_without_history_there_are_no_sites():
    with measured(history=False) as measurement:
        torch.empty(256)
    assert (measurement.allocated_peak, measurement.reserved_peak) == (1024, 2 * MiB)
    assert measurement.peak_sites("allocated") == [] and measurement.snapshot is None
    assert Measurement().peak("reserved") == 0


def test_a_peak_just_over_the_limit_reads_different_from_it():
    with measured(history=False) as measurement:
        kept = torch.empty((MiB + 4096) // 4)
    assert check_memory(MemoryLimit(MiB), measurement) == (
        "Test was limited to 1.00M (1,048,576 B) of allocated tensor memory but peaked at "
        "1.00M (1,052,672 B) on cpu\n(no allocation sites held at the peak were recorded)"
    )
    assert check_leaks(LeakLimit(MiB), measurement).splitlines()[0] == (
        "Test was limited to 1.00M (1,048,576 B) of leaked tensor memory but 1.00M (1,052,672 B) "
        "was still allocated at its end on cpu"
    )
    assert kept.numel() == (MiB + 4096) // 4
