"""The names of modules in memory per module: each module's path in a model a tracker knows."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

__all__ = ["ModulePaths"]


class ModulePaths:
    """Paths of modules in the models ``known()`` returns (a tracker's, in order) and in the models
    :meth:`path` discovers.

    The first model's paths are those of ``named_modules()`` (the root ``""``, ``layers.0``,
    ``layers.0.attn``); each further model's follow its class name (``CrossEntropyLoss``,
    ``Discriminator.layers.0``), with ``#2``, ``#3`` after a class name two models share. A module
    keeps the first path it was given (one shared by two models is named in the first). Modules
    are held weakly.
    """

    def __init__(self, known: Callable[[], list[torch.nn.Module]], discover: bool = False) -> None:
        self._known = known
        #: Whether a module called at the top (:meth:`path` with ``top``) becomes a model of its own.
        self.discover = discover
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._outside: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        self._found: list[weakref.ref[torch.nn.Module]] = []  # models discovered, in order
        self._prefixes: set[str] = set()

    def models(self) -> list[torch.nn.Module]:
        """The models modules are named in, in naming order: the known ones, then those discovered."""
        found = [model for model in (ref() for ref in self._found) if model is not None]
        return [*self._known(), *found]

    def path(self, module: torch.nn.Module, top: bool = False) -> str | None:
        """The path of ``module``, or ``None`` for a module outside every model. With
        :attr:`discover`, a module outside every model that runs at the ``top`` (no module of a
        model is running forward) becomes a model itself."""
        path = self._names.get(module)
        if path is not None:
            return path
        if self._outside.get(module) == len(self.models()):
            return None  # asked again only once the models change
        self._name_models()
        path = self._names.get(module)
        if path is None and self.discover and top:
            self._found.append(weakref.ref(module))
            self._name_models()
            path = self._names.get(module)
        if path is None:
            self._outside[module] = len(self.models())
        return path

    def named(self) -> dict[str, torch.nn.Module]:
        """Every module of the models alive now by path, in the models' order (``named_modules()``)."""
        self._name_models()
        found: dict[str, torch.nn.Module] = {}
        for module, path in list(self._names.items()):
            found.setdefault(path, module)
        return found

    def _name_models(self) -> None:
        for model in self.models():
            prefix = self._names.get(model)
            if prefix is None:
                prefix = self._new_prefix(model)
            for path, module in model.named_modules(prefix=prefix):
                if module not in self._names:
                    self._names[module] = path

    def _new_prefix(self, model: torch.nn.Module) -> str:
        prefix = ""
        if self._prefixes:
            name = prefix = type(model).__name__
            number = 1
            while prefix in self._prefixes:
                number += 1
                prefix = f"{name}#{number}"
        self._prefixes.add(prefix)
        return prefix
