"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Parameters OpenAI defines but verispec does not implement are accepted only at their no-op values
(``n: 1``, ``logprobs: false``, penalties 0, ...) and rejected otherwise, so a client never gets a silently
different answer from what it asked for. Unknown parameters are rejected too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, field_validator,
                      model_validator)


def _no_text_or_bool(value):
    # pydantic's lax mode would turn "0.5" or true into a number; OpenAI's API does not
    if isinstance(value, (str, bool)):
        raise ValueError("must be a number")
    return value


Number = Annotated[float, BeforeValidator(_no_text_or_bool)]

# name -> the values at which the parameter changes nothing (then it is accepted and ignored)
UNSUPPORTED_UNLESS = {
    "n": (1,),
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


class SpeculationOptions(BaseModel):
    """The ``verispec`` extension field of a request."""

    model_config = ConfigDict(extra="forbid")

    speculation: StrictBool = Field(True, description="false decodes this request plainly")
    drafter: str | None = Field(None, description="a drafter the server was started with, or 'none'")
    k: StrictInt | None = Field(None, ge=1, le=64, description="most draft tokens per step")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    verispec: SpeculationOptions = Field(default_factory=SpeculationOptions)

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
            if value not in UNSUPPORTED_UNLESS[name]:
                raise ValueError(f"parameter '{name}' = {value!r} is not supported by this server; "
                                 f"remove it or use {UNSUPPORTED_UNLESS[name][0]!r}" if UNSUPPORTED_UNLESS[name]
                                 else f"parameter '{name}' is not supported by this server; remove it")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    def chat(self) -> list[dict[str, Any]]:
        # SmolLM2-style templates know "system"; OpenAI's newer "developer" role means the same
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[StrictInt]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is empty")
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
