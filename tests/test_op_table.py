"""The docs' supported-op table (docs/ops.md) is the one generated from the
dispatch table."""
from pathlib import Path

from domainpar.ops import table

OPS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "ops.md"


def test_docs_op_table_is_current():
    text = OPS_PAGE.read_text(encoding="utf-8")
    assert table.BEGIN in text and table.END in text
    assert table.replace_in(text) == text, (
        "docs/ops.md's op table is stale: run `domainpar ops --write docs/ops.md`")


def test_every_family_has_rows_with_semantics():
    rows = table.rows()
    assert {f for f, _, _ in rows} == set(table.FAMILIES)
    blank = [ops for _, ops, semantics in rows if not semantics]
    assert not blank, f"rules without a docstring: {blank}"
    conv = [s for f, ops, s in rows if "`conv2d`" in ops]
    assert conv and conv[0].startswith("Neighbour-wise collective")


def test_cli_prints_the_table_and_rewrites_a_file(tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "domainpar.cli", "ops"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == table.markdown()
    stale = tmp_path / "ops.md"
    stale.write_text(f"intro\n{table.BEGIN}\nold rows\n{table.END}\nrest\n", encoding="utf-8")
    subprocess.run([sys.executable, "-m", "domainpar.cli", "ops", "--write", str(stale)],
                   check=True)
    assert stale.read_text(encoding="utf-8") == f"intro\n{table.markdown()}\nrest\n"
