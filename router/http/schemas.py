"""The OpenAI request bodies pdserve accepts, as pydantic models.

Fields pdserve does not implement are declared anyway, so that setting one to anything but its
neutral value is a 400 naming it (router/http/translate.py) rather than silently ignored.
pdserve's own options (`top_k`, `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `return_token_ids`, and the
decoding rules: `beam_width`, `length_penalty`, `early_stopping`, `repetition_penalty`,
`dola_layers`, `sled`, `sled_layers`, `evolution_*`; `disable_speculation`; structured output's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`) are extra body fields, under vLLM's names
where vLLM has them; other unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_MESSAGES = 1024  # messages of one chat (each is a turn of the conversation)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk
    # pdserve's: every token its own event, though the worker sent several at once (as
    # `--stream-one-token-per-event` does for every stream).
    one_token_per_event: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # as vLLM: unset = the served model
    max_tokens: int | None = None
    min_tokens: int | None = None  # vLLM's: stop tokens and strings count only after this many
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None  # vLLM's: keep tokens at least min_p x the top token's probability
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # pdserve extensions (vLLM's names): -1 or 0 = top_k off.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # each choice carries its token ids (and the prompt's)
    # Decoding rules (pdserve.v1.SamplingParams documents each): beam search returns the best
    # n beams; DoLa / SLED layers are "low", "high" or layer indices.
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool = False
    repetition_penalty: float | None = None
    dola_layers: str | list[int] | None = None
    sled: bool = False
    sled_layers: str | list[int] | None = None
    evolution_rate: float | None = None
    evolution_scale: int | None = None
    evolution_lower_bound: float | None = None
    # Opt out of the server's speculative decoding (pdserve.v1.SamplingParams documents it).
    disable_speculation: bool = False
    # Structured output (pdserve.v1.Grammar): OpenAI's response_format, or one of vLLM's
    # guided_json (a schema), guided_regex, guided_choice, guided_grammar (EBNF).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    # A text, a list of texts, a list of token ids, or a list of token id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Other fields (name, tool_call_id, reasoning_content...) go to the template as given.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # unset: "auto" with tools
    parallel_tool_calls: bool | None = None  # unset: true (several calls in one answer)
    # OpenAI's deprecated forms of tools and tool_choice: refused by name (use tools).
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM extensions: the template's generation prompt, and extra template variables.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
