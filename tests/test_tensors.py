"""memlab._tensors: the tensors gc can reach, the ones behind them (.grad, ._base) and their storages."""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import memlab
from memlab._tensors import (
    SPARSE_PARTS,
    call_roots,
    live_storages,
    live_tensors,
    on_device,
    parts,
    reachable_tensors,
    storages_of,
    tensor_classes,
    tensors_within,
)


def _holds(tensors: list[torch.Tensor], wanted: torch.Tensor) -> int:
    """How many times the very object ``wanted`` is in ``tensors``."""
    return sum(tensor is wanted for tensor in tensors)


@pytest.mark.filterwarnings("ignore:Sparse")
@pytest.mark.parametrize(
    ("layout", "names", "nbytes"),
    [  # int64 indices; two float32 values (as 1x1 blocks for bsr / bsc)
        (torch.sparse_coo, ["m.indices", "m.values"], [32, 8]),
        (torch.sparse_csr, ["m.crow_indices", "m.col_indices", "m.values"], [24, 16, 8]),
        (torch.sparse_csc, ["m.ccol_indices", "m.row_indices", "m.values"], [24, 16, 8]),
        (torch.sparse_bsr, ["m.crow_indices", "m.col_indices", "m.values"], [24, 16, 8]),
        (torch.sparse_bsc, ["m.ccol_indices", "m.row_indices", "m.values"], [24, 16, 8]),
    ],
)
def test_sparse_layouts_are_their_index_and_value_tensors(
    layout: torch.layout, names: list[str], nbytes: list[int]
):
    pointers, indices, values = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([1.0, 2.0])
    sparse = {
        torch.sparse_coo: lambda: torch.sparse_coo_tensor(torch.stack([indices, indices]), values, (2, 2)),
        torch.sparse_csr: lambda: torch.sparse_csr_tensor(pointers, indices, values, (2, 2)),
        torch.sparse_csc: lambda: torch.sparse_csc_tensor(pointers, indices, values, (2, 2)),
        torch.sparse_bsr: lambda: torch.sparse_bsr_tensor(pointers, indices, values.view(2, 1, 1), (2, 2)),
        torch.sparse_bsc: lambda: torch.sparse_bsc_tensor(pointers, indices, values.view(2, 1, 1), (2, 2)),
    }[layout]()
    assert sparse.layout is layout
    found = list(parts(sparse, "m"))
    assert [name for _, name in found] == names
    assert len(SPARSE_PARTS[layout]) == len(names)
    assert [part.layout for part, _ in found] == [torch.strided] * len(names)
    assert found[-1][0].reshape(-1).tolist() == [1.0, 2.0]
    assert [storage.nbytes() for storage in storages_of(sparse)] == nbytes


def test_a_dense_tensor_is_its_own_part_and_has_its_own_storage():
    tensor = torch.ones(5)
    assert [(part is tensor, name) for part, name in parts(tensor, "x")] == [(True, "x")]
    (storage,) = storages_of(tensor)
    assert storage is tensor.untyped_storage() and storage.nbytes() == 20


def test_wrapper_subclasses_flatten_to_their_inner_tensors_recursively():
    a, b, c = torch.ones(4), torch.zeros(4), torch.full((4,), 2.0)
    inner = TwoTensor(b, c)
    outer = TwoTensor(a, inner)
    found = list(parts(outer, "w"))
    assert [name for _, name in found] == ["w.a", "w.b.a", "w.b.b"]
    assert [part is original for (part, _), original in zip(found, (a, b, c), strict=True)] == [True] * 3
    assert [storage.nbytes() for storage in storages_of(outer)] == [16, 16, 16]


def test_an_uninitialized_lazy_parameter_has_no_storages_and_does_not_stop_the_walk():
    lazy = nn.LazyLinear(3)
    plain = torch.ones(7)
    assert storages_of(lazy.weight) == [] and storages_of(lazy.bias) == []
    assert _holds(live_storages()[id(plain.untyped_storage())].tensors, plain) == 1


def test_tensor_classes_include_subclasses_of_subclasses():
    class Mine(torch.Tensor):
        pass

    class Deeper(Mine):
        pass

    classes = tensor_classes()
    assert {torch.Tensor, nn.Parameter, Mine, Deeper} <= classes


def test_reachable_tensors_skip_weak_proxies():
    tensor = torch.ones(3)
    proxy = weakref.proxy(tensor)
    found = reachable_tensors()
    assert _holds(found, tensor) == 1
    assert not any(type(item) is weakref.ProxyType for item in found)
    assert proxy.shape == (3,)


def test_live_tensors_find_a_gradient_that_has_no_python_object_yet():
    weight = torch.ones(3, requires_grad=True)
    (weight * 2).sum().backward()
    reachable, live = reachable_tensors(), live_tensors()
    grad = weight.grad  # created now, or found above: the same object either way
    assert _holds(reachable, grad) == 0 and _holds(live, grad) == 1
    assert grad.tolist() == [2.0, 2.0, 2.0]


