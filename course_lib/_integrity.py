"""Has code run on this rank changed the libraries the checks measure with?

A grading rank runs the student's code next to the code that measures it (counting bytes,
logging calls, tracking memory). Student code that rebinds a function of `course_lib`,
`torch.distributed` or `builtins`, swaps a function's code, or edits a class could change
what is measured. `Fingerprint` records, when the worker starts and before any student code
has run, which object every protected name is bound to; `changes()` lists the names that
are bound to something else now. A grading worker checks after every call and, if anything
changed, fails the call and exits: its process is no longer trusted.

The protected classes' operators are watched too (`Tensor.__eq__`, `__ne__`, `__add__`, ...),
and `torch.testing`'s functions.

Values that libraries rebind on their own while running (counters, caches) are not
watched: in course_lib only UPPER_CASE constants are watched besides functions and
classes; elsewhere only functions, classes and modules.
"""

from __future__ import annotations

import inspect
import sys
import types
import warnings

# Modules whose functions and classes the checks rely on, besides every course_lib module.
PROTECTED_MODULES = (
    "builtins",
    "copy",
    "functools",
    "gc",
    "math",
    "operator",
    "pickle",
    "time",
    "torch",
    "torch.autograd",
    "torch.autograd.function",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.nn",
    "torch.nn.functional",
    "torch.nn.modules.module",
    "torch.nn.parameter",
    "torch.optim",
    "torch.optim.optimizer",
    "torch.optim.adamw",
    "torch.optim.sgd",
    "torch.testing",
    "torch.testing._comparison",
    "torch.utils.hooks",
)
# Classes whose attributes (methods) are watched too, operators (`__eq__`, `__add__`...)
# included: `==` on a tensor is as much the checks' tool as torch.equal.
PROTECTED_CLASSES = ("torch.Tensor", "torch.nn.Module", "torch.nn.Parameter")

_WATCHED_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type)


def _ours(module_name: str) -> bool:
    return module_name == "course_lib" or module_name.startswith("course_lib.")


def _watched(module_name: str, name: str, value: object) -> bool:
    if isinstance(value, _WATCHED_TYPES) or callable(value):
        return True
    return _ours(module_name) and name.isupper()


def _code_of(value: object) -> object:
    return getattr(value, "__code__", None)


class Fingerprint:
    """Which object each protected name is bound to, at one moment."""

    def __init__(self) -> None:
        self.bindings: dict[str, tuple[int, int]] = {}
        with warnings.catch_warnings():  # touching deprecated names warns
            warnings.simplefilter("ignore")
            self._take()

    def _take(self) -> None:
        for module_name, module in list(sys.modules.items()):
            if module is None or not (_ours(module_name) or module_name in PROTECTED_MODULES):
                continue
            self._add_namespace(module_name, module_name, vars(module))
        for path in PROTECTED_CLASSES:
            cls = _lookup(path)
            if cls is not None:
                # Operators as the class resolves them: most are inherited from a C base.
                operators = {
                    n: inspect.getattr_static(cls, n, None) for n in dir(cls) if n.startswith("__")
                }
                self._add_namespace(path, path, {**operators, **vars(cls)}, operators=True)

    def _add_namespace(
        self, prefix: str, module_name: str, namespace: dict, operators: bool = False
    ) -> None:
        for name, value in list(namespace.items()):
            dunder = name.startswith("__") and name.endswith("__")
            if dunder and not (operators or name == "__init__"):
                continue
            if not _watched(module_name, name, value):
                continue
            key = f"{prefix}.{name}"
            self.bindings[key] = (id(value), id(_code_of(value)))
            # The methods of course_lib's own classes: a check's helper class could be edited.
            if isinstance(value, type) and _ours(module_name) and value.__module__ == module_name:
                for attr, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, (staticmethod, classmethod)):
                        inner = getattr(member, "__func__", member)
                        self.bindings[f"{key}.{attr}"] = (id(member), id(_code_of(inner)))

    def changes(self) -> list[str]:
        """Names bound (or whose code is) different now than when this fingerprint was taken;
        names that disappeared count too."""
        now = Fingerprint().bindings
        return sorted(key for key, ids in self.bindings.items() if now.get(key) != ids)


def _lookup(path: str) -> object:
    module_name, _, attr = path.rpartition(".")
    module = sys.modules.get(module_name)
    return getattr(module, attr, None) if module is not None else None
