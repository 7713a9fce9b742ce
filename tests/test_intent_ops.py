"""Each intent operation and scope on a small module: what it writes, byte for byte,
what it refuses, and what it counts as already made upstream."""

from __future__ import annotations

import textwrap
import tomllib

import libcst as cst
import pytest
from sm120fork.errors import FatalError
from sm120fork.intent.model import parse_intent
from sm120fork.intent.reapply import Reapplied, reapply
from sm120fork.intent.source import Source

PATH = "python/sglang/srt/mod.py"
# What the snippets' new code reads (an edit whose code reads an unbound name does
# not fit: test_new_code_reading_a_name_the_landing_place_lacks_does_not_fit).
HEADER = "from lib import get_platform, is_blackwell, is_sm120, q, uses_gemm, x, y, z\n"


def apply(source: str, edits: str, files: dict[str, str] | None = None) -> Reapplied:
    text = f'[[intent]]\npatch = "p.patch"\nsays = "test"\n{textwrap.dedent(edits)}'
    intent = parse_intent(tomllib.loads(text)["intent"][0], "test")
    tree = files if files is not None else {PATH: HEADER + textwrap.dedent(source)}
    return reapply(intent, tree.get, sorted(tree))


def changed(source: str, edits: str) -> str:
    result = apply(source, edits)
    assert result.status == "resolved", result.detail
    return result.changes[PATH].removeprefix(HEADER)


CHECKS = '''\
    def check(view):
        """Validate."""
        if view.backend == "x":
            raise ValueError("x")
        return {}
'''


def test_refuse_at_top_goes_after_the_docstring() -> None:
    edits = """
        [[intent.edit]]
        function = "check"
        refuse_at = "top"
        code = '''
        if get_platform().is_sm120:
            raise ValueError("no")
        '''
    """
    assert changed(CHECKS, edits) == textwrap.dedent('''\
        def check(view):
            """Validate."""
            if get_platform().is_sm120:
                raise ValueError("no")
            if view.backend == "x":
                raise ValueError("x")
            return {}
    ''')


def test_a_refusal_must_raise() -> None:
    edits = """
        [[intent.edit]]
        function = "check"
        refuse_at = "top"
        code = "x = 1"
    """
    result = apply(CHECKS, edits)
    assert result.status == "not-found"
    assert "must raise" in result.detail


def test_insert_after_joins_the_anchor_unless_a_paragraph() -> None:
    source = "def f():\n    a = 1\n\n    b = 2\n"
    edits = """
        [[intent.edit]]
        function = "f"
        insert_after = "a = 1"
        code = "c = 3"
    """
    assert changed(source, edits) == "def f():\n    a = 1\n    c = 3\n\n    b = 2\n"
    assert changed(source, edits + "paragraph = true\n") == (
        "def f():\n    a = 1\n\n    c = 3\n\n    b = 2\n"
    )


def test_a_definition_inserted_before_a_decorated_one_keeps_their_blank_lines() -> None:
    source = "import x\n\n\n# about g\n@cache\ndef g():\n    pass\n"
    edits = """
        [[intent.edit]]
        module_of = "g"
        insert_before = "def g"
        code = '''
        def h():
            return 1
        '''
    """
    assert changed(source, edits) == (
        "import x\n\n\ndef h():\n    return 1\n\n\n# about g\n@cache\ndef g():\n    pass\n"
    )


CHAIN = """\
    @_register_for("Olmo2ForCausalLM")
    def _olmo(cfg):
        if cfg.attention_backend is None:
            if get_platform().is_sm100:
                backend = "trtllm_mha"
            # Hopper and up
            elif get_platform().device_sm >= 80:
                backend = "fa3"
            else:
                backend = "triton"
        return backend
"""
ELIF = """
    [[intent.edit]]
    model = "Olmo2ForCausalLM"
    add_elif_after = "get_platform().is_sm100"
    code = '''
    elif get_platform().is_sm120:
        backend = "triton"
    '''
"""


def test_add_elif_after_a_branch_of_the_model_override() -> None:
    new = changed(CHAIN, ELIF)
    assert new == textwrap.dedent(CHAIN).replace(
        '"trtllm_mha"\n',
        '"trtllm_mha"\n        elif get_platform().is_sm120:\n            backend = "triton"\n',
    )


def test_an_if_chain_with_a_branch_on_the_arch_is_upstreamed() -> None:
    fixed = CHAIN.replace(
        "elif get_platform().device_sm",
        "elif get_platform().is_sm120:\n"
        "                backend = 'flashinfer'\n            elif get_platform().device_sm",
    )
    result = apply(fixed, ELIF)
    assert result.status == "upstreamed", result.detail
    assert "get_platform().is_sm120" in result.detail


