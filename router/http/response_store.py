"""Stored responses of `/v1/responses`, in Redis: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns.

One key per response, `pdserve:response:<id>`, a JSON record written once with a TTL
(`--response-ttl`): the Response object as answered, the conversation it ended (every earlier
turn's input and output, without instructions, which OpenAI does not carry over), and the
turn's prompt as text and token ids with the output's token ids, so that the next turn's prompt
can start with exactly the tokens whose KV the worker holds (router/http/response_prompt.py).
A record is at most `--response-max-bytes`: a request whose conversation would be stored larger
is refused before it runs, never cut short. The Redis is the prefix index's; a Redis that does
not answer makes the responses that need it 503s, and the rest of the server serves on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import redis.asyncio

from pdserve.prefix_index.redis_link import connect_async

_KEY = "pdserve:response:"
_SOCKET_TIMEOUT_S = 1.0


class StoreUnavailable(Exception):
    """Redis did not answer: 503."""


class ResponseNotFound(LookupError):
    """No stored response has this id (never stored, store=false, deleted or expired): 404."""


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as answered
    # The conversation so far, this turn's output included, as chat messages.
    conversation: list[dict[str, Any]]
    prompt_text: str  # this turn's prompt as rendered by the chat template
    prompt_ids: list[int]  # ...and as the tokens the worker computed
    output_ids: list[int] = field(default_factory=list)  # the output's tokens, a stop token too

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"))


class ResponseStore:
    def __init__(self, redis_url: str, ttl_s: int, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._url = redis_url
        self._client: redis.asyncio.Redis | None = None  # made on the router's loop

    def size(self, record: StoredResponse) -> int:
        """The record's size in Redis: its UTF-8 JSON."""
        return len(record.to_json().encode("utf-8"))

    async def put(self, record: StoredResponse) -> None:
        key = _KEY + record.response["id"]
        await self._call(lambda client: client.set(key, record.to_json(), ex=self.ttl_s))

    async def get(self, response_id: str) -> StoredResponse:
        raw = await self._call(lambda client: client.get(_KEY + response_id))
        if raw is None:
            raise ResponseNotFound(response_id)
        return StoredResponse(**json.loads(raw))

    async def delete(self, response_id: str) -> None:
        if not await self._call(lambda client: client.delete(_KEY + response_id)):
            raise ResponseNotFound(response_id)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _call(self, command: Any) -> Any:
        if self._client is None:
            self._client = connect_async(self._url, _SOCKET_TIMEOUT_S)
        try:
            return await command(self._client)
        except (redis.RedisError, OSError) as exc:
            raise StoreUnavailable(f"the response store (Redis) did not answer: {exc}") from None
