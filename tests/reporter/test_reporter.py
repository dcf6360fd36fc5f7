"""MemReporter: every tensor named once per storage, exact bytes on CPU and meta, snapshots and diffs."""

from __future__ import annotations

import gc
import io
import re
import subprocess
import sys
import textwrap
import weakref

import pandas as pd
import pytest
import torch
from torch import nn

from memlab import MemReporter
from memlab.reporter.records import cuda_block_bytes
from memlab.sources.tracker import TensorTracker

_ROW = re.compile(r"^(?P<name>\S+)\s+(?P<size>\(.*?\)|\?)\s+(?P<mem>\S+)$")


def report_text(reporter: MemReporter, **kwargs) -> str:
    stream = io.StringIO()
    reporter.report(stream=stream, **kwargs)
    return stream.getvalue()


def rows(text: str, device: str = "cpu") -> list[tuple[str, str, str]]:
    """(name, size, used memory) of each row in the ``Storage on <device>`` block."""
    lines = text.splitlines()
    start = lines.index(f"Storage on {device}") + 1
    block = []
    for line in lines[start:]:
        if line.startswith("---"):
            break
        match = _ROW.match(line)
        assert match, line
        block.append((match["name"], match["size"], match["mem"]))
    return block


def named_rows(text: str, device: str = "cpu") -> list[tuple[str, str, str]]:
    """Rows of the block except anonymous tensors (other tests may leave some alive)."""
    return [row for row in rows(text, device) if not re.match(r"[A-Za-z]*Tensor\d+|Parameter\d+", row[0])]


def test_linear_rows_are_weight_and_bias_with_exact_sizes():
    model = nn.Linear(1024, 1024)
    text = report_text(MemReporter(model))
    assert text.splitlines()[0].split() == ["Element", "type", "Size", "Used", "MEM"]
    assert named_rows(text) == [("weight", "(1024, 1024)", "4.00M"), ("bias", "(1024,)", "4.00K")]


def test_gradients_are_listed_once_after_backward_even_when_held_by_the_caller():
    model = nn.Linear(1024, 1024)
    model(torch.ones(2, 1024)).sum().backward()
    held_grad = model.weight.grad  # now also a Python object gc can reach
    text = report_text(MemReporter(model))
    assert named_rows(text) == [
        ("weight", "(1024, 1024)", "4.00M"),
        ("weight.grad", "(1024, 1024)", "4.00M"),
        ("bias", "(1024,)", "4.00K"),
        ("bias.grad", "(1024,)", "4.00K"),
    ]
    assert held_grad is model.weight.grad


