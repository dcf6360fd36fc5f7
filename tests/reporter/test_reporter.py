"""MemReporter finds and names tensors: parameters, gradients, buffers, optimizer state, others by number."""

from __future__ import annotations

import gc
import io
import re
import weakref

import pytest
import torch
from torch import nn

from memlab import MemReporter
from tests.reporter.reading import RULE, TiedLM, fresh_report, named_rows, report_text


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
    script = """
        import torch
        from memlab import MemReporter
        model = torch.nn.Linear(1024, 1024)
        model(torch.ones(1, 1024)).sum().backward()
        MemReporter(model).report()
    """
    assert fresh_report(script) == [
        "Element type                                            Size  Used MEM",
        RULE,
        "Storage on cpu",
        "weight                                          (1024, 1024)     4.00M",
        "weight.grad                                     (1024, 1024)     4.00M",
        "bias                                                 (1024,)     4.00K",
        "bias.grad                                            (1024,)     4.00K",
        RULE,
        "Total Tensors: 2099200  Used Memory: 8.01M",
        RULE,
        "sizes: storage bytes found through gc (memlab.MemReporter)",
    ]


def test_tied_weights_appear_once_with_a_joined_name():
    model = TiedLM()
    assert named_rows(report_text(MemReporter(model))) == [("embed.weight+head.weight", "(100, 16)", "6.25K")]


def test_adamw_state_is_named_and_totals_twice_the_parameter_bytes():
    model = nn.Sequential(nn.Linear(64, 32))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(4, 64)).sum().backward()
    optimizer.step()
    reporter = MemReporter(model, pre_collect=True)
    reporter.add_optimizer(optimizer)
    frame = reporter.to_dataframe(device="cpu")
    state = frame[frame["category"] == "optimizer_state"]
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
    state = frame[frame["category"] == "optimizer_state"]
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
    assert set(frame["category"]) <= {"parameter", "gradient", "buffer", "optimizer_state", "unknown"}
    mine = frame[frame["storage_bytes"] == 20]
    assert "unknown" in set(mine["category"])
    del other


def test_a_weak_proxy_in_gc_does_not_crash_or_count_twice():
    kept = torch.ones(300)
    doomed = torch.ones(7)
    holder = [weakref.proxy(kept), weakref.proxy(doomed)]
    del doomed
    gc.collect()
    frame = MemReporter().to_dataframe(verbose=True)
    assert list(frame[frame["storage_bytes"] == 1200]["memory"]) == [1200]
    assert len(holder) == 2


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


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_device_model_cuda_counts_a_linear_layer_as_a_gpu_would(device: str):
    model = nn.Linear(100, 100, device=device)
    frame = MemReporter(model, device_model="cuda").to_dataframe(device=device)
    named = frame[frame["name"].isin(["weight", "bias"])]
    assert list(named["storage_bytes"]) == [40_000, 400]
    assert list(named["memory"]) == [40_448, 512]
    assert named["memory"].sum() == 40_960
    exact = MemReporter(model).to_dataframe(device=device)
    assert list(exact[exact["name"].isin(["weight", "bias"])]["memory"]) == [40_000, 400]


def test_device_model_cuda_matches_the_tracker_modelling_the_cuda_allocator_in_a_fresh_interpreter():
    script = """
        import torch, memlab
        with memlab.TensorTracker(allocator="cuda"):
            model = torch.nn.Linear(100, 100)
            loss = model(torch.ones(1, 100)).sum().detach()
            memlab.MemReporter(model, device_model="cuda").report()
    """
    assert fresh_report(script) == [
        "Element type                                            Size  Used MEM",
        RULE,
        "Storage on cpu",
        "weight                                            (100, 100)    39.50K",
        "bias                                                  (100,)   512.00B",
        "Tensor0                                                   ()   512.00B",
        RULE,
        "Total Tensors: 10101  Used Memory: 40.50K",
        # and the 32 MiB cuBLAS workspace of the modelled H100, which the matmul allocated
        "The allocated memory on cpu: 32.04M",
        "TensorTracker reports 32.00M more than the tensors above: memory gc cannot see (autograd's saved "
        "tensors, C++-held buffers, kernel workspaces) or allocator blocks larger than the requests",
        RULE,
        "sizes: as the CUDA caching allocator would round them (modelled from cpu tensors)",
    ]


def test_device_model_accepts_only_none_or_cuda():
    valid = r"None \(each device's own sizes\) or 'cuda' \(sizes as the CUDA caching allocator rounds them\)"
    with pytest.raises(ValueError, match=rf"^device_model must be {valid}; got 'cpu'$"):
        MemReporter(device_model="cpu")
    with pytest.raises(TypeError, match=rf"^device_model must be {valid}; got device device\(type='cuda'\)$"):
        MemReporter(device_model=torch.device("cuda"))
    assert MemReporter(device_model="cuda").device_model == "cuda"
    assert MemReporter().device_model is None
