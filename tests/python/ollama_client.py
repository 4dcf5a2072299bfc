"""The official `ollama` package against duet's Ollama API (run by tests/tests/ollama.rs).

Argument: a JSON object with `host` (open), `key_host` (needing `key`), the served model's
name (`model`), and the greedy text gRPC gave for the conversation below (`chat`). Exits
non-zero, with the reason, on the first mismatch.
"""

import json
import sys

import ollama

args = json.loads(sys.argv[1])
client = ollama.Client(host=args["host"])
conversation = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]
greedy = {"temperature": 0, "num_predict": 10}


def check(what, got, want):
    if got != want:
        sys.exit(f"{what}: got {got!r}, want {want!r}")


# A whole chat and a streamed one, greedy: gRPC's text, cut by num_predict.
whole = client.chat(model="qwen2.5-coder:1.5b", messages=conversation, options=greedy)
check("chat text", whole.message.content, args["chat"])
check("chat end", (whole.done, whole.done_reason, whole.eval_count), (True, "length", 10))
pieces = list(client.chat(model="x", messages=conversation, options=greedy, stream=True))
check("streamed text", "".join(p.message.content for p in pieces), args["chat"])
check("streamed end", (pieces[-1].done, pieces[-1].done_reason), (True, "length"))
check("only the last is done", [p.done for p in pieces[:-1]], [False] * (len(pieces) - 1))

# The same conversation as a prompt with its system prompt, whole and streamed.
made = client.generate(model="x", prompt="Hi", system="Be brief.", options=greedy)
check("generated text", made.response, args["chat"])
streamed = client.generate(model="x", prompt="Hi", system="Be brief.", options=greedy, stream=True)
check("streamed generation", "".join(p.response for p in streamed), args["chat"])

# Each token's log-probability, and the two most likely beside it.
scored = client.chat(
    model="x", messages=conversation, options=greedy, logprobs=True, top_logprobs=2
)
check("logprobs", len(scored.logprobs), 10)
check("top logprobs", len(scored.logprobs[0].top_logprobs), 2)
check("chosen token first", scored.logprobs[0].token, scored.logprobs[0].top_logprobs[0].token)

# Structured output: the text is an object of the schema.
schema = {
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
shaped = client.chat(
    model="x", messages=conversation, format=schema, options={"temperature": 0, "num_predict": 30}
)
check("schema keys", list(json.loads(shaped.message.content)), ["ok"])
check("a whole object ends it", shaped.done_reason, "stop")

# The model as Ollama lists, shows and runs its own.
listed = client.list().models
check("listed", [m.model for m in listed], [args["model"]])
check("family", listed[0].details.family, "qwen2")
shown = client.show(args["model"])
check("context", shown.modelinfo["qwen2.context_length"], 256)
check("capabilities", "completion" in shown.capabilities, True)
check("running", [m.model for m in client.ps().models], [args["model"]])

# Bad input, and the key.
try:
    client.chat(model="x", messages=conversation, options={"repeat_penalty": 1.3})
    sys.exit("a repeat penalty was accepted")
except ollama.ResponseError as e:
    check("bad request", (e.status_code, e.error), (400, "repeat_penalty: duet does not take it"))
locked = ollama.Client(host=args["key_host"], headers={"authorization": "Bearer wrong"})
try:
    locked.chat(model="x", messages=conversation, options=greedy)
    sys.exit("a wrong key was accepted")
except ollama.ResponseError as e:
    check("wrong key status", e.status_code, 401)
opened = ollama.Client(host=args["key_host"], headers={"authorization": f"Bearer {args['key']}"})
keyed = opened.chat(model="x", messages=conversation, options=greedy)
check("chat with the key", keyed.message.content, args["chat"])
print("ollama client: ok")
