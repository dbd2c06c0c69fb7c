"""Import-only torchvision stand-in for CPU tests and demos (this project's own code).

PyPI's torchvision wheels do not load beside the CPU build of torch 2.13.0, yet
SGLang's text-only import path reaches ``import torchvision.transforms``. This
package makes every ``torchvision.*`` module importable and answers every attribute
with an inert placeholder. It computes nothing: any real image or video use gets
placeholders, which is fine for text-only models and never shipped with the plugin.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.28.0"


class _Placeholder:
    """Callable, subscriptable, attribute-rich object that does nothing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> _Placeholder:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
        return _Placeholder(f"{self._name}()")

    def __getitem__(self, item: Any) -> _Placeholder:
        return _Placeholder(f"{self._name}[]")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # every stand-in module can have submodules
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(item: str) -> Any:
    if item.startswith("__") and item.endswith("__"):
        raise AttributeError(item)
    return _Placeholder(f"torchvision.{item}")
