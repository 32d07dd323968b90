"""The supported-op table, generated from the dispatch table: one row per rule,
with the torch callables bound to it and the first paragraph of the rule's
docstring (its MPI semantics and supported options).

The docs page docs/ops.md carries the table between two markers; ``python -m
domainpar.ops.table --write docs/ops.md`` (or ``domainpar ops --write docs/ops.md``)
regenerates it and tests/test_op_table.py checks that it is current.
"""
from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections import defaultdict

from ..tensor import dispatch

BEGIN, END = "<!-- op-table:begin -->", "<!-- op-table:end -->"
# The op families (modules of domainpar.ops) the table lists.
FAMILIES = ("attention", "conv", "dropout", "einsum", "fft", "index", "interop", "linear", "loss",
            "norm", "pad", "pointwise", "points", "pool", "reduce", "resample", "shape")

# Modules whose rules belong to another module's family in the table.
_FAMILY_OF = {"conv_transpose": "conv"}


def _base_name(func) -> str:
    """The op's name without its spelling: ``Tensor.add_``, ``torch.add`` and
    ``Tensor.__add__`` are all ``add``."""
    name = dispatch.op_name(func).rsplit(".", 1)[-1]
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith(("r", "i")) and name[1:] in _DUNDER_BASES:
            name = name[1:]
    return name.rstrip("_") or name


_DUNDER_BASES = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
                 "lshift", "rshift", "matmul"}


def _summary(rule) -> str:
    doc = inspect.getdoc(rule) or ""
    first = doc.split("\n\n", 1)[0]
    return " ".join(first.split()).replace("|", "\\|")


def rows() -> list[tuple[str, str, str]]:
    """(family, ops, semantics and options) per rule, ordered by family then ops."""
    from .. import ops  # noqa: F401  (registers every rule)
    by_rule = defaultdict(set)
    for func, rule in dispatch.rules().items():
        by_rule[rule].add(_base_name(func))
    out = []
    for rule, names in by_rule.items():
        # ops/<family>.py, or a package of its own beside ops/ (points/rules.py)
        package, module = rule.__module__.split(".")[1:3]
        family = _FAMILY_OF.get(module, module) if package == "ops" else package
        if family not in FAMILIES:
            continue  # the tensor protocol (metadata, conversions, backward): not ops
        out.append((family, ", ".join(f"`{n}`" for n in sorted(names)), _summary(rule)))
    return sorted(out)


def markdown() -> str:
    """Local. The op table (family, ops, semantics) as Markdown between its markers."""
    lines = [BEGIN,
             "| family | ops | semantics and supported options |",
             "|---|---|---|"]
    lines += [f"| {f} | {o} | {s} |" for f, o, s in rows()]
    lines.append(END)
    return "\n".join(lines)


def replace_in(text: str) -> str:
    """``text`` with the table between the markers regenerated."""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {BEGIN} ... {END} block to replace")
    return pattern.sub(lambda _: markdown(), text)


def main(argv=None) -> int:
    """Local. ``domainpar ops``: print the op table, or rewrite it in ``--write FILE``."""
    parser = argparse.ArgumentParser(
        prog="domainpar ops", description="Print the table of torch ops that work on "
        "DomainTensors, generated from the dispatch table, or rewrite it in a file.")
    parser.add_argument("--write", metavar="FILE", help="replace the table between the "
                        f"{BEGIN} and {END} markers in FILE (docs/ops.md)")
    args = parser.parse_args(argv)
    if args.write:
        with open(args.write, encoding="utf-8") as f:
            text = f.read()
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(replace_in(text))
    else:
        print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
