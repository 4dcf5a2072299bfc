"""Tests for scripts/peer-client against an OpenAI-shaped server made up here.

Run: python3 -m unittest discover -s scripts -p 'test_*.py'
"""
import http.server
import importlib.machinery
import importlib.util
import io
import json
import os
import tempfile
import threading
import unittest
from contextlib import redirect_stdout
from types import SimpleNamespace

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer-client")
_loader = importlib.machinery.SourceFileLoader("peer_client", PATH)
_spec = importlib.util.spec_from_loader("peer_client", _loader)
client = importlib.util.module_from_spec(_spec)
_loader.exec_module(client)


class Fake(http.server.BaseHTTPRequestHandler):
    """Answers every completion with the words of its prompt; AUTO's answer to a prompt
    holding "drift" ends otherwise. Records each request's path and body."""
    seen = []

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Fake.seen.append((self.path, request))
        prompt = request.get("prompt") or request["messages"][0]["content"]
        text = prompt.upper()
        if request.get("speculation") == "auto" and "drift" in prompt:
            text += "!"
        choice = ({"message": {"role": "assistant", "content": text}}
                  if "messages" in request else {"text": text})
        out = json.dumps({"choices": [choice],
                          "usage": {"completion_tokens": len(prompt.split())}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *_):
        pass


class PeerClient(unittest.TestCase):
    def setUp(self):
        Fake.seen = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fake)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_port}"
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.server.shutdown()
        self.server.server_close()
        self.dir.cleanup()

    def prompts(self, rows):
        path = os.path.join(self.dir.name, "set.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return path

    def measure(self, rows, arms, streams, repeat=1):
        args = SimpleNamespace(prompts=[f"s={self.prompts(rows)}"], limit=8, repeat=repeat,
                               max_tokens=16)
        out = io.StringIO()
        with redirect_stdout(out):
            results, mismatched = client.measure(args, arms, streams,
                                                 {arm: self.base for arm in arms})
        return results, mismatched, [json.loads(l) for l in out.getvalue().splitlines()]

    def test_each_ordered_pair_of_arms_once_a_square(self):
        for n in (2, 3, 4, 5):
            rows = client.williams(n)
            self.assertEqual(len(rows), n if n % 2 == 0 else 2 * n)
            pairs = [(r[i], r[i + 1]) for r in rows for i in range(n - 1)]
            per_pair = 1 if n % 2 == 0 else 2
            for a in range(n):
                for b in range(n):
                    if a != b:
                        self.assertEqual(pairs.count((a, b)), per_pair, (n, a, b))
            self.assertTrue(all(sorted(r) == list(range(n)) for r in rows))

    def test_a_chat_and_a_completion_for_each_server(self):
        self.assertEqual(client.body({"prompt": "p", "chat": True}, "llama", 9),
                         ("/v1/chat/completions", {"model": "target", "max_tokens": 9,
                                                   "temperature": 0,
                                                   "messages": [{"role": "user",
                                                                 "content": "p"}],
                                                   "cache_prompt": False}))
        self.assertEqual(client.body({"prompt": "p"}, "auto", 9),
                         ("/v1/completions", {"model": "target", "max_tokens": 9,
                                              "temperature": 0, "prompt": "p",
                                              "speculation": "auto"}))

    def test_every_arm_runs_every_group_and_counts_its_tokens(self):
        rows = [{"prompt": "a b c"}, {"prompt": "d e", "chat": True}, {"prompt": "f"}]
        results, mismatched, lines = self.measure(rows, ["llama", "none", "auto"], [1, 2])
        self.assertEqual(mismatched, 0)
        # One warm-up request an arm, then 3 groups of one and 1 group of two, each arm.
        self.assertEqual(len(Fake.seen), 3 + 3 * (3 + 2))
        by = {(l["streams"], l["arm"]): l for l in lines}
        self.assertEqual(len(lines), 6)
        for arm in ("llama", "none", "auto"):
            self.assertEqual(by[(1, arm)]["tokens"], 6)
            self.assertEqual(by[(1, arm)]["requests"], 3)
            self.assertEqual(by[(2, arm)]["tokens"], 5)
            self.assertEqual(by[(1, arm)]["same_as_none"], 3)
        self.assertEqual(set(results), {("s", 1), ("s", 2)})
        speculation = [r.get("speculation") for _, r in Fake.seen]
        self.assertEqual(speculation.count(None), 1 + 3 + 2)
        warm_ups = [r for _, r in Fake.seen if r.get("prompt") == "Say hello."]
        self.assertEqual(len(warm_ups), 3)
        self.assertEqual(speculation.count("none"), 1 + 3 + 2)

    def test_an_auto_answer_unlike_none_is_counted(self):
        rows = [{"prompt": "x drift"}, {"prompt": "y"}]
        _, mismatched, lines = self.measure(rows, ["none", "auto"], [1], repeat=2)
        self.assertEqual(mismatched, 2)
        auto = next(l for l in lines if l["arm"] == "auto")
        self.assertEqual((auto["requests"], auto["same_as_none"]), (4, 2))

    def test_the_table_reads_ratios_to_the_first_arm(self):
        results = {("h", 1): {"llama": {"tokens": 100, "seconds": 10.0},
                              "auto": {"tokens": 150, "seconds": 10.0}},
                   ("h", 8): {"llama": {"tokens": 400, "seconds": 10.0},
                              "auto": {"tokens": 300, "seconds": 5.0}}}
        self.assertEqual(client.table(results, ["llama", "auto"]).splitlines(), [
            "| set | streams | llama tok/s | auto |",
            "|---|---|---|---|",
            "| h | 1 | 10.0 | 1.50x |",
            "| h | 8 | 40.0 | 1.50x |",
        ])

    def test_auto_is_set_beside_the_fastest_llama_arm_of_each_row(self):
        results = {("h", 1): {"llama": {"tokens": 100, "seconds": 10.0},
                              "llama+ngram": {"tokens": 120, "seconds": 10.0},
                              "auto": {"tokens": 180, "seconds": 10.0}},
                   ("h", 8): {"llama": {"tokens": 400, "seconds": 10.0},
                              "llama+ngram": {"tokens": 200, "seconds": 10.0},
                              "auto": {"tokens": 300, "seconds": 5.0}}}
        arms = ["llama", "llama+ngram", "auto"]
        self.assertEqual(client.against_best(results, arms).splitlines(), [
            "| set | streams | llama-server's best | auto / it |",
            "|---|---|---|---|",
            "| h | 1 | llama+ngram | 1.50x |",
            "| h | 8 | llama | 1.50x |",
        ])
        self.assertEqual(client.against_best(results, ["llama", "llama+ngram"]), "")


if __name__ == "__main__":
    unittest.main()
