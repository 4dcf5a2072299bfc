"""Tests for scripts/per-request on duet-bench lines made up here.

Run: python3 -m unittest discover -s scripts -p 'test_*.py'
"""
import json
import os
import subprocess
import sys
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "per-request")


def line(index, rid, method, wall_ms, ttft_ms, rounds=10, proposed=0, accepted=0):
    return json.dumps({"set": "s", "index": index, "id": rid, "method": method, "concurrency": 8,
                       "wall_ms": wall_ms, "ttft_ms": ttft_ms, "rounds": rounds,
                       "draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted})


class PerRequest(unittest.TestCase):
    def run_script(self, lines):
        out = subprocess.run([sys.executable, SCRIPT], input="\n".join(lines) + "\n",
                             capture_output=True, text=True, check=True)
        return out.stdout.splitlines()

    def test_each_request_and_the_totals_with_and_without_first_tokens(self):
        out = self.run_script([
            line(0, "a", "none", 1000, 100),
            line(0, "a", "auto@old", 1000, 400, rounds=6, proposed=8, accepted=5),
            line(1, "b", "none", 3000, 100),
            line(1, "b", "auto@old", 2000, 200, rounds=4, proposed=9, accepted=9),
            '{"set": "s", "method": "none", "tokens_per_s": 1.0}',
            "| a table line |",
        ])
        self.assertEqual(out[2], "| s | 8 | a | auto@old | 1.00x | 6 | 5 of 8 |")
        self.assertEqual(out[3], "| s | 8 | b | auto@old | 1.50x | 4 | 9 of 9 |")
        # Whole: 4000 / 3000 ms; decode alone: (4000 - 200) / (3000 - 600) ms.
        self.assertEqual(out[-1], "| s | 8 | auto@old | 1.33x | 1.58x | 0.6 | 0.2 |")
        self.assertEqual(len(out), 8)

    def test_a_request_without_none_is_left_out(self):
        out = self.run_script([line(0, "a", "auto", 1000, 100)])
        self.assertEqual(len(out), 5)


if __name__ == "__main__":
    unittest.main()
