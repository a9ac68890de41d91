"""The clients of 2026 against a real server running the default model (SmolLM2-135M-Instruct) on
CPU, through their official SDKs: anthropic (Messages), openai (Responses, pydantic tools,
streamed tool arguments), the OpenAI Agents SDK's default model, instructor's TOOLS mode; and the
fixes that came with them (the EOS token's logprob, /tokenizer_info, CORS, error shapes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import httpx
import instructor
import jsonschema
import openai
import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from pydantic import BaseModel, Field
from serverproc import running_server

pytestmark = pytest.mark.slow

KEY = "sekrit"
ORIGIN = "https://app.example.com"
CITY: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK = "What is the weather in Paris?"
# anthropic 2.x no longer takes temperature (Claude models fix it); the server still honours it.
GREEDY: dict[str, Any] = {"temperature": 0}


class Place(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]


class Trip(BaseModel):
    """A trip from one place, for some days."""

    origin: Place
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    config = EngineConfig(
        model="default",
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_model_len=1024,
        prefill_chunk_tokens=256,
    )
    server = ServerConfig(api_key=KEY, allowed_origins=ORIGIN)
    app = create_app(server, SchedulerConfig(), lambda: Engine.load(config), model_aliases=("default",))
    with running_server(app, timeout_s=180) as url:
        yield url


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)


# --- Anthropic Messages -----------------------------------------------------------------------


def test_messages_plain_and_streamed_agree(claude: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Say hello."}]
    whole = claude.messages.create(
        model="default", max_tokens=12, messages=ask, system="Be brief.", extra_body=GREEDY
    )
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens <= 12
    with claude.messages.stream(
        model="default", max_tokens=12, messages=ask, system="Be brief.", extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == block.text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.usage.output_tokens == whole.usage.output_tokens
    count = claude.messages.count_tokens(model="default", messages=ask, system="Be brief.")
    assert count.input_tokens == whole.usage.input_tokens


def test_messages_stop_sequence_is_named(claude: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Count from 1 to 9, separated by commas."}]
    msg = claude.messages.create(
        model="default", max_tokens=40, messages=ask, stop_sequences=["4"], extra_body=GREEDY
    )
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "4")
    assert "4" not in msg.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_forced_tool_use_validates(claude: anthropic.Anthropic, stream: bool) -> None:
    tools: Any = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}]
    kwargs: Any = dict(
        model="default",
        max_tokens=40,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": ASK}],
    )
    if stream:
        with claude.messages.stream(**kwargs) as s:
            deltas = [
                e.delta.partial_json
                for e in s
                if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
            ]  # type: ignore[union-attr]
            msg = s.get_final_message()
        assert len(deltas) > 1 and json.loads("".join(deltas)) == msg.content[0].input  # type: ignore[union-attr]
    else:
        msg = claude.messages.create(**kwargs)
    [use] = msg.content
    assert use.type == "tool_use" and use.name == "get_weather" and msg.stop_reason == "tool_use"
    jsonschema.validate(use.input, CITY)
    # The call and its result go back as the next turn.
    follow = claude.messages.create(
        model="default",
        max_tokens=8,
        messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
            },
        ],
    )
    assert follow.content[0].type == "text"


def test_messages_errors_have_anthropics_shape(base_url: str, claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(
            model="default",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )  # type: ignore[list-item]
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "text only" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    no_max = httpx.post(
        f"{base_url}/v1/messages", headers={"x-api-key": KEY}, json={"model": "default", "messages": []}
    )
    assert no_max.status_code == 400 and no_max.json()["error"]["type"] == "invalid_request_error"
    wrong = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="default", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


# --- OpenAI Responses and the Agents SDK --------------------------------------------------------


def test_responses_plain_and_streamed_agree(oai: openai.OpenAI) -> None:
    whole = oai.responses.create(
        model="default", input="Say hello.", instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    assert whole.output_text and whole.status in ("completed", "incomplete") and whole.usage is not None
    with oai.responses.stream(
        model="default", input="Say hello.", instructions="Be brief.", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.output_text == whole.output_text  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_call(oai: openai.OpenAI, stream: bool) -> None:
    tools: Any = [
        {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY}
    ]
    kwargs: Any = dict(
        model="default",
        input=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    if stream:
        with oai.responses.stream(**kwargs) as s:
            events = list(s)
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        response = events[-1].response  # type: ignore[union-attr]
    else:
        response = oai.responses.create(**kwargs)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    if stream:
        assert deltas == call.arguments


def test_responses_refuse_stored_state(oai: openai.OpenAI) -> None:
    for extra in ({"store": True}, {"previous_response_id": "resp_1"}):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.responses.create(model="default", input="x", max_output_tokens=2, **extra)  # type: ignore[arg-type]
        assert "keeps no responses" in refused.value.message and refused.value.param in extra
    with pytest.raises(openai.BadRequestError) as image:
        oai.responses.create(
            model="default", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
        )  # type: ignore[list-item]
    assert image.value.param == "input[0].content[0]"


def test_an_agent_runs_its_tool_to_a_final_output(base_url: str) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer in one short sentence.",
        model=OpenAIResponsesModel(model="default", openai_client=client),
        # Forced for the first turn only (the SDK resets it once a tool ran), so the small model
        # calls the tool, then answers in text; room enough for the answer to end by itself (the
        # SDK takes an answer cut off by max_tokens, `response.incomplete`, as a failure).
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0
        ),
        tools=[get_weather],
    )
    result = asyncio.run(Runner.run(agent, ASK, max_turns=3))
    assert seen and isinstance(result.final_output, str) and result.final_output


# --- Chat completions: pydantic tools, instructor, streamed arguments, truncated calls ----------


def test_a_nested_pydantic_tool_is_called_validly(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Plan a 3 day trip from Rome."}],
        tools=[openai.pydantic_function_tool(Trip)],
        tool_choice="required",
        parallel_tool_calls=False,  # else the grammar lets it go on calling up to max_tokens
        max_tokens=60,
    )
    [call] = completion.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Trip)  # type: ignore[union-attr]


def test_instructor_tools_mode_returns_the_model(oai: openai.OpenAI) -> None:
    client = instructor.from_openai(oai, mode=instructor.Mode.TOOLS)
    trip = client.chat.completions.create(
        model="default",
        response_model=Trip,
        messages=[{"role": "user", "content": "Plan a 3 day trip from Rome."}],
        max_tokens=60,
        max_retries=0,
    )
    assert isinstance(trip, Trip)


def test_streamed_argument_deltas_add_up_to_the_call(oai: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    stream = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": ASK}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        stream=True,
    )
    pieces, names, reasons = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                names += [delta.function.name] if delta.function and delta.function.name else []
                pieces += [delta.function.arguments] if delta.function and delta.function.arguments else []
    assert names == ["get_weather"] and len(pieces) > 1 and reasons[-1] == "tool_calls"
    jsonschema.validate(json.loads("".join(pieces)), CITY)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_off_is_returned_as_a_call(oai: openai.OpenAI, stream: bool) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    kwargs: Any = dict(
        model="default",
        messages=[{"role": "user", "content": ASK}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=6,
    )
    if stream:
        content, arguments, names, reason = "", "", [], None
        for chunk in oai.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                names += [call.function.name] if call.function and call.function.name else []
                arguments += call.function.arguments or "" if call.function else ""
            reason = chunk.choices[0].finish_reason or reason
    else:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        content, reason = choice.message.content or "", choice.finish_reason
        names = [c.function.name for c in choice.message.tool_calls or ()]  # type: ignore[union-attr]
    assert (content, names, reason) == ("", ["get_weather"], "length")


# --- Scores, tokenizer, CORS, error spelling ---------------------------------------------------


def test_every_generated_token_has_its_logprob_eos_included(oai: openai.OpenAI) -> None:
    prompt = "Question: What is 9 - 3?\nAnswer: 6"
    for _ in range(2):  # the prefix cache's second pass must score the same way
        done = oai.completions.create(
            model="default", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1
        )
        assert done.usage is not None and done.choices[0].logprobs is not None
        entries = done.choices[0].logprobs.token_logprobs or []
        assert done.choices[0].finish_reason == "stop"  # the model's next token is its EOS
        assert len(entries) == done.usage.prompt_tokens + done.usage.completion_tokens
    chat = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Say OK."}],
        max_tokens=40,
        temperature=0,
        logprobs=True,
    )
    assert chat.usage is not None and chat.choices[0].logprobs is not None
    assert len(chat.choices[0].logprobs.content or []) == chat.usage.completion_tokens


def test_tokenizer_info_cors_and_route_errors(base_url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(f"{base_url}/tokenizer_info", headers=auth).json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    preflight = httpx.options(
        f"{base_url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    stranger = httpx.options(
        f"{base_url}/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in stranger.headers
    missing = httpx.post(f"{base_url}/v1/nothing", headers=auth, json={})
    assert missing.status_code == 404 and "/v1/nothing" in missing.json()["error"]["message"]
    bad = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers=auth,
        json={"model": "default", "messages": [{"role": "wizard", "content": "x"}], "top_logprobs": 2},
    ).json()["error"]
    assert bad["param"] == "messages[0].role"
    lone = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers=auth,
        json={"model": "default", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    ).json()["error"]
    assert lone["param"] == "top_logprobs" and not lone["message"].startswith("Value error")