def test_live_tensors_find_the_base_of_a_view_made_in_cpp():
    view = torch.einsum("ij,jk->ki", torch.ones(2, 3), torch.ones(3, 4))  # a transpose of bmm's output
    reachable, live = reachable_tensors(), live_tensors()
    base = view._base
    assert _holds(reachable, base) == 0 and _holds(live, base) == 1 and _holds(live, view) == 1
    assert base.untyped_storage() is view.untyped_storage() and base.untyped_storage().nbytes() == 32


def test_live_storages_count_a_shared_storage_once_with_both_tensors():
    base = torch.zeros(100)
    view = base[10:20]
    entry = live_storages()[id(base.untyped_storage())]
    assert entry.storage is base.untyped_storage() and entry.storage.nbytes() == 400
    assert sorted(map(id, entry.tensors)) == sorted([id(base), id(view)])


def test_live_storages_list_a_wrapper_with_each_inner_storage():
    a, b = torch.ones(6), torch.zeros(6)
    pair = TwoTensor(a, b)
    found = live_storages()
    for inner in (a, b):
        tensors = found[id(inner.untyped_storage())].tensors
        assert _holds(tensors, inner) == 1 and _holds(tensors, pair) == 1 and len(tensors) == 2


def test_live_storages_keep_only_the_device_asked_for_and_skip_empty_storages():
    on_meta = torch.empty(25, device="meta")
    on_cpu = torch.ones(25)
    empty = torch.empty(0)
    meta = live_storages(torch.device("meta"))
    assert id(on_meta.untyped_storage()) in meta and id(on_cpu.untyped_storage()) not in meta
    assert {entry.storage.device.type for entry in meta.values()} == {"meta"}
    assert meta[id(on_meta.untyped_storage())].storage.nbytes() == 100
    cpu = live_storages(torch.device("cpu"))
    assert id(on_cpu.untyped_storage()) in cpu and id(on_meta.untyped_storage()) not in cpu
    assert id(empty.untyped_storage()) not in live_storages()


@pytest.mark.parametrize(
    ("device", "wanted", "expected"),
    [
        ("cuda:1", "cuda", True),
        ("cuda:1", "cuda:1", True),
        ("cuda:1", "cuda:0", False),
        ("cpu", "cuda", False),
        ("cpu", "cpu", True),
        ("meta", "meta", True),
    ],
)
def test_on_device_matches_every_index_when_none_is_wanted(device: str, wanted: str, expected: bool):
    assert on_device(torch.device(device), torch.device(wanted)) is expected


def test_tensors_within_finds_tensors_in_containers_modules_optimizers_and_objects():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 2)
        model.register_buffer("scale", torch.empty(3))
        loose = torch.empty(5)
        nested = {"batch": [torch.empty(6), (torch.empty(7),)]}

    class Holder:
        def __init__(self):
            self.model = model

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    found = tensors_within([loose, nested, Holder(), optimizer, "text", 3])
    assert sorted(t.numel() for t in found) == [2, 3, 5, 6, 7, 8]  # bias, scale, loose, batch, weight
    assert tensors_within([[[[[[torch.empty(1, device="meta")]]]]]]) == []  # deeper than 4 levels


def test_tensors_within_does_not_enter_large_containers_or_objects_that_refuse():
    class Refuses:
        @property
        def __dict__(self):
            raise RuntimeError("no")

    inside = torch.empty(3, device="meta")
    assert tensors_within([[inside] * 257]) == []
    assert tensors_within([[inside] * 256]) == [inside]
    assert tensors_within([Refuses(), inside]) == [inside]


def test_tensors_within_enters_modules_with_many_parameters():
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(1, 1) for _ in range(200)))
    assert len(tensors_within([model])) == 400


def test_call_roots_are_the_functions_globals_and_the_callers_locals_that_may_hold_tensors():
    held, kept, batch = torch.ones(3), torch.ones(2), [torch.ones(1)]
    callee_globals = {
        "__builtins__": __builtins__,
        "torch": torch,
        "sys": sys,
        "held": held,
        "helper": len,
        "count": 3,
        "Kind": int,
        "tracker": memlab.TensorTracker(),
        "call_roots": call_roots,
        "skip": lambda code: code.co_filename not in ("<callee>", "<caller>"),
    }
    callee = "def callee():\n    return call_roots(sys._getframe(), skip)\n"
    exec(compile(callee, "<callee>", "exec"), callee_globals)
    caller_globals = {"callee": callee_globals["callee"]}
    exec(compile("def caller(kept, batch, name):\n    return callee()\n", "<caller>", "exec"), caller_globals)
    roots = caller_globals["caller"](kept, batch, "name")
    assert [id(root) for root in roots] == [id(held), id(kept), id(batch)]  # nothing else, nothing twice
