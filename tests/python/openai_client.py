"""The official `openai` package against duet's HTTP API (run by tests/tests/openai/main.rs).

Argument: a JSON object with `base_url` (open), `token_url` (needing `token`), and the
greedy texts gRPC gave for the same requests (`completion`, `chat`). Exits non-zero, with
the reason, on the first mismatch.
"""

import json
import sys

import openai

args = json.loads(sys.argv[1])
client = openai.OpenAI(base_url=args["base_url"], api_key="unused", max_retries=0)
chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def check(what, got, want):
    if got != want:
        sys.exit(f"{what}: got {got!r}, want {want!r}")


# Unary completion and streamed chat, greedy: gRPC's texts.
done = client.completions.create(model="duet", prompt="the cat", max_tokens=12, extra_body={"speculation": "draft_model"})
check("completion text", done.choices[0].text, args["completion"])
check("completion tokens", done.usage.completion_tokens, 12)
check("finish reason", done.choices[0].finish_reason, "length")
# The answer's x-request-id, as the client reads OpenAI's: the caller's own, else a fresh one.
check("fresh request id", len(done._request_id or ""), 36)
tagged = client.with_options(default_headers={"x-request-id": "py-7f3a"}).completions.create(
    model="duet", prompt="the cat", max_tokens=1
)
check("caller's request id", tagged._request_id, "py-7f3a")

stream = client.chat.completions.create(
    model="duet", messages=chat, max_tokens=10, stream=True, stream_options={"include_usage": True}
)
text, usage = "", None
for chunk in stream:
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
    if chunk.usage:
        usage = chunk.usage
check("streamed chat text", text, args["chat"])
check("streamed usage", usage.completion_tokens if usage else None, 10)

whole = client.chat.completions.create(model="duet", messages=chat, max_tokens=10)
check("unary chat text", whole.choices[0].message.content, args["chat"])

# Log-probabilities, chat's and the legacy completions': one entry a token, the most likely
# tokens' beside each (greedy: the chosen token is the most likely).
scored = client.chat.completions.create(
    model="duet", messages=chat, max_tokens=10, logprobs=True, top_logprobs=2
)
content = scored.choices[0].logprobs.content
check("logprob entries", len(content), scored.usage.completion_tokens)
check("top logprobs", len(content[0].top_logprobs), 2)
check("most likely first", content[0].top_logprobs[0].logprob, content[0].logprob)
legacy = client.completions.create(model="duet", prompt="the cat", max_tokens=5, logprobs=2)
check("legacy token logprobs", len(legacy.choices[0].logprobs.token_logprobs), 5)
check("legacy tokens", "".join(legacy.choices[0].logprobs.tokens), legacy.choices[0].text)

# Scoring as lm-evaluation-harness sends it: prompts of token ids, echoed with their figures
# (the first token's null: nothing precedes it), one choice per prompt in order.
prompt_ids = [[1, 2, 3, 4], [5, 6, 7]]
echoed = client.completions.create(
    model="duet", prompt=prompt_ids, max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234
)
check("scored choices", [c.index for c in echoed.choices], [0, 1])
for choice, prompt in zip(echoed.choices, prompt_ids):
    figures = choice.logprobs.token_logprobs
    check("scored entries", len(figures), len(prompt) + 1)
    check("first prompt token", (figures[0], choice.logprobs.top_logprobs[0]), (None, None))
    check("figures are log-probabilities", all(f <= 0 for f in figures[1:]), True)
check("scored prompt tokens", echoed.usage.prompt_tokens, 7)

# Sampling with a seed and a fixed method and K: the same request gives the same text.
fixed = {"speculation": "draft_model", "num_speculative_tokens": 2}
sampled = [
    client.chat.completions.create(
        model="duet", messages=chat, max_tokens=10, temperature=0.8, seed=7, extra_body=fixed
    )
    .choices[0]
    .message.content
    for _ in range(2)
]
check("seeded samples agree", sampled[0], sampled[1])

