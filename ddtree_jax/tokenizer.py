"""Tokenizers: a trained BPE (``tokenizer.json`` via the ``tokenizers`` package) when the model
directory ships one, otherwise plain UTF-8 bytes (ids 0..255) for random/tiny models."""

from __future__ import annotations

import os


class ByteTokenizer:
    """UTF-8 bytes as token ids; ids >= 256 decode as ``<id>``."""

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"byte tokenizer needs vocab_size >= 256, model has {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(f"<{i}>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(model_dir: str | None, vocab_size: int):
    if model_dir is not None:
        path = os.path.join(model_dir, "tokenizer.json")
        if os.path.exists(path):
            return HFTokenizer(path)
    return ByteTokenizer(vocab_size)
