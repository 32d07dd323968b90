"""torch.compile and DomainTensors: every torch call on a DomainTensor is a graph
break that runs eagerly.

Dynamo must never trace a rule: it would hand MPI fake tensors ("Cannot access
data pointer"). ``torch.compiler.disable`` on ``DomainTensor.__torch_function__``
makes each call a graph break, communication and the block's autograd state
included (measured on torch 2.13.0: one process's numbers, tests/
test_tensor_faults.py, torch_compile). But that decorator imports torch._dynamo
(with sympy, torch.distributed and more: +70 MiB of resident memory per rank
and over a second of start-up, measured on torch 2.13.0), which a job that never
compiles must not pay. So the decorator is applied when torch._dynamo is first
imported (torch.compile imports it before it traces anything), through an
import hook, or at once if it is already loaded.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_DYNAMO = "torch._dynamo"


def when_dynamo_loads(callback: Callable[[], None]) -> None:
    """Local. ``callback()`` now if torch._dynamo is loaded, else right after it
    is first imported (once)."""
    if _DYNAMO in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _AfterImport(_DYNAMO, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the other finders find ``name``, then runs
    ``callback`` once the module has executed, and removes itself."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            self.callback()
        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # wrapped, on purpose
        return spec


def hide_from_dynamo(cls: type) -> None:
    """Local. Make every torch call on ``cls`` (a tensor subclass) a graph break
    under torch.compile, once torch._dynamo is loaded (idempotent)."""
    def disable() -> None:
        function = cls.__dict__["__torch_function__"].__func__
        if not getattr(function, "_domainpar_hidden", False):
            import torch
            hidden = torch.compiler.disable(function)
            hidden._domainpar_hidden = True
            # a tensor subclass's hook, replaced by its wrapped self
            cls.__torch_function__ = classmethod(hidden)  # type: ignore[attr-defined]
    when_dynamo_loads(disable)
