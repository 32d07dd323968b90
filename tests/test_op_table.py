"""README's supported-op table is the one generated from the dispatch table."""
from pathlib import Path

from domainpar.ops import table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_op_table_is_current():
    text = README.read_text(encoding="utf-8")
    assert table.BEGIN in text and table.END in text
    assert table.replace_in(text) == text, (
        "README's op table is stale: run `domainpar ops --write README.md`")


def test_every_family_has_rows_with_semantics():
    rows = table.rows()
    assert {f for f, _, _ in rows} == set(table.FAMILIES)
    blank = [ops for _, ops, semantics in rows if not semantics]
    assert not blank, f"rules without a docstring: {blank}"
    conv = [s for f, ops, s in rows if "`conv2d`" in ops]
    assert conv and conv[0].startswith("Neighbour-wise collective")
