"""Tokenizers: a trained BPE (``tokenizer.json`` via the ``tokenizers`` package) when the model
directory ships one, K2.x's tiktoken-format BPE (``tiktoken.model``) when it ships that; plain UTF-8
bytes (ids 0..255) only for a model without a directory (random/tiny models). A model directory with
neither file is refused."""

from __future__ import annotations

import base64
import heapq
import json
import os


class ByteTokenizer:
    """UTF-8 bytes as token ids; ids >= 256 decode as ``<id>``."""

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"byte tokenizer needs vocab_size >= 256, model has {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each id's bytes in a decoded text (``stop_strings``): its byte below 256, ``<id>`` above."""
        return [bytes([i]) if i < 256 else f"<{i}>".encode() for i in range(vocab_size)]

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
        self._tok.no_truncation()  # a tokenizer.json may ask for either: a prompt is encoded whole, as it is
        self._tok.no_padding()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each id's bytes in a decoded text (``stop_strings``), for a byte-level BPE (a ByteLevel decoder): the
        token's characters mapped back to bytes; special tokens (which ``decode`` skips) and ids past the
        tokenizer's vocabulary: none. ValueError for another decoder, whose text is not a join of token bytes."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            raise ValueError(f"stop strings need each token's bytes: supported for byte-level BPE tokenizers, this "
                             f"tokenizer.json decodes with {decoder.get('type')!r}")
        to_byte = {char: byte for byte, char in byte_level_alphabet().items()}
        special = {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}
        out = []
        for i in range(vocab_size):
            piece = self._tok.id_to_token(i)
            if piece is None or i in special:
                out.append(b"")
            elif all(c in to_byte for c in piece):
                out.append(bytes(to_byte[c] for c in piece))
            else:  # an added, non-special token: its text as written
                out.append(piece.encode("utf-8"))
        return out


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte's character in a token's string (printable Latin-1 bytes stand
    for themselves; the others, in order, for the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


# Pre-tokenization pattern of Kimi K2.x (``pat_str`` of its ``tokenization_kimi.py``): Han runs,
# words with optional English contractions (Han excluded through set intersection, a ``regex``
# module feature), 1-3 digit groups, punctuation runs, newlines, whitespace.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_NUM_RESERVED_SPECIAL = 256  # K2.x reserves this many ids after the ranks for special tokens
# K2.x's tokenization_kimi.py encodes a text in parts: 400,000 characters at most, each cut further so that no
# part holds a run of more than 25,000 whitespace or non-whitespace characters; pieces never cross a cut.
KIMI_MAX_ENCODE_CHARS = 400_000
KIMI_MAX_RUN_CHARS = 25_000


def split_long_runs(text: str, max_run: int = KIMI_MAX_RUN_CHARS) -> list[str]:
    """``text`` cut before every character that would make a run of like characters (all whitespace, or all
    not) longer than ``max_run``; the parts join to ``text``."""
    parts, start, run, in_space = [], 0, 0, text[:1].isspace()
    for i, char in enumerate(text):
        if char.isspace() != in_space:
            in_space, run = char.isspace(), 1
            continue
        run += 1
        if run > max_run:
            parts.append(text[start:i])
            start, run = i, 1
    parts.append(text[start:])
    return parts


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken BPE file: one ``<base64 token bytes> <rank>`` per line -> {bytes: rank}."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected '<base64> <rank>', got {line[:60]!r}")
            ranks[base64.b64decode(parts[0])] = int(parts[1])
    return ranks


