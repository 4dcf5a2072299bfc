"""The official `huggingface_hub` package's InferenceClient against duet's TGI API (run by
tests/tests/tgi.rs).

Argument: a JSON object with `base_url`, the `prompt`, and gRPC's greedy completion of it in
8 tokens (`text`, `token_ids`, `finish_reason`). Exits non-zero, with the reason, on the
first mismatch.
"""

import json
import sys

from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

args = json.loads(sys.argv[1])
client = InferenceClient(model=args["base_url"])
prompt, text = args["prompt"], args["text"]


def check(what, got, want):
    if got != want:
        sys.exit(f"{what}: got {got!r}, want {want!r}")


# Whole: at the server's root, the full text unless told otherwise (as TGI answers for a
# text-generation model), greedy as the client asks by default.
check("full text", client.text_generation(prompt, max_new_tokens=8), prompt + text)
alone = client.text_generation(prompt, max_new_tokens=8, return_full_text=False)
check("text", alone, text)
out = client.text_generation(prompt, max_new_tokens=8, return_full_text=False, details=True)
check("details text", out.generated_text, text)
check("finish reason", out.details.finish_reason, args["finish_reason"])
check("token ids", [t.id for t in out.details.tokens], args["token_ids"])
check("generated tokens", out.details.generated_tokens, len(args["token_ids"]))

# Streamed: a token's text at a time; with details, each token and at the end the text.
pieces = list(client.text_generation(prompt, max_new_tokens=8, stream=True))
check("streamed text", "".join(pieces), text)
events = list(client.text_generation(prompt, max_new_tokens=8, stream=True, details=True))
check("streamed tokens", [e.token.id for e in events], args["token_ids"])
last = events[-1]
check("streamed end", (last.generated_text, last.details.finish_reason), (prompt + text, args["finish_reason"]))

# A parameter duet does not take: TGI's validation error.
try:
    client.text_generation(prompt, max_new_tokens=8, typical_p=0.5)
    sys.exit("typical_p was accepted")
except ValidationError as e:
    if "typical_p" not in str(e):
        sys.exit(f"validation message: {e}")

# The endpoint's description and health (asked of a client set to TGI's own provider).
endpoint = InferenceClient(model=args["base_url"], provider="hf-inference")
info = endpoint.get_endpoint_info()
check("endpoint info", (info["max_best_of"], info["router"]), (1, "duet"))
check("health", endpoint.health_check(), True)
print("huggingface_hub client: ok")
