"""Import-time stand-ins for optional ComfyUI dependencies that a CPU-only torch cannot provide.

ComfyUI imports `torchvision` / `torchaudio` at module level in files the H3 path never executes (other model
families, media nodes). When the real package is missing we register a stand-in module whose attributes can be
imported and referenced but raise as soon as they are *used*, so an H3 run that accidentally depends on them
fails loudly instead of silently computing something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STAND_IN_PACKAGES = ("torchvision", "torchaudio")


class StandInUsed(RuntimeError):
    """A stand-in attribute was called: the oracle run needs the real package."""


class _Placeholder:
    """Any attribute of a stand-in module: chainable, subclassable, but not callable."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise StandInUsed(
            f"{self._qualname} was called, but {self._qualname.split('.')[0]} is only a stand-in here "
            "(install the real package to run this code path)"
        )

    def __mro_entries__(self, bases):  # `class X(torchvision.Foo)` at import time
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._qualname}>"


class _StandInModule(types.ModuleType):
    __h3_stand_in__ = True

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StandInModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0+h3-stand-in"
        return mod

    def exec_module(self, module):
        return None


def install_stand_ins() -> list[str]:
    """Register stand-ins for the packages of STAND_IN_PACKAGES that are not installed; returns their names."""
    missing = []
    for name in STAND_IN_PACKAGES:
        if name in sys.modules:
            continue
        if importlib.util.find_spec(name) is None:
            missing.append(name)
    if missing and not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(_StandInFinder(tuple(missing)))
    return missing


def is_stand_in(module: types.ModuleType) -> bool:
    return bool(getattr(module, "__h3_stand_in__", False))