class TiktokenTokenizer:
    """Byte-level BPE from tiktoken-format ranks (K2.x's ``tiktoken.model``), in pure Python.

    ranks: {token bytes: id}; special: {id: text} (ids after the ranks; K2.x names them in
    ``tokenizer_config.json``'s ``added_tokens_decoder``, the rest are ``<|reserved_token_<id>|>``).
    Encoding, as K2.x's ``tokenization_kimi.py`` encodes: the text is cut into parts (``KIMI_MAX_ENCODE_CHARS``,
    ``split_long_runs``); in each, special-token texts map to their ids (unless ``allow_special=False``: then
    they are plain text), and the rest is split by ``pattern`` (needs the ``regex`` package for K2's pattern);
    each piece is a token if its bytes are one, else its bytes are merged pairwise, always the adjacent pair
    whose joined bytes have the lowest rank, until no joined pair is a token.
    """

    def __init__(self, ranks: dict[bytes, int], special: dict[int, str] | None = None,
                 pattern: str = KIMI_PATTERN):
        import regex

        self.ranks = ranks
        self.special = dict(special or {})
        self.special_ids = {v: k for k, v in self.special.items()}
        self._bytes = {i: b for b, i in ranks.items()}
        self._pattern = regex.compile(pattern, flags=regex.V1)  # V1: set intersection (&&)
        self._special_split = regex.compile("(" + "|".join(regex.escape(t) for t in sorted(
            self.special_ids, key=len, reverse=True)) + ")") if self.special_ids else None
        self.vocab_size = max([*ranks.values(), *self.special, -1]) + 1

    @classmethod
    def from_dir(cls, model_dir: str, pattern: str = KIMI_PATTERN) -> "TiktokenTokenizer":
        ranks = read_tiktoken_ranks(os.path.join(model_dir, "tiktoken.model"))
        base = len(ranks)
        special = {i: f"<|reserved_token_{i}|>" for i in range(base, base + KIMI_NUM_RESERVED_SPECIAL)}
        config = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(config):
            with open(config) as f:
                added = json.load(f).get("added_tokens_decoder") or {}
            for i, entry in added.items():
                special[int(i)] = entry["content"] if isinstance(entry, dict) else str(entry)
        return cls(ranks, special, pattern)

    def _merge(self, piece: bytes) -> list[int]:
        """BPE over one piece: the adjacent pair of parts whose joined bytes have the lowest rank (leftmost among
        equal ranks) joins first, until no joined pair is a token. A heap of candidate pairs keyed (rank, start)
        finds that pair in O(log n) (a scan per join is quadratic: minutes for a long Han run); a candidate
        whose parts have changed since it was pushed is skipped."""
        if piece in self.ranks:
            return [self.ranks[piece]]
        n = len(piece)
        end = list(range(1, n + 1))  # end[s]: where the part starting at s ends (while s starts a part)
        after = list(range(1, n + 1))  # after[s]: the next part's start (n: none)
        before = list(range(-1, n - 1))  # before[s]: the previous part's start (-1: none)
        alive = [True] * n
        heap: list[tuple[int, int, int]] = []

        def push(s: int) -> None:
            t = after[s]
            if t < n:
                rank = self.ranks.get(piece[s:end[t]])
                if rank is not None:
                    heapq.heappush(heap, (rank, s, end[t]))

        for s in range(n - 1):
            push(s)
        while heap:
            _, s, stop = heapq.heappop(heap)
            t = after[s] if alive[s] else n
            if t >= n or end[t] != stop:
                continue  # stale: s or its neighbour has been joined since
            end[s], after[s], alive[t] = stop, after[t], False
            if after[s] < n:
                before[after[s]] = s
            if before[s] >= 0:
                push(before[s])
            push(s)
        parts, s = [], 0
        while s < n:
            parts.append(piece[s:end[s]])
            s = after[s]
        missing = [p for p in parts if p not in self.ranks]
        if missing:
            raise ValueError(f"bytes {missing[0]!r} have no rank (not a byte-complete tiktoken file)")
        return [self.ranks[p] for p in parts]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        ids: list[int] = []
        for start in range(0, len(text), KIMI_MAX_ENCODE_CHARS):
            for part in split_long_runs(text[start:start + KIMI_MAX_ENCODE_CHARS]):
                chunks = self._special_split.split(part) if allow_special and self._special_split else [part]
                for chunk in chunks:
                    if allow_special and chunk in self.special_ids:
                        ids.append(self.special_ids[chunk])
                        continue
                    for piece in self._pattern.findall(chunk):
                        ids.extend(self._merge(piece.encode("utf-8")))
        return ids

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each id's bytes in a decoded text (``stop_strings``): its rank's bytes, a special token's text, or
        ``<id>`` for an id with neither (as ``decode`` writes them)."""
        return [self._bytes.get(i) or (self.special[i].encode("utf-8") if i in self.special else f"<{i}>".encode())
                for i in range(vocab_size)]

    def decode(self, ids) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i in self._bytes:
                out += self._bytes[i]
            elif i in self.special:
                out += self.special[i].encode("utf-8")
            else:
                out += f"<{i}>".encode()
        return out.decode("utf-8", errors="replace")


TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")
# what a model directory's tokenizer is read from (tiktoken's special tokens sit in tokenizer_config.json)
TOKENIZER_DIR_FILES = TOKENIZER_FILES + ("tokenizer_config.json",)


def tokenizer_file(model_dir: str) -> str | None:
    """The file of ``TOKENIZER_FILES`` that ``load_tokenizer`` reads from ``model_dir`` (the first it has), or None."""
    return next((name for name in TOKENIZER_FILES if os.path.exists(os.path.join(model_dir, name))), None)


def load_tokenizer(model_dir: str | None, vocab_size: int):
    """``tokenizer.json`` (HF tokenizers) if ``model_dir`` has one, else ``tiktoken.model`` (K2.x
    format); UTF-8 bytes when ``model_dir`` is None (a random model). FileNotFoundError for a
    directory with neither: its text would otherwise be silently mis-encoded."""
    if model_dir is None:
        return ByteTokenizer(vocab_size)
    name = tokenizer_file(model_dir)
    if name == "tokenizer.json":
        return HFTokenizer(os.path.join(model_dir, name))
    if name == "tiktoken.model":
        return TiktokenTokenizer.from_dir(model_dir)
    where = "" if os.path.isdir(model_dir) else " (no such directory)"
    raise FileNotFoundError(f"no tokenizer in {model_dir}{where}: looked for {' and '.join(TOKENIZER_FILES)}; "
                            "copy the model's tokenizer file there")
