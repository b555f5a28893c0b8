"""Shared helper for the CPU-test stub packages (IPython, openai, xgrammar, torchvision,
sgl_kernel); from ../shared/sglang/src/stubs (the SGLang probe).

These stubs exist only so that `import sglang` and the attention-kit import chain
succeed on a machine where those packages are not installed. They are NOT the
real libraries: every attribute is a permissive dummy class. Any code path that
actually *uses* a stubbed library will misbehave; the MLA attention kit does not.
"""

import importlib.abc
import importlib.machinery
import sys


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return make_stub_class(name, cls.__module__)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __iter__(cls):
        return iter(())


class StubObject(metaclass=_StubMeta):
    __sglprobe_stub__ = True

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return StubObject()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return StubObject()

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()


def make_stub_class(name, module):
    return _StubMeta(name, (StubObject,), {"__module__": module})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefix):
        self.prefix = prefix

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.prefix + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        make_stub_module(module)


def make_stub_module(module):
    module.__sglprobe_stub__ = True
    module.__path__ = []

    def __getattr__(name, _m=module.__name__):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return make_stub_class(name, _m)

    module.__getattr__ = __getattr__
    return module


def install(package_name, version="0.0.0+stub"):
    """Turn package `package_name` (already in sys.modules) into a stub whose
    submodules are created on demand."""
    mod = sys.modules[package_name]
    make_stub_module(mod)
    mod.__version__ = version
    if not any(isinstance(f, _StubFinder) and f.prefix == package_name for f in sys.meta_path):
        sys.meta_path.append(_StubFinder(package_name))
    return mod
