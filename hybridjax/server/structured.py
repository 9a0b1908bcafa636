"""Which grammar a request decodes under (hybridjax.grammar): `response_format` json_object /
json_schema, or a forced tool call (`tool_choice` "required" or a named function) whose
arguments must match the tool's `parameters` schema. With `tool_choice` "auto" the model may
answer in text or call a tool, and calls are parsed, not constrained.

`grammar_for` returns the grammar and the parameter it came from, so that one the engine cannot
compile is a 400 naming that parameter (`checked`). With a tokenizer llguidance cannot read,
`response_format` JSON is a 400 and a forced tool call keeps only its forced opening.
"""

from __future__ import annotations

from hybridjax.grammar import GrammarError, UnsupportedTokenizer, json_schema_grammar, tool_call_grammar


def grammar_for(response_format, tools=None, tool_choice=None, xml_calls: bool = False) -> tuple[str, str] | None:
    """(grammar, parameter) for a request, or None when it is unconstrained. `tools` are the
    request's Tool models (already filtered by tool_choice "none"); `xml_calls`: the template
    writes calls in Qwen3.5's XML layout, whose forced calls are opened but not constrained yet."""
    forced = tools and (tool_choice == "required" or isinstance(tool_choice, dict))
    if forced and xml_calls:
        return None
    if forced:
        if response_format is not None and response_format.type != "text":
            raise GrammarError("response_format cannot be combined with a forced tool_choice")
        name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        defs = [{"name": t.function.name, "parameters": t.function.parameters} for t in tools]
        return tool_call_grammar(defs, name, ""), "tools"
    if response_format is None or response_format.type == "text":
        return None
    return json_schema_grammar(response_format.constraint_schema()), "response_format"


def checked(engine, request_grammar: tuple[str, str] | None) -> str | None:
    """The grammar after the engine's compiler accepted it; GrammarError (with `.param`) if not."""
    if request_grammar is None:
        return None
    grammar, param = request_grammar
    try:
        engine.grammars.check(grammar)
    except UnsupportedTokenizer:
        if param == "tools":  # a forced call keeps its forced opening, as without a grammar engine
            return None
        raise
    except GrammarError as e:
        e.param = param
        raise
    return grammar
