"""Tests for scripts/rounds on coordinator round lines made up here.

Run: python3 -m unittest discover -s scripts -p 'test_*.py'
"""
import os
import subprocess
import sys
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rounds")
PREFIX = "2026-11-28T20:31:20.231014Z DEBUG duet_coordinator::generation::report: round "


def line(method, k, ms, target, verify, draft=None, propose=0.0):
    draft_parts = (f"draft_ms={draft} draft_queue_ms=0.5" if draft is not None else "")
    return (PREFIX + f'method="{method}" k={k} accepted=0 lookup_matched=0 lookup_tokens=0 '
            f"pass_rows={k + 1} target_ms={target} target_queue_ms=0.5 {draft_parts} "
            f"propose_call_ms={propose} verify_call_ms={verify} ms={ms}")


class Rounds(unittest.TestCase):
    def run_script(self, lines):
        out = subprocess.run([sys.executable, SCRIPT], input="\n".join(lines) + "\n",
                             capture_output=True, text=True, check=True)
        return out.stdout.splitlines()

    def test_each_part_of_a_round_by_method_and_k(self):
        out = self.run_script([
            line("draft_model", 2, 10.0, 2.0, 3.0, draft=3.0, propose=4.0),
            line("draft_model", 2, 12.0, 2.0, 3.5, draft=3.0, propose=5.0),
            # A streamed target-only round: no call awaited.
            line("none", 0, 2.0, 1.8, 0.0),
            "2026-11-28T20:31:20Z  INFO duet_coordinator: an unrelated line",
        ])
        self.assertEqual(out[2], "| draft_model | 2 | 2 | 11.00 | 2.00 | 0.50 | 3.00 | 0.50 "
                                 "| 0.75 | 1.00 | 3.25 |")
        self.assertEqual(out[3], "| none | 0 | 1 | 2.00 | 1.80 | 0.50 | 0.00 | 0.00 | 0.00 "
                                 "| 0.00 | 0.20 |")
        self.assertEqual(len(out), 4)
