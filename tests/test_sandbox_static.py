"""The static layer: diagnostics at the binding file's line and column."""

import pytest

from fabric.sandbox import check_snippet, snippet_params

GOOD = """\
import pyarrow.compute as pc
import numpy as np

def run(table, min_score=0.5):
    keep = pc.greater_equal(table["score"], min_score)
    return table.filter(keep)
"""


def test_clean_snippet_has_no_diagnostics():
    assert check_snippet(GOOD, file="agents/news.yaml", line=20, col=7) == []


def test_snippet_params_are_the_arguments_after_the_table():
    assert snippet_params(GOOD) == ("min_score",)
    assert snippet_params("def run(t, *, k, q=1):\n    return t\n") == ("k", "q")
    assert snippet_params("def run(t, a):\n    return t\ndef run(t, b):\n    return t\n") == ("b",)


def test_disallowed_import_points_at_the_binding_line_and_lists_allowed_modules():
    src = "import json\nimport os\ndef run(table):\n    return table\n"
    (d,) = check_snippet(src, file="agents/a.yaml", line=12, col=5)
    assert (d.span.file, d.span.line, d.span.col) == ("agents/a.yaml", 13, 5)
    assert "import of 'os' is not allowed" in d.message
    assert "allowed modules" in d.hint and "pyarrow.compute" in d.hint
    text = d.format()
    assert text.splitlines()[0].startswith("agents/a.yaml:13:5: ")
    assert "    import os" in text and "^^^^^^^^^" in text


def test_did_you_mean_for_a_misspelt_module():
    (d,) = check_snippet("import nmupy\ndef run(t):\n    return t\n", file="f.yaml", line=1, col=1)
    assert "did you mean 'numpy'" in d.hint


def test_syntax_error_is_reported_at_its_file_line():
    src = "def run(table):\n    return table +\n"
    (d,) = check_snippet(src, file="b.yaml", line=30, col=7)
    assert d.span.line == 31 and "syntax error" in d.message


def test_missing_run_and_run_without_table():
    (d,) = check_snippet("def main(table):\n    return table\n", file="c.yaml", line=3, col=3)
    assert "must define a top-level function 'run'" in d.message and d.span.line == 3
    (d,) = check_snippet("def run():\n    return 1\n", file="c.yaml", line=3, col=3)
    assert "first parameter" in d.message
    (d,) = check_snippet("async def run(t):\n    return t\n", file="c.yaml", line=3, col=3)
    assert "async def" in d.message


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("x = ().__class__", "attribute '__class__'"),
        ("x = table._private", "attribute '_private'"),
        ("x = getattr(table, '__dict__')", "getattr() on '__dict__'"),
        ("x = eval('1')", "'eval' is not allowed"),
        ("x = __builtins__", "'__builtins__' is not allowed"),
        ("x = (i for i in []).gi_frame", "attribute 'gi_frame'"),
        ("x = '{0.__class__}'.format(table)", "dunder name inside a string"),
        ("x = '{0.t}'.format(table)", "'.format' is only allowed"),
        ("x = str.format('{}', table)", "'.format' is only allowed"),
        ("x = type(table).mro()", "attribute 'mro'"),
    ],
)
def test_hostile_constructs_point_at_their_column(line, needle):
    src = f"def run(table):\n    {line}\n    return table\n"
    diags = check_snippet(src, file="d.yaml", line=8, col=9)
    assert diags, line
    assert any(needle in d.message for d in diags), [d.message for d in diags]
    assert all(d.span.line == 9 for d in diags)
    assert min(d.span.col for d in diags) >= 9 + 4  # inside the indented body line


def test_literal_format_without_fields_is_allowed():
    src = "def run(table):\n    s = '{} rows, {:.2f}'.format(1, 2.0)\n    return table\n"
    assert check_snippet(src, file="e.yaml", line=1, col=1) == []


def test_class_with_allowed_and_forbidden_special_methods():
    ok = "class P:\n    def __init__(self, x):\n        self.x = x\ndef run(t):\n    return t\n"
    assert check_snippet(ok, file="f.yaml", line=1, col=1) == []
    bad = "class P:\n    def __getattribute__(self, n):\n        return 1\ndef run(t):\n    return t\n"
    (d,) = check_snippet(bad, file="f.yaml", line=1, col=1)
    assert "__getattribute__" in d.message and d.span.line == 2


def test_a_local_named_like_a_forbidden_builtin_is_fine():
    src = "def run(table, input=None):\n    vars = [input]\n    return table if vars else table\n"
    assert check_snippet(src, file="g.yaml", line=1, col=1) == []
    (d,) = check_snippet("def run(table):\n    return vars(table)\n", file="g.yaml", line=1, col=1)
    assert "'vars' is not allowed" in d.message


def test_positions_match_the_binding_loader_for_a_block_scalar():
    """check_snippet fed with the loader's (file, line, col) underlines the file's own text."""
    from dsl.loader import load_text

    text = (
        "binding: market_open_news\n"
        "session:\n  k: int\n"
        "sources:\n  n:\n    from: dataset://news\n"
        "select: [n.id, n.body]\n"
        "pushdown:\n"
        "  python: |\n"
        "    import json\n"
        "    import socket\n"
        "    def run(table, k):\n"
        "        return table.slice(0, k)\n"
        "  params: [k]\n"
    )
    (spec,) = load_text(text, "agents/news.yaml")
    pd = spec.pushdown
    (d,) = check_snippet(pd.python, file=pd.file, line=pd.line, col=pd.col)
    file_line = text.splitlines()[d.span.line - 1]
    assert file_line == "    import socket"
    assert file_line[d.span.col - 1 :].startswith("import socket")
    assert d.source_line == file_line
