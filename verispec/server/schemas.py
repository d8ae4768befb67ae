"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Parameters OpenAI defines but verispec does not implement are accepted only at their no-op values
(``best_of: 1``, ``logprobs: false``, penalties 0, ...) and rejected otherwise, so a client never gets a silently
different answer from what it asked for. Unknown parameters are rejected too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool,
                      WithJsonSchema, field_validator, model_validator)

from ..text import NOT_SPACE, has_text


def _no_text_or_bool(value):
    # pydantic's lax mode would turn "0.5" or true into a number; OpenAI's API does not
    if isinstance(value, (str, bool)):
        raise ValueError("must be a number")
    return value


Number = Annotated[float, BeforeValidator(_no_text_or_bool)]


def _integral(value):
    # JSON Schema counts 5.0 as an integer; text and booleans are not
    if isinstance(value, (str, bool)):
        raise ValueError("must be an integer")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value



def _has_text(value: str) -> str:
    if not has_text(value):
        raise ValueError("must contain some text, not only whitespace")
    return value


# a string with at least one non-space character (the schema says so with a pattern)
Text = Annotated[str, AfterValidator(_has_text), WithJsonSchema({"type": "string", "pattern": NOT_SPACE})]
Stop = Annotated[str, Field(min_length=1, max_length=256)]  # OpenAI's: up to 4 of them

# name -> the values at which the parameter changes nothing (then it is accepted and ignored)
UNSUPPORTED_UNLESS = {
    "best_of": (1,),
    "logprobs": (False, None),
    "top_logprobs": (0, None),
    "echo": (False,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "reasoning_effort": (),
    "audio": (),
    "prediction": (),
}
IGNORED = {"user", "metadata"}  # harmless bookkeeping fields


def _same(a, b) -> bool:
    """JSON equality: false is not 0, 0 is 0.0 (Python's == says False == 0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


class SpeculationOptions(BaseModel):
    """The ``verispec`` extension field of a request."""

    model_config = ConfigDict(extra="forbid")

    speculation: StrictBool = Field(True, description="false decodes this request plainly")
    drafter: str | None = Field(None, description="a drafter the server was started with, or 'none'")
    k: int | None = Field(None, ge=1, le=64, description="most draft tokens per step")

    _k = field_validator("k", mode="before")(lambda v: _integral(v))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None
    n: int = Field(1, ge=1, le=64, description="choices to generate: samples of the same prompt, prefilled once, "
                                             "decoded as rows of one batch, each drafting from the others' text")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    verispec: SpeculationOptions = Field(default_factory=SpeculationOptions)

    _common_integers = field_validator("max_tokens", "seed", "n", mode="before")(lambda v: _integral(v))

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            if name not in UNSUPPORTED_UNLESS:
                raise ValueError(f"unknown parameter '{name}'")
            if not any(_same(value, allowed) for allowed in UNSUPPORTED_UNLESS[name]):
                raise ValueError(f"parameter '{name}' = {value!r} is not supported by this server; "
                                 f"remove it or use {UNSUPPORTED_UNLESS[name][0]!r}" if UNSUPPORTED_UNLESS[name]
                                 else f"parameter '{name}' is not supported by this server; remove it")
        return self  # stream_options without stream: true is ignored


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = Field(None, max_length=64, description="the participant's name (at most 64 characters)")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    _chat_integers = field_validator("max_completion_tokens", mode="before")(lambda v: _integral(v))

    def chat(self) -> list[dict[str, Any]]:
        # SmolLM2-style templates know "system"; OpenAI's newer "developer" role means the same
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: (Text | Annotated[list[Text], Field(min_length=1, json_schema_extra={"maxItems": 1})]
             | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)])

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, v):
        if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            return [_integral(x) for x in v]
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported (batch prompts: send one request "
                                     "each)")
                return v[0]
        return v

    def token_limit(self) -> int | None:
        return self.max_tokens


class SpeculationSwitch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool


# ----------------------------------------------------------------------------- responses (documented in /openapi.json)
class ErrorBody(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, authentication_error, "
                                  "rate_limit_error, client_closed_request or server_error")
    param: str | None = Field(None, description="the request parameter at fault, when there is one")
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class _Response(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str
    usage: Usage
    verispec: dict[str, Any] = Field(description="this request's speculative-decoding stats: drafter, k, "
                                                 "acceptance, tokens per step, timings")


class ChatCompletion(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class Completion(_Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "shutting_down", "worker_stopped"] = Field(
        description="ok; else why generation requests are refused (the answer is then a 503)")
    model: str
    speculation: bool
    default_drafter: str
    drafters: list[str]
    k: int
    k_policy: Literal["cost", "fixed"]
    running: int
    queued: int
    admitted: int
    capacity: int
    max_batch: int
    # the target's one-token step: compiled, eager, or (--compile auto) compiling in the background or failed
    compiled_step: Literal["eager", "compiling", "compiled", "failed"]


class SpeculationState(BaseModel):
    enabled: bool