def test_condition_with_comment_and_holding_picks_one_of_two_gates() -> None:
    source = textwrap.dedent("""\
        def f(cfg):
            if not get_platform().is_blackwell:
                raise ValueError("needs Blackwell")
            if not get_platform().is_blackwell:
                cfg.page_size = 128
    """)
    edits = """
        [[intent.edit]]
        function = "f"
        condition = "not get_platform().is_blackwell"
        holding = "cfg.page_size = 128"
        comment = "# SM12x too"
        by = "not get_platform().is_blackwell or get_platform().is_sm120"
    """
    assert changed(source, edits) == source.replace(
        "    if not get_platform().is_blackwell:\n        cfg",
        "    # SM12x too\n    if not get_platform().is_blackwell or get_platform().is_sm120:\n"
        "        cfg",
    )
    result = apply(source, edits.replace('holding = "cfg.page_size = 128"\n', ""))
    assert result.status == "not-found"
    assert "2 statements" in result.detail


def test_condition_by_on_several_lines_follows_the_if_indent() -> None:
    source = "class A:\n    def f(self):\n        if x and y:\n            pass\n"
    edits = """
        [[intent.edit]]
        function = "A.f"
        condition = "x and y"
        by = '''
        x and (
            y or z
        )
        '''
    """
    assert changed(source, edits) == (
        "class A:\n    def f(self):\n        if x and (\n            y or z\n        ):\n"
        "            pass\n"
    )


def test_replace_every_occurrence_or_exactly_count() -> None:
    source = "def f():\n    return g(is_sm100()) or is_sm100()\n"
    edits = """
        [[intent.edit]]
        function = "f"
        replace = "is_sm100()"
        by = "uses_gemm()"
    """
    assert changed(source, edits) == "def f():\n    return g(uses_gemm()) or uses_gemm()\n"
    result = apply(source, edits + "count = 1\n")
    assert result.status == "not-found"
    assert "2 occurrences" in result.detail


def test_replace_a_statement_with_a_comment_and_a_wrapped_one() -> None:
    source = "def f():\n    x = 1\n    return q == 'a' and is_blackwell\n"
    edits = """
        [[intent.edit]]
        function = "f"
        replace = 'return q == "a" and is_blackwell'
        by = '''
        # why
        return (
            q == "a" and is_blackwell and not is_sm120
        )
        '''
    """
    assert changed(source, edits) == (
        "def f():\n    x = 1\n    # why\n    return (\n"
        '        q == "a" and is_blackwell and not is_sm120\n    )\n'
    )


def test_import_beside_in_a_parenthesized_and_a_one_line_import() -> None:
    source = "from a import (\n    b,\n    c,\n)\nfrom d import e\n\n\ndef f():\n    pass\n"
    edits = """
        [[intent.edit]]
        module_of = "f"
        import_beside = "b"
        name = "b2"

        [[intent.edit]]
        module_of = "f"
        import_beside = "e"
        name = "e2"
    """
    assert changed(source, edits) == source.replace("    b,\n", "    b,\n    b2,\n").replace(
        "import e\n", "import e, e2\n"
    )


def test_within_narrows_a_replace_to_one_gate() -> None:
    source = textwrap.dedent("""\
        def f():
            if is_sm100:
                a = "fa3"
            elif is_sm90:
                a = "fa3"
    """)
    edits = """
        [[intent.edit]]
        function = "f"
        within = "is_sm100"
        replace = '"fa3"'
        by = '"triton"'
    """
    assert changed(source, edits) == source.replace('"fa3"', '"triton"', 1)


def test_a_function_in_two_modules_is_the_one_holding_the_anchor() -> None:
    files = {
        "a.py": "def f():\n    x = 1\n",
        "b.py": "def f():\n    y = 2\n",
    }
    edits = """
        [[intent.edit]]
        function = "f"
        insert_after = "y = 2"
        code = "z = 3"
    """
    result = apply("", edits, files)
    assert result.status == "resolved", result.detail
    assert result.changes == {"b.py": "def f():\n    y = 2\n    z = 3\n"}
    files["a.py"] = files["b.py"]
    result = apply("", edits, files)
    assert result.status == "not-found"
    assert "2 places fit (a.py, b.py)" in result.detail


def test_an_insert_upstream_already_has_is_upstreamed() -> None:
    source = "def f():\n    a = 1\n    c = 3\n"
    edits = """
        [[intent.edit]]
        function = "f"
        insert_after = "a = 1"
        code = "c = 3"
    """
    result = apply(source, edits)
    assert result.status == "upstreamed"
    assert "`c = 3` is there" in result.detail


