"""Finding the functions users name for profiling: parsing, code objects not run yet, lookups, and
the watch that registers them as soon as they exist (shared by ``memlab run`` and ``%mlrun``)."""

from __future__ import annotations

import builtins
import collections
import sys
import textwrap
import types

import pytest

from memlab._function_lookup import MISSING, FunctionName, FunctionWatch, code_function, codes_named, lookup

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


class Registry:
    """A profiler stand-in: records what is registered, refuses what has no Python code."""

    def __init__(self) -> None:
        self.added: list[object] = []

    def add_function(self, function: object) -> None:
        if not hasattr(function, "__code__") and not isinstance(function, property):
            raise TypeError(f"cannot profile {function!r}")
        self.added.append(function)


def test_watch_registers_functions_the_code_defines_before_it_runs() -> None:
    code = compile(SOURCE, "<source>", "exec")
    registry = Registry()
    watch = FunctionWatch(["Net.forward", "step"], registry, [code], {})
    assert [f.__code__.co_qualname for f in watch.functions()] == ["Net.forward", "step"]
    assert registry.added == watch.check()


def test_watch_looks_names_up_again_until_found_and_when_rebound() -> None:
    namespace: dict[str, object] = {}
    registry = Registry()
    watch = FunctionWatch(["helper"], registry, [compile("x = 1", "<cell>", "exec")], namespace)
    assert [name.text for name in watch.missing()] == ["helper"]
    with pytest.raises(ValueError) as error:
        watch.check()
    assert str(error.value) == (
        "-f helper: no function of that name was defined or imported by the code or found in the "
        "namespace (write name, Class.method or module:qualname)"
    )

    def helper() -> int:
        return 1

    def rebound() -> int:
        return 2

    namespace["helper"] = helper
    watch.look_up()
    namespace["helper"] = rebound
    watch.look_up()  # found already, not rebound by a statement: not looked up
    assert registry.added == [helper]
    watch.look_up(rebound={"helper"})
    assert watch.check() == registry.added == [helper, rebound]


def test_watch_skips_names_the_code_will_bind_and_imports_modules_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    registry = Registry()
    watch = FunctionWatch(
        ["Counter", "colorsys:rgb_to_hsv"],
        registry,
        namespace={"Counter": collections.Counter},
        bound={"Counter"},
        import_modules=True,
    )
    assert registry.added == [sys.modules["colorsys"].rgb_to_hsv]
    assert [name.text for name in watch.missing()] == ["Counter"]


def test_watch_registers_a_name_at_the_import_that_binds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("watched_module_xyz")
    exec("def make():\n    return 1\n\ndef build():\n    return 2\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "watched_module_xyz", module)
    program: dict[str, object] = {"__builtins__": builtins}
    code = compile(
        "def main():\n    from watched_module_xyz import build\n    return build()\n", "<p>", "exec"
    )
    registry = Registry()
    watch = FunctionWatch(["watched_module_xyz:make", "build"], registry, [code], program)
    assert registry.added == [module.make]  # the module is imported already
    original = builtins.__import__
    with watch.watching_imports():
        exec(code, program)
        assert program["main"]() == 2  # binds build only as a local of main()
    assert builtins.__import__ is original
    assert watch.check() == [module.make, module.build]


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (["a-b"], "-f: 'a-b' is not a function name; write name, Class.method or module:qualname"),
        (
            ["sys"],
            "-f sys: cannot profile a module; name a function, method, property or class defined in Python",
        ),
    ],
)
def test_watch_refuses_what_it_cannot_profile(texts: list[str], message: str) -> None:
    with pytest.raises(ValueError) as error:
        FunctionWatch(texts, Registry(), namespace={"sys": sys})
    assert str(error.value) == message
