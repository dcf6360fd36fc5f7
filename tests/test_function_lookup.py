"""Finding the functions users name for profiling: parsing, code objects not run yet, lookups."""

from __future__ import annotations

import collections
import textwrap

import pytest

from memlab._function_lookup import MISSING, FunctionName, code_function, codes_named, lookup

SOURCE = textwrap.dedent(
    """\
    def step():
        return [x for x in range(3)]

    class Net:
        def forward(self):
            def inner():
                return 1
            return inner

        @property
        def size(self):
            return 1

    def main():
        def step():
            return 2
        return step
    """
)


@pytest.mark.parametrize(
    ("text", "module", "qualname", "root"),
    [
        ("step", None, "step", "step"),
        ("Net.forward", None, "Net.forward", "Net"),
        ("pkg.mod:Net.forward", "pkg.mod", "Net.forward", "pkg"),
    ],
)
def test_parse(text: str, module: str | None, qualname: str, root: str) -> None:
    name = FunctionName.parse(text)
    assert (name.module, name.qualname, name.root) == (module, qualname, root)


@pytest.mark.parametrize("text", ["", "a b", "a-b", "a:b:c", "1x", "mod:", "Net..forward", "f()"])
def test_parse_rejects_what_is_not_a_name(text: str) -> None:
    with pytest.raises(ValueError, match=r"name, Class\.method or module:qualname"):
        FunctionName.parse(text)


def test_codes_named_finds_functions_before_they_exist() -> None:
    code = compile(SOURCE, "<source>", "exec")
    assert [c.co_firstlineno for c in codes_named(code, "step")] == [1]  # the exact qualname wins
    assert [c.co_qualname for c in codes_named(code, "Net.forward")] == ["Net.forward"]
    assert [c.co_qualname for c in codes_named(code, "inner")] == ["Net.forward.<locals>.inner"]
    assert [c.co_qualname for c in codes_named(code, "Net.size")] == ["Net.size"]
    assert codes_named(code, "Net.missing") == [] and codes_named(code, "listcomp") == []


def test_code_function_wraps_closures_too() -> None:
    code = compile(SOURCE, "<source>", "exec")
    (inner,) = codes_named(code, "inner")
    assert code_function(inner).__code__ is inner


def test_lookup_in_a_namespace_and_in_imported_modules() -> None:
    namespace: dict[str, object] = {}
    exec(compile(SOURCE, "<source>", "exec"), namespace)
    net_class = namespace["Net"]
    assert lookup(FunctionName.parse("Net.forward"), namespace) is vars(net_class)["forward"]
    assert isinstance(lookup(FunctionName.parse("Net.size"), namespace), property)  # not run
    assert (
        lookup(FunctionName.parse("collections:Counter.most_common"), None) is collections.Counter.most_common
    )
    assert lookup(FunctionName.parse("Net.nope"), namespace) is MISSING
    assert lookup(FunctionName.parse("nope"), namespace) is MISSING
    assert lookup(FunctionName.parse("not_imported_module_xyz:f")) is MISSING