def test_overlapping_edits_are_refused() -> None:
    source = "def f():\n    return x or y\n"
    edits = """
        [[intent.edit]]
        function = "f"
        replace = "x or y"
        by = "z"

        [[intent.edit]]
        function = "f"
        replace = "y"
        by = "x"
    """
    result = apply(source, edits)
    assert result.status == "not-found"
    assert "overlap" in result.detail


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ('function = "f"\n', "exactly one scope"),
        ('function = "f"\nmodel = "M"\nreplace = "a"\nby = "b"\n', "exactly one scope"),
        ('function = "f"\nreplace = "a"\nby = "b"\ncolour = "red"\n', "unknown key colour"),
        ('function = "f"\ninsert_at = "bottom"\ncode = "x"\n', '`insert_at` must be "top"'),
        ('function = "f"\nreplace = "a"\nby = ""\n', "`by` must be a non-empty string"),
        ('function = "f"\nreplace = "a"\nby = "b"\ncount = -1\n', "`count`"),
    ],
)
def test_malformed_edits_are_named(edit: str, message: str) -> None:
    text = f'[[intent]]\npatch = "p"\nsays = "s"\n[[intent.edit]]\n{edit}'
    with pytest.raises(FatalError, match=message):
        parse_intent(tomllib.loads(text)["intent"][0], "test")


def test_an_arch_test_matches_in_any_spelling_and_new_code_takes_the_modules() -> None:
    source = textwrap.dedent("""\
        from sglang.srt.runtime_context import get_platform


        def f(cfg):
            if get_platform().is_cuda and get_platform().is_sm100:
                cfg.backend = "trtllm_mha"
    """)
    edits = """
        [[intent.edit]]
        function = "f"
        add_elif_after = "is_cuda() and is_sm100_supported()"
        code = '''
        elif is_cuda() and is_sm120_supported():
            cfg.backend = "triton"
        '''

        [[intent.edit]]
        module_of = "f"
        import_beside = "is_sm100_supported"
        name = "is_sm120_supported"
    """
    result = apply(source, edits, {PATH: source})
    assert result.status == "resolved", result.detail
    assert result.changes[PATH] == source + (
        "    elif get_platform().is_cuda and get_platform().is_sm120:\n"
        '        cfg.backend = "triton"\n'
    )
    assert "is not needed" in result.detail  # no helper import where get_platform() tests


def test_new_code_reading_a_name_the_landing_place_lacks_does_not_fit() -> None:
    """The recipe was written for ServerArgs (`self.x = ...`); upstream's code became a
    function returning overrides: the anchor is there, the code could not run."""
    source = "def f(cfg):\n    if is_sm100:\n        cfg.backend = 'a'\n"
    edits = """
        [[intent.edit]]
        function = "f"
        add_elif_after = "is_sm100"
        code = '''
        elif is_sm120:
            self.backend = "triton"
        '''
    """
    result = apply(source, edits)
    assert result.status == "not-found"
    assert "its new code reads self, which def f lacks" in result.detail


def test_a_method_is_edited_where_the_file_has_it_whatever_its_lines_hold() -> None:
    """Positions come per method of a class (locate.Source.focus): a line inside a
    multi-line string keeps its own columns, the others the class's indentation."""
    source = '''\
        class ServerArgs:
            x: int = 1

            def f(self):
                note = """first
        second""" + q(is_blackwell())
                if x:
                    y()
    '''
    edits = """
        [[intent.edit]]
        function = "ServerArgs.f"
        replace = "is_blackwell()"
        by = "is_sm120()"

        [[intent.edit]]
        function = "ServerArgs.f"
        insert_after = "y()"
        code = "z()"
    """
    assert changed(source, edits) == textwrap.dedent(source).replace(
        "q(is_blackwell())", "q(is_sm120())"
    ).replace("            y()\n", "            y()\n            z()\n")


def test_functions_that_cannot_hold_an_edit_are_parsed_as_skeletons() -> None:
    """locate.Source.parse with `keep`: bodies of functions naming none of the scopes
    become `...`; the edit still lands byte for byte where the file has it."""
    source = textwrap.dedent('''\
        def other():
            """Doc."""
            return {"a": 1}


        class ServerArgs:
            def unrelated(self):
                x = 1
                return x

            def target(self):
                if x:
                    y()
    ''')
    parsed = Source.parse(PATH, HEADER + source, frozenset({"target"}))
    assert parsed is not None
    assert "return x" not in parsed.module.code and "return {" not in parsed.module.code
    assert "y()" in parsed.module.code
    [unrelated] = [
        m for m in parsed.members if isinstance(m, cst.FunctionDef) and m.name.value == "unrelated"
    ]
    with pytest.raises(ValueError, match="not parsed"):
        parsed.focus(unrelated)
    edits = """
        [[intent.edit]]
        function = "ServerArgs.target"
        insert_after = "y()"
        code = "z()"
    """
    assert changed(source, edits) == source.replace(
        "            y()\n", "            y()\n            z()\n"
    )
