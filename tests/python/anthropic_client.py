"""The official `anthropic` package against duet's Messages API (run by tests/tests/anthropic.rs).

Argument: a JSON object with `base_url` (open), `key_url` (needing `key`), and the greedy
text gRPC gave for the conversation below (`chat`). Exits non-zero, with the reason, on the
first mismatch.
"""

import json
import sys

import anthropic

args = json.loads(sys.argv[1])
client = anthropic.Anthropic(base_url=args["base_url"], api_key="unused", max_retries=0)
hi = [{"role": "user", "content": "Hi"}]
conversation = {"model": "duet", "max_tokens": 10, "system": "Be brief.", "messages": hi}


def check(what, got, want):
    if got != want:
        sys.exit(f"{what}: got {got!r}, want {want!r}")


# A whole message and a streamed one, greedy: gRPC's text, cut by max_tokens.
whole = client.messages.create(**conversation)
check("message text", whole.content[0].text, args["chat"])
check("stop reason", whole.stop_reason, "max_tokens")
check("output tokens", whole.usage.output_tokens, 10)
with client.messages.stream(**conversation) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
check("streamed text", (text, final.content[0].text), (args["chat"], args["chat"]))
check("streamed end", (final.stop_reason, final.usage.output_tokens), ("max_tokens", 10))

# count_tokens: the prompt a generation of the same conversation prefilled.
counted = client.messages.count_tokens(model="duet", system="Be brief.", messages=hi)
prompt = whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
check("counted tokens", counted.input_tokens, prompt)
# The client adds up the streamed message's usage from message_start and message_delta.
streamed_prompt = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
check("streamed prompt tokens", streamed_prompt, prompt)

# The served model, listed in Anthropic's shape.
listed = client.models.list()
check("models", [(m.type, m.display_name == m.id) for m in listed.data][:1], [("model", True)])
check("model retrieved", client.models.retrieve(listed.data[0].id), listed.data[0])
try:
    client.models.retrieve("nope")
    sys.exit("an unknown model was retrieved")
except anthropic.NotFoundError as e:
    check("unknown model", e.status_code, 404)

# A stop sequence from the text ends it right before, and is named.
stop = args["chat"][3:5]
cut = client.messages.create(**conversation, stop_sequences=[stop])
check("cut text", cut.content[0].text, args["chat"][: args["chat"].find(stop)])
check("stop sequence", (cut.stop_reason, cut.stop_sequence), ("stop_sequence", stop))

# A required call, whole and streamed, and its result handed back.
schema = {"type": "object", "properties": {"c": {"enum": ["P"]}}, "additionalProperties": False}
ask = [{"role": "user", "content": "w?"}]
calling = {
    "model": "duet",
    "max_tokens": 64,
    "messages": ask,
    "tools": [{"name": "w", "input_schema": schema}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
}
called = client.messages.create(**calling)
uses = [block for block in called.content if block.type == "tool_use"]
check("one call", [block.name for block in uses], ["w"])
check("call input", type(uses[0].input), dict)
check("call stop reason", called.stop_reason, "tool_use")
with client.messages.stream(**calling) as stream:
    streamed = stream.get_final_message()
check("streamed call", [b.input for b in streamed.content if b.type == "tool_use"], [uses[0].input])
result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}
turns = ask + [
    {"role": "assistant", "content": called.content},
    {"role": "user", "content": [result]},
]
answered = client.messages.create(model="duet", max_tokens=4, messages=turns)
check("answer after the result", answered.usage.output_tokens, 4)

# Structured output: the text is an object of the schema.
schema = {
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
shaped = client.messages.create(
    **{**conversation, "max_tokens": 30},
    output_config={"format": {"type": "json_schema", "schema": schema}},
)
check("schema keys", list(json.loads(shaped.content[0].text)), ["ok"])
check("a whole object ends it", shaped.stop_reason, "end_turn")

# Bad input (older clients' sampling fields are read), and the key.
try:
    client.messages.create(**conversation, extra_body={"temperature": -1})
    sys.exit("a negative temperature was accepted")
except anthropic.BadRequestError as e:
    check("bad request status", e.status_code, 400)
    check("bad request type", e.body["error"]["type"], "invalid_request_error")
    if "temperature" not in e.message:
        sys.exit(f"bad request message: {e.message}")

locked = anthropic.Anthropic(base_url=args["key_url"], api_key="wrong", max_retries=0)
try:
    locked.messages.create(**conversation)
    sys.exit("a wrong key was accepted")
except anthropic.AuthenticationError as e:
    check("wrong key status", e.status_code, 401)
opened = anthropic.Anthropic(base_url=args["key_url"], api_key=args["key"], max_retries=0)
check("message with the key", opened.messages.create(**conversation).content[0].text, args["chat"])
print("anthropic client: ok")