# Two choices, each a generation of its own (seeded apart).
two = client.chat.completions.create(
    model="duet", messages=chat, max_tokens=10, temperature=0.8, seed=3, n=2, extra_body=fixed
)
check("choices", [c.index for c in two.choices], [0, 1])
check("usage of both", two.usage.completion_tokens, 20)

# Structured output: the content is an object of the schema.
schema = {
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
shaped = client.chat.completions.create(
    model="duet",
    messages=chat,
    max_tokens=30,
    response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
)
answer = json.loads(shaped.choices[0].message.content)
check("schema keys", sorted(answer), ["n", "ok"])
check("schema types", (type(answer["ok"]), type(answer["n"])), (bool, int))
check("a whole object ends it", shaped.choices[0].finish_reason, "stop")

# A required tool call: the package reads the call.
tools = [{"type": "function", "function": {"name": "w", "parameters": {
    "properties": {"c": {"enum": ["P"]}}, "additionalProperties": False}}}]
called = client.chat.completions.create(
    model="duet", messages=[{"role": "user", "content": "w?"}], max_tokens=64, tools=tools,
    tool_choice="required", parallel_tool_calls=False,
)
check("one call", len(called.choices[0].message.tool_calls), 1)
call = called.choices[0].message.tool_calls[0]
check("tool call", (call.type, call.function.name), ("function", "w"))
check("tool call arguments", type(json.loads(call.function.arguments)), dict)
check("tool call finish", called.choices[0].finish_reason, "tool_calls")

# The Responses API: chat's conversation as instructions and input, whole and streamed.
responded = client.responses.create(
    model="duet", instructions="Be brief.", input="Hi", max_output_tokens=10
)
check("response text", responded.output_text, args["chat"])
cut = (responded.status, responded.incomplete_details.reason)
check("response cut", cut, ("incomplete", "max_output_tokens"))
check("response usage", responded.usage.output_tokens, 10)
deltas, final = "", None
for event in client.responses.create(
    model="duet", instructions="Be brief.", input="Hi", max_output_tokens=10, stream=True
):
    if event.type == "response.output_text.delta":
        deltas += event.delta
    if event.type in ("response.completed", "response.incomplete"):
        final = event.response
check("streamed response text", (deltas, final.output_text), (args["chat"], args["chat"]))
function = [{"type": "function", "name": "w", "parameters": tools[0]["function"]["parameters"]}]
responded_call = client.responses.create(
    model="duet", input="w?", max_output_tokens=64, tools=function, tool_choice="required"
)
item = responded_call.output[0]
check("response call", (item.type, item.name), ("function_call", "w"))
check("response call arguments", type(json.loads(item.arguments)), dict)

# Bad input, and the token.
try:
    client.completions.create(model="duet", prompt="x", temperature=-1)
    sys.exit("a negative temperature was accepted")
except openai.BadRequestError as e:
    check("bad request status", e.status_code, 400)
    if not e.message.startswith("Error code: 400") or "temperature" not in e.message:
        sys.exit(f"bad request message: {e.message}")

locked = openai.OpenAI(base_url=args["token_url"], api_key="wrong", max_retries=0)
try:
    locked.models.list()
    sys.exit("a wrong token was accepted")
except openai.AuthenticationError as e:
    check("wrong token status", e.status_code, 401)
opened = openai.OpenAI(base_url=args["token_url"], api_key=args["token"], max_retries=0)
check("models with the token", opened.models.list().data[0].object, "model")
served = opened.models.list().data[0]
check("model retrieved", opened.models.retrieve(served.id), served)
try:
    opened.models.retrieve("nope")
    sys.exit("an unknown model was retrieved")
except openai.NotFoundError as e:
    check("unknown model", (e.status_code, e.code), (404, "model_not_found"))
print("openai client: ok")
