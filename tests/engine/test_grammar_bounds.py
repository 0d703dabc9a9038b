"""engine.grammar_bounds: a grammar's shape is measured before the compiler recurses on it, and
the compiler runs on a stack deep enough for what passes."""

import subprocess
import sys

import pytest
from gptserve.engine import grammar_bounds as bounds
from gptserve.engine.grammar import GrammarError, compile_constraint
from gptserve.engine.sequence import GRAMMAR_ERROR
from gptserve.model.tokenizers import load_tokenizer


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def ref_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_ordinary_and_recursive_grammars_pass() -> None:
    bounds.check_lark('start: item ("," item)*\nitem: NUMBER | "[" start "]"\nNUMBER: /[0-9]+/\n')
    bounds.check_lark(lark_chain(bounds.MAX_RULE_DEPTH - 2))
    bounds.check_gbnf(
        'root ::= list\nlist ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9]+ | list\n'
    )
    bounds.check_schema({"type": "object", "properties": {"next": {"$ref": "#"}}})
    bounds.check_schema(ref_chain(bounds.MAX_REF_DEPTH - 2))


@pytest.mark.parametrize(
    "check, value, says",
    [
        (bounds.check_lark, lark_chain(bounds.MAX_RULE_DEPTH), "nest more than"),
        (
            bounds.check_lark,
            lark_chain(bounds.MAX_RULES + 1),
            f"more than {bounds.MAX_RULES} rules",
        ),
        (bounds.check_gbnf, gbnf_chain(bounds.MAX_RULE_DEPTH), "nest more than"),
        (bounds.check_gbnf, gbnf_chain(5_000), "rules"),
        (bounds.check_schema, ref_chain(bounds.MAX_REF_DEPTH), "$ref chains"),
        (bounds.check_gbnf, 'root ::= ab{600}\nab ::= "a"{600}\n', "repetitions multiply"),
        (bounds.check_lark, 'start: ab{2,400}\nab: c{300}\nc: "x"\n', "repetitions multiply"),
        (bounds.check_lark, 'start: ab{300} | c{300}\nab: "a"{300}\nc: start\n', None),
        (bounds.check_schema, {"items": [[[[[[[[{"a": [1]}]]]]]]]] * 1}, None),
    ],
)
def test_past_a_bound_is_too_costly(check, value, says) -> None:  # noqa: ANN001
    if says is None:  # within the bounds: shallow
        check(value)
        return
    with pytest.raises(bounds.TooCostly, match=says.replace("$", r"\$")):
        check(value)


def test_nesting_is_bounded_without_recursion() -> None:
    schema: dict = {"type": "string"}
    for _ in range(20_000):  # deeper than Python's own recursion limit
        schema = {"type": "array", "items": schema}
    with pytest.raises(bounds.TooCostly, match="nests more than"):
        bounds.check_schema(schema)


def test_the_engine_refuses_them_as_too_costly() -> None:
    tok = load_tokenizer("gpt2")
    for kind, spec in [("lark", lark_chain(3_000)), ("json", ref_chain(5_000))]:
        with pytest.raises(GrammarError) as info:
            compile_constraint(kind, spec, tok)
        assert info.value.code == GRAMMAR_ERROR
        assert info.value.message.startswith("too costly to compile")


def test_on_deep_stack_hands_back_the_value_or_the_error() -> None:
    assert bounds.on_deep_stack(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError):
        bounds.on_deep_stack(lambda: {}["missing"])


def test_a_chain_past_an_ordinary_stack_compiles_on_the_deep_one() -> None:
    """3,000 chained rules overflow an 8 MB stack in the compiler (SIGSEGV). With the bounds
    lifted, the compile thread's stack holds them: in a child process, in case it does not."""
    child = (
        "from gptserve.engine import grammar_bounds as b, grammar as g\n"
        "from gptserve.model.tokenizers import load_tokenizer\n"
        "b.MAX_RULES = b.MAX_RULE_DEPTH = 10**6\n"
        f"g.compile_constraint('lark', {lark_chain(3_000)!r}, load_tokenizer('gpt2'))\n"
        "print('compiled')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "compiled" in done.stdout, (
        done.returncode,
        done.stderr[-2000:],
    )
