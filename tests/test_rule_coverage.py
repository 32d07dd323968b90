"""Every rule in the dispatch table has oracle tests of its own, beside the
OpInfo sweep (tests/test_opinfo.py), which runs torch's samples and so covers
only what torch's samples reach.

A rule counts as tested when a test module other than the sweep names one of
the torch callables bound to it (``torch.add``, ``x.add_``, ``F.relu`` ... by
their base name, as the op table writes them), or, for a rule reached through
syntax or a module rather than by name, matches its entry in ``REACHED_AS``.
"""
import re
from pathlib import Path

import domainpar.ops  # noqa: F401  (registers every rule)
from domainpar.ops import table
from domainpar.tensor import dispatch

TESTS = Path(__file__).resolve().parent
SWEEP = "test_opinfo.py"

# Rules that tests reach without naming the callable: base name -> regex.
REACHED_AS = {
    "getitem": r"\w\[[^\]\n]*:",                      # x[:, 1:] (Tensor.__getitem__)
    "multi_head_attention_forward": r"nn\.MultiheadAttention\(",
    "prelu": r"nn\.PReLU\(",
}


def _rules_by_name() -> dict[str, set[str]]:
    """``{"module.rule": {base names of the callables bound to it}}`` for the op
    families' rules (the tensor protocol's are not ops)."""
    out: dict[str, set[str]] = {}
    for func, rule in dispatch.rules().items():
        family = rule.__module__.rsplit(".", 1)[-1]
        if family in table.FAMILIES:
            out.setdefault(f"{rule.__module__}.{rule.__name__}", set()).add(table._base_name(func))
    return out


def _test_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(TESTS.rglob("*.py"))
                     if p.name != SWEEP)


def _tested(names: set[str], text: str) -> bool:
    patterns = [r"\b" + re.escape(n) + r"\b" for n in names]
    patterns += [REACHED_AS[n] for n in names if n in REACHED_AS]
    return any(re.search(p, text) for p in patterns)


def test_every_rule_has_oracle_tests_of_its_own():
    text = _test_text()
    rules = _rules_by_name()
    assert len(rules) > 30, sorted(rules)  # the table is populated
    untested = {r: sorted(n) for r, n in rules.items() if not _tested(n, text)}
    assert not untested, f"rules no test module outside {SWEEP} exercises: {untested}"


def test_reached_as_entries_are_rules_and_match_tests():
    """An entry of REACHED_AS names a rule and matches some test (or it is stale)."""
    names = set().union(*_rules_by_name().values())
    text = _test_text()
    assert set(REACHED_AS) <= names, set(REACHED_AS) - names
    stale = [n for n, p in REACHED_AS.items() if not re.search(p, text)]
    assert not stale, f"REACHED_AS entries no test matches: {stale}"
