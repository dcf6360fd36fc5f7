"""Records: each storage counted once under its first tensor, sparse and wrapper tensors by their parts."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
from torch import nn

from memlab import MemReporter
from memlab.reporter.records import RecordBuilder, build_records, cuda_block_bytes
from tests.reporter.reading import TiedLM, named_rows, report_text, rows


def test_verbose_shows_a_view_of_a_parameter_as_sharing_with_zero_bytes():
    model = nn.Linear(1024, 1024)
    view = model.weight[3]
    reporter = MemReporter(model)
    verbose = [row for row in rows(report_text(reporter, verbose=True)) if row[0].endswith("(->weight)")]
    assert len(verbose) == 1
    assert re.fullmatch(r"Tensor\d+\(->weight\)", verbose[0][0])
    assert verbose[0][1:] == ("(1024,)", "0.00B")
    terse = rows(report_text(reporter))
    assert not [row for row in terse if row[0] == verbose[0][0].removesuffix("(->weight)")]
    frame = reporter.to_dataframe(verbose=True)
    shared = frame[frame["shares_with"] == "weight"]
    assert list(shared["memory"]) == [0] and list(shared["storage_bytes"]) == [4 * 1024 * 1024]
    assert view.untyped_storage() is model.weight.untyped_storage()


def test_verbose_view_of_a_tied_weight_names_the_joined_owner():
    model = TiedLM()
    row = model.head.weight[0]
    verbose = rows(report_text(MemReporter(model), verbose=True))
    sharing = [r for r in verbose if r[0].endswith("(->embed.weight+head.weight)")]
    assert len(sharing) == 1 and sharing[0][1:] == ("(16,)", "0.00B")
    del row


def test_meta_tensors_are_not_reported_as_sharing_storage():
    first = torch.empty(1000, device="meta")
    second = torch.empty(250, device="meta")
    assert first.data_ptr() == second.data_ptr() == 0
    frame = MemReporter().to_dataframe(verbose=True, device="meta")
    mine = frame[frame["storage_bytes"].isin([4000, 1000])]
    assert sorted(mine["memory"]) == [1000, 4000]
    assert mine["shares_with"].isna().all()
    del first, second


@pytest.mark.filterwarnings("ignore:Sparse")
def test_sparse_tensors_report_indices_and_values():
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [2, 0, 1]]), torch.ones(3), (3, 3))
    csr = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([0, 1, 2, 3]), torch.ones(4))
    frame = MemReporter().to_dataframe(verbose=True)
    parts = frame[frame["name"].str.contains(r"^Tensor\d+\.(?:indices|values|crow_indices|col_indices)$")]
    got = {
        (name.split(".", 1)[1], shape, nbytes)
        for name, shape, nbytes in parts[["name", "shape", "storage_bytes"]].values
    }
    assert {
        ("indices", (2, 3), 48),
        ("values", (3,), 12),
        ("crow_indices", (5,), 40),
        ("col_indices", (4,), 32),
        ("values", (4,), 16),
    } <= got
    del coo, csr


def test_wrapper_subclasses_are_flattened_to_their_inner_storages():
    from torch.testing._internal.two_tensor import TwoTensor

    pair = TwoTensor(torch.ones(10), torch.zeros(10))
    frame = MemReporter().to_dataframe(verbose=True)
    mine = frame[frame["name"].str.match(r"TwoTensor\d+\.")]
    assert sorted(n.split(".")[1] for n in mine["name"]) == ["a", "b"]
    assert list(mine["storage_bytes"]) == [40, 40]
    # pair.a and pair.b are also tensors gc sees on their own: each storage is counted once
    owners = set(mine["shares_with"])
    counted = frame[frame["name"].isin(owners)]
    assert list(counted["memory"]) == [40, 40] and counted["shares_with"].isna().all()
    assert not frame["name"].str.fullmatch(r"TwoTensor\d+").any()
    del pair


def test_symbolic_sizes_are_listed_but_not_counted():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    fake = mode.from_tensor(torch.ones(3, 4), symbolic_context=context)
    reporter = MemReporter()
    text = report_text(reporter, device="meta")
    fake_rows = [row for row in rows(text, "meta") if row[0].startswith("FakeTensor")]
    assert len(fake_rows) == 1
    assert re.fullmatch(r"\(s\d+, s\d+\)", fake_rows[0][1]) and fake_rows[0][2] == "?"
    assert "tensor(s) of unknown size (symbolic shapes, or no readable storage)" in text
    frame = reporter.to_dataframe(device="meta")
    assert frame[frame["name"].str.startswith("FakeTensor")]["memory"].isna().all()
    del fake


def test_uninitialized_lazy_parameters_are_listed_with_unknown_size():
    model = nn.LazyLinear(4)
    text = report_text(MemReporter(model))
    assert named_rows(text) == [("weight", "?", "?"), ("bias", "?", "?")]
    assert "2 tensor(s) of unknown size (symbolic shapes, or no readable storage)" in text
    frame = MemReporter(model).to_dataframe()
    weight = frame[frame["name"] == "weight"].iloc[0]
    assert weight["category"] == "parameter"
    assert pd.isna(weight["memory"]) and pd.isna(weight["storage_bytes"])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_have_no_single_shape_but_their_bytes_count():
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)])
    frame = MemReporter().to_dataframe()
    mine = frame[frame["shape"].isna() & (frame["storage_bytes"] == 72)]
    assert len(mine) == 1 and list(mine["memory"]) == [72]
    assert any(size == "?" and mem == "72.00B" for _, size, mem in rows(report_text(MemReporter())))
    del nested


def test_cuda_rounding_boundaries():
    assert [cuda_block_bytes(n) for n in (0, 1, 511, 512, 513, 40000, 400)] == [
        0,
        512,
        512,
        512,
        1024,
        40448,
        512,
    ]


def _plain_tensors() -> tuple[list[torch.Tensor], list[str], list[str | None]]:
    """A 0-d fp32 loss, an empty tensor, a 100x100 fp32 weight and a view of it."""
    weight = torch.ones(100, 100)
    tensors = [torch.tensor(1.5), torch.empty(0), weight, weight[3]]
    return tensors, ["loss", "empty", "weight", "row"], ["unknown", "unknown", "parameter", "unknown"]


def test_device_model_cuda_rounds_every_storage_on_the_fast_path():
    tensors, names, categories = _plain_tensors()
    modelled = build_records(tensors, names, categories, dtypes=True, device_model="cuda")
    assert [(r.name, r.storage_bytes, r.memory, r.shares_with) for r in modelled] == [
        ("loss", 4, 512, None),
        ("empty", 0, 0, None),
        ("weight", 40_000, 40_448, None),
        ("row", 40_000, 0, "weight"),
    ]
    exact = build_records(tensors, names, categories, dtypes=True)
    assert [r.memory for r in exact] == [4, 0, 40_000, 0]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_device_model_cuda_rounds_every_storage_in_the_builder(device: str):
    from torch.testing._internal.two_tensor import TwoTensor

    tensors, names, categories = _plain_tensors()
    tensors = [tensor.to(device) for tensor in tensors[:3]]
    pair = TwoTensor(torch.ones(100, device=device), torch.ones(200, device=device).resize_(100))
    builder = RecordBuilder(dtypes=False, device_model="cuda")
    builder.add_plain(zip([*tensors, pair], [*names[:3], "pair"], [*categories[:3], None], strict=True))
    assert [(r.name, r.device, r.storage_bytes, r.memory) for r in builder.records] == [
        ("loss", device, 4, 512),
        ("empty", device, 0, 0),
        ("weight", device, 40_000, 40_448),
        ("pair.a", device, 400, 512),
        ("pair.b", device, 800, 1024),
    ]
