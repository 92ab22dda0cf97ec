"""The Responses API (`/v1/responses`) through the official `openai` SDK against a served
system (real Ray workers, the router's HTTP API, its private Redis): text and streamed answers,
stored responses continued with `previous_response_id` on the worker that holds their KV,
`text.format` grammars, expiry, the size bound, and 400s naming the field."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.openai.served import keyed_config, serve

TTL_S = 8
# About 5 bytes a token here: its character twice (conversation, prompt) and its id; an input
# of 1,200 characters passes the bound, one of 900 only after 400 stored.
MAX_BYTES = 6_000
BLOCK_SIZE = 4  # tests/e2e/conftest.py's ENGINE
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["ok", "level", "tags"],
}

YES = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    # Colocated, two decode workers: a continuation finds its KV only on the one that ran the
    # previous turn, so cached tokens show the router chose it.
    config = keyed_config(
        tmp_path_factory,
        prefill_workers=0,
        decode_workers=2,
        disaggregate="never",
        response_ttl_s=TTL_S,
        response_max_bytes=MAX_BYTES,
    )
    with serve(config) as app:
        yield app


def test_a_text_answer_is_a_response_object_that_can_be_retrieved(client):
    response = client.responses.create(
        input="Tell me a story.", instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text
    assert response.instructions == "Be brief." and response.store is True
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert usage.output_tokens == 12
        assert response.incomplete_details.reason == "max_output_tokens"
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()


def test_streamed_events_accumulate_to_the_same_text(client, served):
    asked = {
        "model": served.model_dir.name,
        "input": "Count with me:",
        "max_output_tokens": 16,
        "temperature": 0,
    }
    whole = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-4].text == text and events[-3].part.text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == text
    # The SDK's own accumulation of the events (which wants a response that completed: a
    # grammar ends this one well before max_output_tokens).
    closed = {"type": "json_schema", "name": "yes", "schema": YES, "strict": True}
    asked = {**asked, "max_output_tokens": 40, "text": {"format": closed}}
    with client.responses.stream(**asked) as stream:
        streamed = stream.get_final_response()
    assert streamed.status == "completed"
    assert json.loads(streamed.output_text) == {"answer": "yes"}
    assert streamed.output_text == client.responses.create(**asked).output_text


def test_a_three_turn_conversation_reports_its_previous_turns_cached(client):
    """Each turn's prompt starts with the previous turn's prompt and output tokens: the worker
    that ran it holds their KV (all but the last output token's, and whole blocks only), and
    the router sends the next turn there. Each conversation opens with a document of its own
    (hundreds of tokens, as a real history is): on the tiny model a few dozen cached tokens
    weigh less than the load a just-finished request still shows until the next stats poll."""
    for topic in ("the sea", "mountains"):
        document = f"Notes on {topic}: " + " ".join(f"{topic} {i}" for i in range(40))
        previous, held = None, 0
        for turn, question in enumerate((f"{document}\nSummarize.", "Why?", "And then?")):
            response = client.responses.create(
                input=question,
                instructions="Answer in a few words.",
                previous_response_id=previous,
                max_output_tokens=10,
                temperature=0,
            )
            usage = response.usage
            cached = usage.input_tokens_details.cached_tokens
            if turn:
                assert usage.input_tokens > held
                assert cached >= (held - 1) // BLOCK_SIZE * BLOCK_SIZE, (topic, turn, cached, held)
            previous, held = response.id, usage.input_tokens + usage.output_tokens


def test_turns_given_as_input_items_continue_a_conversation(client):
    first = client.responses.create(input="Hi!", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        previous_response_id=first.id,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "More, "}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "please."}]},  # noqa: E501
        ],
        max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_continuation_without_input_answers_again_and_none_at_all_is_refused(client):
    first = client.responses.create(input="Hi!", max_output_tokens=4, temperature=0)
    again = client.responses.create(previous_response_id=first.id, max_output_tokens=4)
    assert again.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(max_output_tokens=4)
    assert refused.value.body["param"] == "input"


def test_json_schema_text_format_outputs_are_all_valid(client):
    text_format = {"type": "json_schema", "name": "status", "schema": SCHEMA, "strict": True}

    def one(seed: int) -> str:
        response = client.responses.create(
            input="Status as JSON:",
            max_output_tokens=120,
            temperature=1.0,
            text={"format": text_format},
            extra_body={"seed": seed},
        )
        assert response.status == "completed", response.output_text
        assert response.text.format.type == "json_schema"
        return response.output_text

    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(one, range(20)))
    for output in outputs:
        jsonschema.validate(json.loads(output), SCHEMA)
    assert len(outputs) == 20
    answer = client.responses.create(
        input="JSON:", max_output_tokens=30, text={"format": {"type": "json_object"}}
    )
    assert answer.output_text.startswith("{")


def test_a_response_not_stored_cannot_be_continued_or_retrieved(client):
    response = client.responses.create(input="Secret.", max_output_tokens=4, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(response.id)
    assert response.id in missing.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="More", previous_response_id=response.id)
    assert refused.value.body["param"] == "previous_response_id"
    assert response.id in refused.value.body["message"]


def test_a_deleted_response_is_gone(client):
    response = client.responses.create(input="Forget me.", max_output_tokens=4)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_a_stored_response_expires_after_the_ttl(client):
    response = client.responses.create(input="Soon gone.", max_output_tokens=4)
    assert client.responses.retrieve(response.id).id == response.id
    time.sleep(TTL_S + 1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="Still there?", previous_response_id=response.id)
    assert "expired" in refused.value.body["message"]


def test_a_conversation_over_the_size_bound_is_refused_not_cut(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="x" * 1200, max_output_tokens=4)
    body = refused.value.body
    assert body["param"] == "input" and str(MAX_BYTES) in body["message"]
    assert "--response-max-bytes" in body["message"]
    # Unstored, the same input is not bound by the store.
    client.responses.create(input="x" * 1200, max_output_tokens=2, store=False)
    # A conversation that grows past the bound is refused at the turn that would pass it.
    previous = client.responses.create(input="x" * 400, max_output_tokens=2).id
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="x" * 900, previous_response_id=previous, max_output_tokens=2)
    assert refused.value.body["param"] == "input"


@pytest.mark.parametrize(
    "asked, field",
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),  # the template has none
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format"),  # noqa: E501
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].call_id"),  # noqa: E501
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"model": "gpt-nothing"}, "model"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(client, asked, field):
    asked = {"input": "x", "max_output_tokens": 4, **asked}
    error = openai.NotFoundError if field == "model" else openai.BadRequestError
    with pytest.raises(error) as refused:
        client.responses.create(**asked)
    assert refused.value.body["param"] == field, refused.value.body
    assert client.responses.create(input="Still serving?", max_output_tokens=2).output


def test_every_responses_route_needs_the_api_key(client, served):
    stored = client.responses.create(input="Mine.", max_output_tokens=2)
    stranger = openai.OpenAI(
        base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="sk-wrong", max_retries=0
    )
    for call in (
        lambda: stranger.responses.create(input="x", max_output_tokens=2),
        lambda: stranger.responses.retrieve(stored.id),
        lambda: stranger.responses.delete(stored.id),
    ):
        with pytest.raises(openai.AuthenticationError):
            call()
    assert client.responses.retrieve(stored.id).id == stored.id
