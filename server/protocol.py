"""Pydantic models of the OpenAI API subset ballast serves.

Requests validate ranges here, so a bad value is a 400 naming its parameter before any work is
done. Fields with no effect on the answer (user, metadata, store, ...) are accepted; every field
that would change the answer is either honoured or refused with a 400 naming it (`REFUSED`): an
unknown field is kept in `model_extra` so the handlers can check it against that list.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

NonNegFloat = Annotated[float, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


# Fields clients send that would change the answer and that ballast does not implement, with
# what to use instead. Anything else unknown has no effect on the answer and is accepted.
REFUSED: dict[str, str] = {
    "functions": "the legacy `functions` parameter is not supported; use `tools`",
    "function_call": "the legacy `function_call` parameter is not supported; use `tool_choice`",
    "guided_json": '`guided_json` is not supported; use response_format {"type": "json_schema"}',
    "guided_regex": "`guided_regex` is not supported",
    "guided_choice": (
        '`guided_choice` is not supported; use response_format {"type": "json_schema"} with an enum'
    ),
    "guided_grammar": "`guided_grammar` is not supported",
    "structured_outputs": "`structured_outputs` is not supported; use response_format",
    "audio": "this model takes and gives text only",
    "modalities": "this model takes and gives text only",
    "prediction": "`prediction` (predicted outputs) is not supported",
    "min_tokens": "`min_tokens` is not supported",
    "ignore_eos": "`ignore_eos` is not supported",
    "stop_token_ids": "`stop_token_ids` is not supported; use `stop`",
    "include_stop_str_in_output": "`include_stop_str_in_output` is not supported",
    "reasoning_effort": "`reasoning_effort` is not supported",
    "web_search_options": "`web_search_options` is not supported",
    "chat_template": "`chat_template` is not supported; the model's own template is used",
    "add_generation_prompt": "`add_generation_prompt` is not supported",
    "continue_final_message": "`continue_final_message` is not supported",
    "documents": "`documents` is not supported",
    "prompt_logprobs": "`prompt_logprobs` is not supported",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "`length_penalty` (beam search) is not supported",
    "bad_words": "`bad_words` is not supported; use logit_bias",
    "allowed_token_ids": "`allowed_token_ids` is not supported; use logit_bias or response_format",
    "truncate_prompt_tokens": "`truncate_prompt_tokens` is not supported",
    "logits_processors": "`logits_processors` is not supported",
    # Parameters of the other endpoint: declared there, so they reach this list only here.
    "echo": "`echo` is only supported by /v1/completions",
    "suffix": "`suffix` is not supported",
    "best_of": "`best_of` is only supported by /v1/completions (equal to n)",
    "response_format": "`response_format` is only supported by /v1/chat/completions",
    "tools": "`tools` are only supported by /v1/chat/completions",
    "tool_choice": "`tool_choice` is only supported by /v1/chat/completions",
}


# Every generated token is matched against every stop sequence (and the text held back for a
# match that may still complete), on the event loop: an unbounded list from one request stalled
# every stream (100,000 strings cost 80 ms a token). OpenAI allows 4; agent frameworks send a few
# more (one per role marker), so 16, of at most 256 characters, a stop string being a marker,
# not a passage.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256


class ParamError(ValueError):
    """A check across fields that names the parameter at fault (a model validator has no field
    of its own to point at)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    def refused_field(self) -> tuple[str, str] | None:
        """The first field this request sets that would change the answer and is not implemented."""
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED and value not in (None, False, [], {}):
                return name, REFUSED[name]
        return None


class StreamOptions(_Request):
    include_usage: bool = False


class GenerationFields(_Request):
    """Parameters shared by both generation endpoints."""

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off (vLLM's convention)
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
            longest = max((len(s) for s in stops), default=0)
            raise ValueError(
                f"at most {MAX_STOP_SEQUENCES} stop sequences of at most {MAX_STOP_CHARS} characters "
                f"each (got {len(stops)}, the longest {longest} characters)"
            )
        return stop

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> GenerationFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Request):
    type: str  # only "text" is served; image_url, input_audio, file get "this model takes text only"
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # An assistant turn's thinking, under either name clients send it by; the template gets it as
    # `reasoning_content` (what the thinking families' templates read).
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # Extra variables for the chat template (`enable_thinking` for the Qwen3 family).
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self


# --- vLLM's /tokenize and /detokenize --------------------------------------------------------------


class TokenizeRequest(_Request):
    """Either `prompt` (raw text) or `messages` (a chat, through the template), as vLLM takes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must hold at least one message")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