def test_full_report_layout_in_a_fresh_interpreter():
    script = textwrap.dedent(
        """
        import torch
        from memlab import MemReporter
        model = torch.nn.Linear(1024, 1024)
        model(torch.ones(1, 1024)).sum().backward()
        MemReporter(model).report()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    rule = "-" * 79
    assert out.splitlines() == [
        "Element type                                            Size  Used MEM",
        rule,
        "Storage on cpu",
        "weight                                          (1024, 1024)     4.00M",
        "weight.grad                                     (1024, 1024)     4.00M",
        "bias                                                 (1024,)     4.00K",
        "bias.grad                                            (1024,)     4.00K",
        rule,
        "Total Tensors: 2099200  Used Memory: 8.01M",
        rule,
    ]


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_appear_once_with_a_joined_name():
    model = TiedLM()
    assert named_rows(report_text(MemReporter(model))) == [("embed.weight+head.weight", "(100, 16)", "6.25K")]


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


def test_adamw_state_is_named_and_totals_twice_the_parameter_bytes():
    model = nn.Sequential(nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(4, 64)).sum().backward()
    optimizer.step()
    reporter = MemReporter(model, pre_collect=True)
    reporter.add_optimizer(optimizer)
    frame = reporter.to_dataframe(device="cpu")
    state = frame[frame["category"] == "optimizer state"]
    assert list(state["name"]) == [
        "AdamW.0.weight.step",
        "AdamW.0.weight.exp_avg",
        "AdamW.0.weight.exp_avg_sq",
        "AdamW.0.bias.step",
        "AdamW.0.bias.exp_avg",
        "AdamW.0.bias.exp_avg_sq",
    ]
    parameter_bytes = frame[frame["name"].isin(["0.weight", "0.bias"])]["memory"].sum()
    assert parameter_bytes == 64 * 32 * 4 + 32 * 4 == 8320
    moments = state[state["name"].str.contains("exp_avg")]["memory"].sum()
    assert moments == 2 * parameter_bytes
    # the per-parameter step counters are 0-dim float32 tensors: 4 B each on top
    assert state["memory"].sum() == 2 * parameter_bytes + 2 * 4
    grads = frame[frame["name"].str.startswith("0.")]
    assert list(grads["name"]) == ["0.weight", "0.weight.grad", "0.bias", "0.bias.grad"]
    assert list(grads["category"]) == ["parameter", "gradient", "parameter", "gradient"]


def test_optimizer_state_without_a_model_is_named_by_parameter_index():
    weight = nn.Parameter(torch.ones(8, 8))
    bias = nn.Parameter(torch.ones(8))
    optimizer = torch.optim.AdamW([weight, bias])
    (weight.sum() + bias.sum()).backward()
    optimizer.step()
    reporter = MemReporter(pre_collect=True)
    reporter.add_optimizer(optimizer)
    frame = reporter.to_dataframe()
    state = frame[frame["category"] == "optimizer state"]
    assert list(state["name"]) == [
        f"AdamW.{i}.{k}" for i in (0, 1) for k in ("step", "exp_avg", "exp_avg_sq")
    ]
    assert list(state["memory"]) == [4, 256, 256, 4, 32, 32]
    grads = frame[frame["category"] == "gradient"]
    assert list(grads["memory"]) == [256, 32]
    assert all(re.fullmatch(r"Parameter\d+\.grad", n) for n in grads["name"])


def test_categories_cover_parameters_buffers_gradients_state_and_others():
    model = nn.BatchNorm1d(4)
    model(torch.ones(3, 4)).sum().backward()
    other = torch.zeros(5)
    frame = MemReporter(model).to_dataframe()
    by_name = dict(zip(frame["name"], frame["category"], strict=True))
    assert by_name["weight"] == "parameter" and by_name["bias"] == "parameter"
    assert by_name["weight.grad"] == "gradient"
    assert by_name["running_mean"] == by_name["running_var"] == by_name["num_batches_tracked"] == "buffer"
    assert set(frame["category"]) <= {"parameter", "gradient", "buffer", "optimizer state", "other"}
    mine = frame[frame["storage_bytes"] == 20]
    assert "other" in set(mine["category"])
    del other


def test_meta_tensors_are_not_reported_as_sharing_storage():
    first = torch.empty(1000, device="meta")
    second = torch.empty(250, device="meta")
    assert first.data_ptr() == second.data_ptr() == 0
    frame = MemReporter().to_dataframe(verbose=True, device="meta")
    mine = frame[frame["storage_bytes"].isin([4000, 1000])]
    assert sorted(mine["memory"]) == [1000, 4000]
    assert mine["shares_with"].isna().all()
    del first, second


def test_a_weak_proxy_in_gc_does_not_crash_or_count_twice():
    kept = torch.ones(300)
    doomed = torch.ones(7)
    holder = [weakref.proxy(kept), weakref.proxy(doomed)]
    del doomed
    gc.collect()
    frame = MemReporter().to_dataframe(verbose=True)
    assert list(frame[frame["storage_bytes"] == 1200]["memory"]) == [1200]
    assert len(holder) == 2


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


def test_no_reference_to_any_tensor_is_kept_after_report():
    model = nn.Linear(8, 8)
    loose = torch.ones(1000)
    refs = [weakref.ref(loose), weakref.ref(model.weight)]
    reporter = MemReporter(model)
    reporter.report(stream=io.StringIO(), verbose=True)
    snapshot = reporter.snapshot()
    del loose, model
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    assert snapshot.records  # the snapshot is plain data


def test_anonymous_tensors_keep_their_number_while_they_live():
    reporter = MemReporter()
    first = torch.ones(123)
    name = lambda: [n for n, b in zip(*_name_bytes(reporter), strict=True) if b == 492]  # noqa: E731
    before = name()
    second = torch.ones(123)
    after = name()
    assert len(before) == 1 and len(after) == 2 and before[0] in after
    assert int(after[1].removeprefix("Tensor")) > int(before[0].removeprefix("Tensor"))
    del first, second


def _name_bytes(reporter: MemReporter) -> tuple[list[str], list[int]]:
    frame = reporter.to_dataframe()
    return list(frame["name"]), list(frame["storage_bytes"])


def test_pre_collect_drops_tensors_kept_only_by_unreachable_cycles():
    gc.collect()
    gc.disable()
    try:
        cycle: list = [torch.ones(777)]
        cycle.append(cycle)
        del cycle
        assert 3108 in _name_bytes(MemReporter())[1]
        assert 3108 not in _name_bytes(MemReporter(pre_collect=True))[1]
    finally:
        gc.enable()


def _training_step(model: nn.Module, optimizer: torch.optim.Optimizer, leaked: list | None) -> None:
    optimizer.zero_grad(set_to_none=True)
    out = model(torch.ones(8, 16))
    out.pow(2).mean().backward()
    optimizer.step()
    if leaked is not None:
        leaked.append(out.detach())


def test_snapshot_diff_over_one_leaking_step_names_exactly_the_leaked_tensor():
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    reporter = MemReporter(model, pre_collect=True)
    reporter.add_optimizer(optimizer)
    leaked: list[torch.Tensor] = []
    _training_step(model, optimizer, None)  # gradients and optimizer state now exist
    before = reporter.snapshot()
    _training_step(model, optimizer, leaked)
    diff = reporter.diff(before)
    assert len(diff.entries) == 1
    entry = diff.appeared[0]
    assert (entry.device, entry.category, entry.shape, entry.before, entry.after) == (
        "cpu",
        "other",
        (8, 4),
        0,
        128,
    )
    assert re.fullmatch(r"Tensor\d+", entry.name)
    assert diff.disappeared == diff.grew == diff.shrank == []
    text = str(diff)
    assert re.search(rf"^appeared\s+{entry.name}\s+\(8, 4\)\s+0\.00B\s+128\.00B\s+\+128\.00B$", text, re.M)
    assert (
        text.splitlines()[-1]
        == "Appeared: 1  Disappeared: 0  Grew: 0  Shrank: 0  Used Memory change: +128.00B"
    )
    after = reporter.snapshot()
    leaked.clear()
    gone = reporter.diff(after)
    assert [(e.change, e.name, e.delta) for e in gone.entries] == [("disappeared", entry.name, -128)]


def test_snapshot_diff_reports_growth_of_the_same_tensor():
    buffer = torch.zeros(10)
    reporter = MemReporter(pre_collect=True)
    before = reporter.snapshot()
    buffer.resize_(1000)
    diff = reporter.diff(before)
    assert [(e.change, e.before, e.after, e.delta) for e in diff.entries] == [("grew", 40, 4000, 3960)]
    frame = diff.to_dataframe()
    assert list(frame.columns) == [
        "change",
        "device",
        "name",
        "category",
        "shape",
        "before",
        "after",
        "delta",
    ]
    assert list(frame["shape"]) == [(1000,)]


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


def test_device_filter_reports_only_that_device():
    on_meta = torch.empty(64, device="meta")
    on_cpu = torch.ones(64)
    reporter = MemReporter()
    meta_only = report_text(reporter, device="meta")
    assert "Storage on meta" in meta_only and "Storage on cpu" not in meta_only
    cpu_only = report_text(reporter, device=torch.device("cpu"))
    assert "Storage on cpu" in cpu_only and "Storage on meta" not in cpu_only
    assert set(reporter.to_dataframe(device="meta")["device"]) == {"meta"}
    del on_meta, on_cpu


def test_a_device_without_tensors_says_so():
    model = torch.nn.Linear(2, 2)
    text = report_text(MemReporter(model), device="meta")
    rule = "-" * 79
    assert text == f"Element type{'Size':>48}  Used MEM\n{rule}\nNo tensors on meta\n{rule}\n"


def test_verbose_view_of_a_tied_weight_names_the_joined_owner():
    model = TiedLM()
    row = model.head.weight[0]
    verbose = rows(report_text(MemReporter(model), verbose=True))
    sharing = [r for r in verbose if r[0].endswith("(->embed.weight+head.weight)")]
    assert len(sharing) == 1 and sharing[0][1:] == ("(16,)", "0.00B")
    del row


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


def test_bad_input_gets_typed_errors_listing_what_is_valid():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module or None, got int"):
        MemReporter(model=3)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer .*got dict"):
        MemReporter().add_optimizer({"lr": 1})
    forms = r"'cpu', 'meta', 'cuda', 'cuda:1', a CUDA index \(0, 1, \.\.\.\) or a torch\.device"
    with pytest.raises(ValueError, match=rf"^device 'gpu' is not a device; valid: {forms}$"):
        MemReporter().report(device="gpu", stream=io.StringIO())
    with pytest.raises(TypeError, match=rf"^device must be {forms}; got float 1\.5$"):
        MemReporter().to_dataframe(device=1.5)
    with pytest.raises(TypeError, match=r"source must have a memory_allocated\(device\) method"):
        MemReporter().report(source=object(), stream=io.StringIO())


@pytest.mark.cuda
def test_cuda_rows_round_to_allocator_blocks_and_show_allocated_memory():
    model = nn.Linear(100, 100, device="cuda")
    text = report_text(MemReporter(model), device="cuda")
    assert named_rows(text, "cuda:0") == [("weight", "(100, 100)", "39.50K"), ("bias", "(100,)", "512.00B")]
    assert any(line.startswith("The allocated memory on cuda:0: ") for line in text.splitlines())
