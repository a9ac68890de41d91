"""A forced tool call's grammar, in both call formats, drives the real sampler (random logits, the
default model's tokenizer): whatever it draws parses into a call whose arguments fit the schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.step.sampler import Sampler
from ballast.engine.text.grammar import GrammarCompiler
from ballast.engine.text.tokenizer import Tokenizer
from ballast.models.weights.default_model import default_model_path
from ballast.models.weights.gguf_loader import build_tokenizer, read_gguf
from ballast.server import protocol as p
from ballast.server.toolcalls import parse
from ballast.server.toolgrammar import style_of, tool_call_lark

# Random logits stand in for a model, so the sampled calls use values that end by themselves
# (enums, bounded integers, booleans); strings are checked by acceptance below.
TIGHT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "alerts": {"type": "boolean"},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
CODE: dict[str, Any] = {
    "type": "object",
    "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}$"}},
    "required": ["id"],
}
# What pydantic writes for a nested model: the inner model under $defs, reached by $ref; draft-07
# schemas say `definitions`.
NESTED: dict[str, Any] = {
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "origin": {"$ref": "#/$defs/Place"},
        "stops": {"type": "array", "items": {"$ref": "#/$defs/Place"}, "maxItems": 2},
    },
    "required": ["origin", "stops"],
    "additionalProperties": False,
}
DRAFT7 = json.loads(json.dumps(NESTED).replace("$defs", "definitions"))
SCHEMAS = {"tight": TIGHT, "get_weather": WEATHER, "lookup": CODE, "nested": NESTED, "draft7": DRAFT7}
TOOLS = {
    name: p.Tool.model_validate({"type": "function", "function": {"name": name, "parameters": schema}})
    for name, schema in SCHEMAS.items()
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_tokenizer(read_gguf(default_model_path()).metadata))


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids)


def draw(tok: Tokenizer, compiler: GrammarCompiler, lark: str, seed: int, steps: int = 80) -> str:
    params = SamplingParams(
        temperature=1.0, seed=seed, constraint=compiler.constraint(compiler.lark(lark), 0)
    )
    sampler = Sampler(num_slots=1, vocab_size=tok.vocab_size, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        [d] = sampler.sample(torch.randn(1, tok.vocab_size, generator=gen) * 3, [0], [params])
        if d.token_id in tok.eos_token_ids:
            return tok.decode(out)
        out.append(d.token_id)
    raise AssertionError(f"the grammar did not finish in {steps} tokens: {tok.decode(out)!r}")


def accepts(tok: Tokenizer, compiler: GrammarCompiler, lark: str, text: str) -> bool:
    matcher = compiler.constraint(compiler.lark(lark), 0).matcher()
    return bool(matcher.consume_tokens(tok.encode(text, add_special_tokens=False))) and matcher.is_accepting()


@pytest.mark.parametrize("style", ["xml", "hermes"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_sampled_forced_call_parses_and_fits_its_schema(
    tok: Tokenizer, compiler: GrammarCompiler, style: str, seed: int
) -> None:
    text = draw(
        tok,
        compiler,
        tool_call_lark([TOOLS["tight"]], "xml" if style == "xml" else "hermes", several=False),
        seed,
    )
    assert text.startswith(
        "<tool_call>\n<function=tight>\n" if style == "xml" else '<tool_call>\n{"name": "tight"'
    )
    content, [call] = parse(text, SCHEMAS)
    assert content is None and call.name == "tight"
    jsonschema.validate(json.loads(call.arguments), TIGHT)


def test_xml_calls_take_raw_multiline_strings_in_schema_order(
    tok: Tokenizer, compiler: GrammarCompiler
) -> None:
    lark = tool_call_lark([TOOLS["get_weather"]], "xml", several=False)
    good = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert accepts(tok, compiler, lark, good)
    assert json.loads(parse(good, SCHEMAS)[1][0].arguments) == {"city": "New\nYork", "days": 3}
    assert accepts(
        tok, compiler, lark, good.replace("<parameter=days>\n3\n</parameter>\n", "")
    )  # days is optional
    assert not accepts(
        tok, compiler, lark, good.replace("<parameter=city>\nNew\nYork\n</parameter>\n", "")
    )  # city is not
    assert not accepts(tok, compiler, lark, good.replace("\n3\n", "\nthree\n"))
    assert not accepts(tok, compiler, lark, good.replace("days", "weeks"))
    swapped = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    )
    assert not accepts(tok, compiler, lark, swapped)


def test_a_schema_the_xml_form_cannot_state_is_asked_for_as_json(
    tok: Tokenizer, compiler: GrammarCompiler
) -> None:
    lark = tool_call_lark([TOOLS["lookup"]], "xml", several=False)
    assert accepts(
        tok, compiler, lark, '<tool_call>\n{"name": "lookup", "arguments": {"id": "abc"}}\n</tool_call>'
    )
    assert not accepts(
        tok, compiler, lark, '<tool_call>\n{"name": "lookup", "arguments": {"id": "abcd"}}\n</tool_call>'
    )
    assert not accepts(
        tok,
        compiler,
        lark,
        "<tool_call>\n<function=lookup>\n<parameter=id>\nabc\n</parameter>\n</function>\n</tool_call>",
    )


def test_several_calls_only_when_asked(tok: Tokenizer, compiler: GrammarCompiler) -> None:
    one = '<tool_call>\n{"name": "tight", "arguments": {"unit": "c", "days": 2}}\n</tool_call>'
    assert accepts(tok, compiler, tool_call_lark([TOOLS["tight"]], "hermes", several=True), one + "\n" + one)
    assert not accepts(
        tok, compiler, tool_call_lark([TOOLS["tight"]], "hermes", several=False), one + "\n" + one
    )


def test_the_style_follows_the_template() -> None:
    assert style_of("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}") == "xml"
    assert style_of('{{- \'<tool_call>\\n{"name": "\' }}') == "hermes"
    assert style_of(None) == "hermes"


@pytest.mark.parametrize("style", ["xml", "hermes"])
@pytest.mark.parametrize("name", ["nested", "draft7"])
def test_definitions_and_references_hold_in_a_forced_call(
    tok: Tokenizer, compiler: GrammarCompiler, style: str, name: str
) -> None:
    text = draw(tok, compiler, tool_call_lark([TOOLS[name]], style, several=False), seed=1, steps=160)  # type: ignore[arg-type]
    content, [call] = parse(text, SCHEMAS)
    assert content is None and call.name == name
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[name])
