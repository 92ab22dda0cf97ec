"""The `/v1/responses` request body (OpenAI's Responses API), as a pydantic model.

As for completions and chat (router/http/schemas.py), options pdserve does not implement are
declared, so that a value other than their neutral one is a 400 naming them
(router/http/responses.py); other unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class InputPart(BaseModel):
    """A content part of an input message: `input_text` (or `output_text`, an earlier
    assistant turn given back as input)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class InputItem(BaseModel):
    """An input item: a message (`{"role", "content"}`, `type` "message" or unset), or a
    `function_call` / `function_call_output`, whose fields (`call_id`, `name`, `arguments`,
    `output`) are extras, read by router/http/response_prompt.py."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}
    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # unset = the served model
    # Unset: only with previous_response_id (the conversation continues with no new message).
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    store: bool = True  # as OpenAI: kept unless the client says not to
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # pdserve's (as on chat): the seed of sampling.
    seed: int | None = None
    # Function tools, flat (router/http/response_tools.py); a named choice is
    # {"type": "function", "name": ...}. Unset parallel_tool_calls: true.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Not implemented: refused unless neutral.
    background: bool = False
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
