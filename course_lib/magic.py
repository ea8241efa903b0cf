"""The `%%distributed` cell magic: run a cell's code on every rank.

    %%distributed -n 4
    t = torch.ones(1) * rank()
    dist.all_reduce(t)
    print(t.item())

The cell runs through `course_lib.launch`, with the same guarantees (prefixed live output,
errors and hangs reported per rank, nothing left running). Names the cell uses from the
notebook (imports, functions, small data) are sent to the ranks by value. If the cell ends
with an expression, its value on each rank is returned as a list in rank order.

`import course_lib` registers the magic in IPython; `%load_ext course_lib` also works.
"""

from __future__ import annotations

import ast
import itertools
import linecache

import cloudpickle

from course_lib.launch import DEFAULT_TIMEOUT, launch

_cells = itertools.count(1)
# Names IPython puts in the user namespace that a cell never means to send.
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit"}


def exec_cell(source: str, filename: str, names: dict) -> object:
    """On one rank: run `source` with `names` as globals; return its last expression's value."""
    namespace = {"__name__": "__main__", **names}
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)


def run_cell(
    source: str, user_ns: dict, world_size: int, backend: str, timeout: float | None
) -> list | None:
    """Run a cell body on `world_size` ranks; return the last expression's values, if any."""
    __tracebackhide__ = True
    filename = f"<distributed cell {next(_cells)}>"
    # Register the source like IPython does, so tracebacks on every rank quote its lines.
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    names = _names_to_send(source, filename, user_ns)
    results = launch(
        exec_cell,
        source,
        filename,
        names,
        world_size=world_size,
        backend=backend,
        timeout=timeout,
    )
    return None if all(r is None for r in results) else results


def _names_to_send(source: str, filename: str, user_ns: dict) -> dict:
    """The notebook variables the cell refers to, checked to be sendable."""
    used = {node.id for node in ast.walk(ast.parse(source, filename)) if isinstance(node, ast.Name)}
    names = {}
    for name in sorted(used & user_ns.keys()):
        if name in _IPYTHON_NAMES or name.startswith("_"):
            continue
        value = user_ns[name]
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(
                f"the cell uses the notebook variable {name!r} ({type(value).__name__}), which "
                f"cannot be sent to the ranks: {exc}. Create it inside the cell instead."
            ) from None
        names[name] = value
    return names


def load_ipython_extension(ipython) -> None:
    """Register `%%distributed` in an IPython shell (called by `%load_ext course_lib`)."""
    from IPython.core.magic import Magics, cell_magic, magics_class
    from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

    @magics_class
    class DistributedMagics(Magics):
        @magic_arguments()
        @argument("-n", "--nprocs", type=int, default=4, help="number of ranks (default 4)")
        @argument("--backend", default="auto", help="auto, gloo or nccl")
        @argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT,
            help="seconds before the cell counts as hung",
        )
        @cell_magic
        def distributed(self, line: str, cell: str):
            """Run this cell on every rank: %%distributed -n 4 [--backend gloo] [--timeout 60]"""
            __tracebackhide__ = True
            args = parse_argstring(self.distributed, line)
            return run_cell(cell, self.shell.user_ns, args.nprocs, args.backend, args.timeout)

    ipython.register_magics(DistributedMagics)
