"""TensorSnapshot renders: the text report, its footer lines, DataFrames; plain data holding no tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memlab import MemReporter
from memlab.reporter import TensorRecord, TensorSnapshot
from memlab.reporter.snapshot import sizes_line
from memlab.sources.tracker import TensorTracker
from tests.reporter.reading import RULE, report_text


def test_to_dataframe_columns_and_exact_bytes():
    model = nn.Linear(1024, 1024)
    frame = MemReporter(model).to_dataframe()
    assert list(frame.columns) == [
        "device",
        "name",
        "category",
        "shape",
        "dtype",
        "numel",
        "memory",
        "storage_bytes",
        "shares_with",
    ]
    weight = frame[frame["name"] == "weight"].iloc[0]
    assert (weight["device"], weight["shape"], weight["dtype"], weight["numel"], weight["memory"]) == (
        "cpu",
        (1024, 1024),
        "float32",
        1048576,
        4194304,
    )


class _FixedSource:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def memory_allocated(self, device=None) -> int:
        return self.nbytes


def test_allocated_memory_line_and_explanation_from_a_source():
    model = nn.Linear(1024, 1024, device="meta")
    reporter = MemReporter(model)
    used = reporter.snapshot().used_memory("meta")
    text = report_text(reporter, device="meta", source=_FixedSource(used + 2048))
    lines = text.splitlines()
    assert "The allocated memory on meta: " + _fmt(used + 2048) in lines
    assert (
        "_FixedSource reports 2.00K more than the tensors above: memory gc cannot see "
        "(autograd's saved tensors, C++-held buffers, kernel workspaces) or allocator blocks larger "
        "than the requests"
    ) in lines
    fewer = report_text(reporter, device="meta", source=_FixedSource(used - 1024)).splitlines()
    assert (
        "_FixedSource reports 1.00K less than the tensors above: it does not count storages that "
        "existed before it started or were allocated outside it"
    ) in fewer
    same = report_text(reporter, device="meta", source=_FixedSource(used)).splitlines()
    assert "The allocated memory on meta: " + _fmt(used) in same
    assert not [line for line in same if "reports" in line]


def _fmt(nbytes: int) -> str:
    from memlab._units import format_size

    return format_size(nbytes)


def test_active_tracker_gives_the_allocated_line_for_cpu():
    with TensorTracker(allocator=None) as tracker:
        model = nn.Linear(1024, 1024)
        text = report_text(MemReporter(model), device="cpu")
        assert tracker.memory_allocated("cpu") == 4198400
    assert "The allocated memory on cpu: 4.00M" in text.splitlines()
    assert "Storage on meta" not in text


def test_a_device_without_tensors_says_so():
    model = torch.nn.Linear(2, 2)
    text = report_text(MemReporter(model), device="meta")
    sizes = "sizes: storage bytes found through gc (memlab.MemReporter)"
    assert text == f"Element type{'Size':>48}  Used MEM\n{RULE}\nNo tensors on meta\n{RULE}\n{sizes}\n"


_EXACT = "sizes: storage bytes found through gc (memlab.MemReporter)"


@pytest.mark.parametrize(
    ("device_model", "devices", "line"),
    [
        (None, [], _EXACT),
        (None, ["cpu", "meta"], _EXACT),
        (
            None,
            ["cpu", "cuda:0"],
            "sizes: storage bytes found through gc, in 512 B blocks on cuda (memlab.MemReporter)",
        ),
        (
            "cuda",
            ["cpu"],
            "sizes: as the CUDA caching allocator would round them (modelled from cpu tensors)",
        ),
        (
            "cuda",
            ["meta", "cuda:1", "cpu"],
            "sizes: as the CUDA caching allocator would round them (modelled from cpu and meta tensors)",
        ),
        (
            "cuda",
            ["cuda:0", "cuda:1"],
            "sizes: as the CUDA caching allocator rounds them (memlab.MemReporter)",
        ),
    ],
)
def test_sizes_line_says_where_the_numbers_come_from(device_model, devices, line):
    assert sizes_line(device_model, devices) == line


def _modelled_linear() -> TensorSnapshot:
    return TensorSnapshot(
        (
            TensorRecord("weight", "parameter", "meta", (100, 100), "float32", 40_000, 40_448),
            TensorRecord("bias", "parameter", "meta", (100,), "float32", 400, 512),
            TensorRecord("Tensor0", "unknown", "meta", (100,), "float32", 40_000, 0, "weight"),
        ),
        device_model="cuda",
    )


def test_a_snapshot_renders_from_plain_data_with_its_sizes_line():
    assert _modelled_linear().render().splitlines() == [
        "Element type                                            Size  Used MEM",
        RULE,
        "Storage on meta",
        "weight                                            (100, 100)    39.50K",
        "bias                                                  (100,)   512.00B",
        RULE,
        "Total Tensors: 10100  Used Memory: 40.00K",
        RULE,
        "sizes: as the CUDA caching allocator would round them (modelled from meta tensors)",
    ]
    assert _modelled_linear().used_memory("meta") == 40_960


def test_the_dataframe_carries_the_sizes_line():
    frame = _modelled_linear().to_dataframe(verbose=True)
    assert list(frame["memory"]) == [40_448, 512, 0]
    assert (
        frame.attrs["sizes"]
        == "sizes: as the CUDA caching allocator would round them (modelled from meta tensors)"
    )


def test_device_arguments_select_records_as_everywhere_in_memlab():
    record = TensorRecord("x", "unknown", "cuda:0", (1,), "float32", 4, 512)
    snapshot = TensorSnapshot(
        (
            record,
            record._replace(name="y", device="cuda:1", storage_bytes=1024, memory=1024),
            record._replace(name="z", device="cpu", memory=4),
        )
    )
    assert [r.name for r in snapshot.select("cuda")] == ["x", "y"]
    assert [r.name for r in snapshot.select(1)] == ["y"]
    assert [r.name for r in snapshot.select(torch.device("cpu"))] == ["z"]
    assert (snapshot.used_memory("cuda"), snapshot.used_memory("cuda:0"), snapshot.used_memory(0)) == (
        1536,
        512,
        512,
    )
    text = snapshot.render(device="cuda")
    assert "Storage on cuda:0" in text and "Storage on cuda:1" in text and "Storage on cpu" not in text
    assert (
        text.splitlines()[-1]
        == "sizes: storage bytes found through gc, in 512 B blocks on cuda (memlab.MemReporter)"
    )
    with pytest.raises(ValueError, match=r"^device 'gpu' is not a device; valid: 'cpu', 'meta'"):
        snapshot.select("gpu")
