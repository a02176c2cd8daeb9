"""Reference tokenization for the Rust tokenizer tests.

Reads the vocabulary, merges and token types from a GGUF file with the `gguf` package and
tokenizes texts with HuggingFace `tokenizers` (an independent BPE implementation).
stdin: JSON list of texts. stdout: JSON {"spec": {...GGUF tokenizer metadata...},
"ids": [[int]], "decoded": [str]}.
"""
import json
import sys

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3


def main() -> None:
    reader = GGUFReader(sys.argv[1])

    def field(key, default=None):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    tokens = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    types = field("tokenizer.ggml.token_type")
    pre = field("tokenizer.ggml.pre")
    if pre != "smollm":
        sys.exit(f"reference only models the 'smollm' pre-tokenizer, got {pre!r}")

    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=[tuple(m.split(" ", 1)) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types) if ty == CONTROL
    ])

    texts = json.load(sys.stdin)
    encs = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    json.dump({
        "spec": {
            "model": field("tokenizer.ggml.model"),
            "pre": pre,
            "tokens": tokens,
            "token_types": types,
            "merges": merges,
            "bos_id": field("tokenizer.ggml.bos_token_id"),
            "eos_id": field("tokenizer.ggml.eos_token_id"),
            "add_bos": bool(field("tokenizer.ggml.add_bos_token", False)),
        },
        "ids": encs,
        "decoded": [tok.decode(ids, skip_special_tokens=False) for ids in encs],
    }, sys.stdout)


if __name__ == "__main__":
    main()
