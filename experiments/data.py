"""Training text every machine has offline: the running interpreter's standard-library ``.py`` sources.

The corpus is pinned by ``experiments/data_manifest.json``: the sorted relative file list, a SHA-256 per
file, and one SHA-256 over the concatenated contents (in list order), plus the Python version that
produced it. Loading verifies every hash and raises ``DataMismatch`` naming the first differing files;
scripts may pass ``--allow-mismatch`` to proceed (with a warning) on a different Python build, using
the local files that the rules select.

Split: a file is held out iff ``int(sha256(relpath)[:8], 16) % 10 == 0`` (deterministic, by file, never
trained on). Eval prompts are cut from held-out files at line boundaries. The first 16 that ``run_decode.py``
cuts by default (the shipped tokenizer, seed 0, 64-128 tokens) ship as texts in
``experiments/heldout_prompts.json``, so that its default prompts are the pinned ones on any Python
(``shipped_prompts``; ``python experiments/data.py prompts`` rewrites the file, on the pinned stdlib only).

Commands::

    python experiments/data.py manifest              # (re)write experiments/data_manifest.json
    python experiments/data.py verify [--allow-mismatch]
    python experiments/data.py tokenizer --vocab 4096 --out checkpoints/tokenizer
    python experiments/data.py tokens --out tmp/tokens.npz   # both splits tokenized, for another machine
    python experiments/data.py prompts               # (re)write experiments/heldout_prompts.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import sysconfig
import warnings
from typing import Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST_PATH = os.path.join(ROOT, "experiments", "data_manifest.json")
MANIFEST_FORMAT = "ddtree-jax-stdlib-corpus/1"
# Directory names never taken: installed/vendored packages, caches, the pip bundle, generated tables
# (pydoc topics, codec tables). The test suite, IDLE and the demos are real, hand-written Python and stay.
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "ensurepip", "pydoc_data", "encodings", "lib-dynload",
})
EXCLUDED_DIR_PREFIXES = ("config-",)  # e.g. config-3.11-x86_64-linux-gnu (build files)
EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)  # generated at build time
SPECIAL_TOKENS = ("<|endoftext|>", "<|mask|>")  # ids 0 and 1 of the trained tokenizer
PROMPTS_PATH = os.path.join(ROOT, "experiments", "heldout_prompts.json")
PROMPTS_FORMAT = "ddtree-jax-heldout-prompts/1"
SHIPPED_TOKENIZER_DIR = os.path.join(ROOT, "checkpoints", "tokenizer")
PROMPT_TOKENS = {"min_tokens": 64, "max_tokens": 128}  # each held-out prompt's length, in tokens (run_decode's)
SHIPPED_PROMPT_CUT = {"seed": 0, **PROMPT_TOKENS, "count": 16}  # run_decode's default cut
EOS_TOKEN, MASK_TOKEN = SPECIAL_TOKENS


class DataMismatch(RuntimeError):
    """The local standard library differs from the pinned manifest."""


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def python_version() -> str:
    return ".".join(str(v) for v in sys.version_info[:3])


def list_files(root: str) -> list[str]:
    """Sorted relative POSIX paths of the ``.py`` files under ``root`` that the rules select."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if d not in EXCLUDED_DIRS and not d.startswith(EXCLUDED_DIR_PREFIXES)]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(EXCLUDED_FILE_PREFIXES):
                out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(out)


def _read(root: str, rel: str) -> bytes:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


def is_heldout(rel: str) -> bool:
    """The held-out rule: about 1 file in 10, decided by the hash of its relative path."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 10 == 0


def build_manifest(root: str | None = None) -> dict:
    """The manifest of the corpus under ``root`` (default: this interpreter's stdlib)."""
    root = root or stdlib_dir()
    total = hashlib.sha256()
    files = []
    for rel in list_files(root):
        data = _read(root, rel)
        total.update(data)
        files.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                      "heldout": is_heldout(rel)})
    return {"format": MANIFEST_FORMAT, "python_version": python_version(), "source": "sysconfig stdlib",
            "rules": {"excluded_dirs": sorted(EXCLUDED_DIRS), "excluded_dir_prefixes": list(EXCLUDED_DIR_PREFIXES),
                      "excluded_file_prefixes": list(EXCLUDED_FILE_PREFIXES),
                      "heldout": "int(sha256(relpath)[:8], 16) % 10 == 0"},
            "num_files": len(files), "num_heldout": sum(f["heldout"] for f in files),
            "total_bytes": sum(f["bytes"] for f in files), "total_sha256": total.hexdigest(), "files": files}


def load_manifest(path: str = MANIFEST_PATH) -> dict:
    if not os.path.exists(path):
        raise DataMismatch(f"no data manifest at {path}; run `python experiments/data.py manifest`")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise DataMismatch(f"{path}: unknown manifest format {manifest.get('format')!r}")
    return manifest


def verify(manifest: dict, root: str | None = None, *, allow_mismatch: bool = False) -> list[dict]:
    """Checks the local files against the manifest; returns the file entries to use.

    Raises DataMismatch naming missing / changed / extra files and the Python versions, unless
    ``allow_mismatch``: then it warns and returns the local selection (hashes recomputed, split rule
    unchanged), so training proceeds on this machine's stdlib with a different data hash.
    """
    root = root or stdlib_dir()
    local = build_manifest(root)
    if local["total_sha256"] == manifest["total_sha256"] and \
            [f["path"] for f in local["files"]] == [f["path"] for f in manifest["files"]]:
        return manifest["files"]
    pinned = {f["path"]: f["sha256"] for f in manifest["files"]}
    here = {f["path"]: f["sha256"] for f in local["files"]}
    missing = sorted(set(pinned) - set(here))
    extra = sorted(set(here) - set(pinned))
    changed = sorted(p for p in set(pinned) & set(here) if pinned[p] != here[p])
    msg = (f"local stdlib at {root} (Python {local['python_version']}) differs from the manifest "
           f"(Python {manifest['python_version']}): {len(changed)} changed e.g. {changed[:3]}, "
           f"{len(missing)} missing e.g. {missing[:3]}, {len(extra)} extra e.g. {extra[:3]}; "
           f"total sha256 {local['total_sha256'][:12]} != {manifest['total_sha256'][:12]}")
    if not allow_mismatch:
        raise DataMismatch(msg + " (pass --allow-mismatch to train on the local files anyway)")
    warnings.warn(msg + "; proceeding on the local files (--allow-mismatch)", stacklevel=2)
    return local["files"]


def data_hash(files: Sequence[dict]) -> str:
    """SHA-256 over the per-file hashes in order (equals nothing else; identifies a file selection)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f["sha256"].encode())
    return h.hexdigest()


def load_texts(split: str, *, manifest_path: str = MANIFEST_PATH, root: str | None = None,
               allow_mismatch: bool = False) -> tuple[list[tuple[str, str]], dict]:
    """(relpath, text) of the ``split`` ("train" or "heldout") after verification, and an info dict
    (python_version: this interpreter's, whose files are read; manifest_python_version: the pinned one;
    total_sha256 of the manifest, data_hash of the files used, num_files)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_dir()
    manifest = load_manifest(manifest_path)
    files = verify(manifest, root, allow_mismatch=allow_mismatch)
    chosen = [f for f in files if f["heldout"] == (split == "heldout")]
    texts = [(f["path"], _read(root, f["path"]).decode("utf-8", errors="replace")) for f in chosen]
    info = {"python_version": python_version(), "manifest_python_version": manifest["python_version"],
            "manifest_total_sha256": manifest["total_sha256"],
            "data_hash": data_hash(files), "split": split, "num_files": len(chosen)}
    return texts, info


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------
def train_tokenizer(texts: Sequence[str], vocab_size: int = 4096):
    """A byte-level BPE (``tokenizers``) trained on ``texts``; special tokens <|endoftext|>=0, <|mask|>=1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def encode_docs(tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids (int32) of each text; ``tokenizer`` is a ``tokenizers.Tokenizer`` or has ``encode``."""
    if hasattr(tokenizer, "encode_batch"):
        return [np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch(list(texts))]
    return [np.asarray(tokenizer.encode(t), np.int32) for t in texts]


def token_stream(docs: Sequence[np.ndarray], eos_id: int) -> np.ndarray:
    """The docs joined into one int32 stream with EOS after each doc."""
    return np.concatenate([np.append(d, eos_id) for d in docs]).astype(np.int32)


def pack(docs: Sequence[np.ndarray] | np.ndarray, seq_len: int, eos_id: int | None = None) -> np.ndarray:
    """Sequence packing: ``docs`` (a list of token arrays, joined by ``token_stream``, or an already
    joined 1-D stream) cut into rows of ``seq_len + 1`` tokens (inputs = row[:-1], labels = row[1:]);
    the ragged tail is dropped. Returns int32 [N, seq_len + 1]."""
    if isinstance(docs, np.ndarray) and docs.ndim == 1:
        stream = docs.astype(np.int32)
    else:
        if eos_id is None:
            raise ValueError("pack: eos_id is required to join a list of docs")
        stream = token_stream(docs, eos_id)
    n = len(stream) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"pack: a stream of {len(stream)} tokens holds no row of {seq_len + 1}")
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


TOKENS_FORMAT = "ddtree-jax-token-streams/1"


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def corpus_streams(tokenizer, *, tokenizer_path: str, tokens_path: str | None = None,
                   allow_mismatch: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train stream, held-out stream, info): both splits tokenized and joined (``token_stream``).

    From ``tokens_path`` (an ``export_tokens`` file, checked against ``tokenizer_path``) when given,
    else from this machine's verified standard library."""
    if tokens_path is not None:
        return load_tokens(tokens_path, tokenizer_path=tokenizer_path)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    train, info = load_texts("train", allow_mismatch=allow_mismatch)
    held, held_info = load_texts("heldout", allow_mismatch=allow_mismatch)
    train_stream = token_stream(encode_docs(tokenizer, [t for _, t in train]), eos)
    held_stream = token_stream(encode_docs(tokenizer, [t for _, t in held]), eos)
    info = dict(info, heldout_files=held_info["num_files"], tokenizer_sha256=_file_sha256(tokenizer_path),
                train_tokens=int(len(train_stream)), heldout_tokens=int(len(held_stream)))
    return train_stream, held_stream, info


def export_tokens(tokenizer, out: str, *, tokenizer_path: str, allow_mismatch: bool = False) -> dict:
    """Writes ``corpus_streams`` to ``out`` (.npz: ``train``, ``heldout`` int32 streams and ``info`` JSON).
    This is how the corpus travels to a machine whose own standard library differs (e.g. the GPU box's
    Python 3.12): the trainers take ``--tokens out.npz`` instead of reading the stdlib."""
    train, held, info = corpus_streams(tokenizer, tokenizer_path=tokenizer_path, allow_mismatch=allow_mismatch)
    info = dict(info, format=TOKENS_FORMAT)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    np.savez_compressed(out, train=train, heldout=held, info=np.array(json.dumps(info)))
    return info


def load_tokens(path: str, *, tokenizer_path: str | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train stream, held-out stream, info) from ``export_tokens``. With ``tokenizer_path``, raises
    DataMismatch unless the streams were made with that exact tokenizer file."""
    with np.load(path) as z:
        info = json.loads(str(z["info"]))
        train, held = z["train"].astype(np.int32), z["heldout"].astype(np.int32)
    if info.get("format") != TOKENS_FORMAT:
        raise DataMismatch(f"{path}: unknown token-stream format {info.get('format')!r}")
    if tokenizer_path is not None:
        sha = _file_sha256(tokenizer_path)
        if sha != info["tokenizer_sha256"]:
            raise DataMismatch(f"{path} was tokenized with tokenizer sha256 {info['tokenizer_sha256'][:12]}, "
                               f"but {tokenizer_path} has {sha[:12]}; re-export with `data.py tokens`")
    return train, held, info


def eval_prompts(tokenizer, texts: Sequence[tuple[str, str]], n: int = 64, min_tokens: int = 64,
                 max_tokens: int = 256, seed: int = 0, exclude: Sequence[str] = ()) -> list[dict]:
    """``n`` prompts cut from held-out texts at line boundaries, each ``min_tokens..max_tokens`` tokens, none
    found verbatim in any of ``exclude`` (the training texts: held-out files can share text with training ones,
    e.g. two tests' common fixture).

    Deterministic for a given (texts, tokenizer, seed, exclude): a seeded RNG picks a file and a start line, and
    lines are added while the prompt stays <= max_tokens. Returns [{"path", "line", "text", "ids"}].
    """
    rng = random.Random(seed)
    files = [(p, t.splitlines(keepends=True)) for p, t in texts]
    files = [(p, lines) for p, lines in files if len(lines) > 8]
    out, tries = [], 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        path, lines = files[rng.randrange(len(files))]
        start = rng.randrange(len(lines))
        text, ids = "", []
        for line in lines[start:]:
            cand = text + line
            cand_ids = tokenizer.encode(cand)
            cand_ids = cand_ids.ids if hasattr(cand_ids, "ids") else cand_ids
            if len(cand_ids) > max_tokens:
                break
            text, ids = cand, cand_ids
        if len(ids) >= min_tokens and not any(text in other for other in exclude):
            out.append({"path": path, "line": start, "text": text, "ids": list(map(int, ids))})
    if len(out) < n:
        raise ValueError(f"could only cut {len(out)} of {n} prompts of {min_tokens}-{max_tokens} tokens")
    return out


def tokenizer_file_fingerprint(model_dir: str) -> str | None:
    """``"<file>:sha256:<hex>"`` of the tokenizer file ``load_tokenizer`` reads from ``model_dir``
    (``tokenizer.json``, else ``tiktoken.model``); None where it has neither (a model without a directory takes
    the byte tokenizer)."""
    from ddtree_jax.tokenizer import tokenizer_file

    name = tokenizer_file(model_dir)
    return None if name is None else f"{name}:sha256:{_file_sha256(os.path.join(model_dir, name))}"


def cut_heldout_prompts(tokenizer, n: int, *, seed: int, min_tokens: int, max_tokens: int,
                        allow_mismatch: bool = False) -> list[dict]:
    """``eval_prompts`` over this machine's held-out files, none of whose text is in a training file (``load_texts``;
    a stdlib other than the pinned one is refused, or warned about and used with ``allow_mismatch``)."""
    held, _ = load_texts("heldout", allow_mismatch=allow_mismatch)
    train, _ = load_texts("train", allow_mismatch=allow_mismatch)
    return eval_prompts(tokenizer, held, n=n, min_tokens=min_tokens, max_tokens=max_tokens, seed=seed,
                        exclude=[text for _, text in train])


def write_shipped_prompts(path: str = PROMPTS_PATH, tokenizer_dir: str = SHIPPED_TOKENIZER_DIR) -> dict:
    """Writes ``SHIPPED_PROMPT_CUT``'s prompts, cut from the pinned held-out files (this machine's stdlib must be
    the manifest's) with the tokenizer in ``tokenizer_dir``, to ``path``; returns what it wrote."""
    from tokenizers import Tokenizer

    cut = dict(SHIPPED_PROMPT_CUT)
    fingerprint = tokenizer_file_fingerprint(tokenizer_dir)
    if fingerprint is None or not fingerprint.startswith("tokenizer.json:"):
        raise ValueError(f"{tokenizer_dir} holds no tokenizer.json")
    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    manifest = load_manifest()
    prompts = cut_heldout_prompts(tokenizer, cut.pop("count"), **cut)
    payload = {"format": PROMPTS_FORMAT,
               "source": f"held-out files of CPython {manifest['python_version']}'s standard library (PSF License)",
               "tokenizer": fingerprint, **cut,
               "python_version": manifest["python_version"], "manifest_total_sha256": manifest["total_sha256"],
               "prompts": [{"path": q["path"], "line": q["line"], "text": q["text"]} for q in prompts]}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return payload


def shipped_prompts(tokenizer_fingerprint: str | None, n: int, *, seed: int, min_tokens: int, max_tokens: int,
                    path: str = PROMPTS_PATH) -> list[str] | None:
    """The first ``n`` texts of the shipped held-out prompts when they are the cut asked for (the same
    tokenizer file, seed and token range, ``n`` within the file's count), else None (cut them from the
    stdlib then: ``cut_heldout_prompts``). They equal that cut on the pinned stdlib, on any machine."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != PROMPTS_FORMAT:
        raise ValueError(f"{path}: not a {PROMPTS_FORMAT} file (rewrite it with `python experiments/data.py prompts`)")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    asked = (tokenizer_fingerprint, seed, min_tokens, max_tokens)
    if asked != (data["tokenizer"], data["seed"], data["min_tokens"], data["max_tokens"]) or n > len(data["prompts"]):
        return None
    return [q["text"] for q in data["prompts"][:n]]


def git_commit() -> str:
    import subprocess

    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("manifest", help="write experiments/data_manifest.json from this interpreter's stdlib")
    v = sub.add_parser("verify")
    v.add_argument("--allow-mismatch", action="store_true")
    t = sub.add_parser("tokenizer", help="train the byte-level BPE on the training split")
    t.add_argument("--vocab", type=int, default=4096)
    t.add_argument("--out", default=os.path.join(ROOT, "checkpoints", "tokenizer"))
    t.add_argument("--allow-mismatch", action="store_true")
    x = sub.add_parser("tokens", help="tokenize both splits into one .npz for --tokens (see export_tokens)")
    x.add_argument("--tokenizer", default=os.path.join(ROOT, "checkpoints", "tokenizer", "tokenizer.json"))
    x.add_argument("--out", required=True)
    x.add_argument("--allow-mismatch", action="store_true")
    sub.add_parser("prompts", help="write experiments/heldout_prompts.json (run_decode's default prompts) from the "
                                   "pinned held-out files")
    args = p.parse_args(argv)
    least = 256 + len(SPECIAL_TOKENS)  # the byte alphabet and the special tokens come first
    if args.cmd == "tokenizer" and args.vocab < least:
        p.error(f"--vocab {args.vocab}: the byte alphabet and the special tokens alone take {least}")
    if args.cmd == "prompts":
        payload = write_shipped_prompts()
        print(f"wrote {PROMPTS_PATH}: {len(payload['prompts'])} prompts, tokenizer {payload['tokenizer']}")
    elif args.cmd == "manifest":
        manifest = build_manifest()
        with open(MANIFEST_PATH, "w") as f:
            json.dump(manifest, f, indent=0)
            f.write("\n")
        print(f"wrote {MANIFEST_PATH}: {manifest['num_files']} files ({manifest['num_heldout']} held out), "
              f"{manifest['total_bytes'] / 1e6:.1f} MB, sha256 {manifest['total_sha256']}")
    elif args.cmd == "verify":
        files = verify(load_manifest(), allow_mismatch=args.allow_mismatch)
        print(f"ok: {len(files)} files, data hash {data_hash(files)}")
    elif args.cmd == "tokenizer":
        texts, info = load_texts("train", allow_mismatch=args.allow_mismatch)
        tok = train_tokenizer([t for _, t in texts], args.vocab)
        os.makedirs(args.out, exist_ok=True)
        tok.save(os.path.join(args.out, "tokenizer.json"))
        sample = "def f(x):\n    return x + 1\n"
        assert tok.decode(tok.encode(sample).ids) == sample
        docs = encode_docs(tok, [t for _, t in texts])
        meta = {"command": " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)]
                                    + (argv if argv is not None else sys.argv[1:])),
                "commit": git_commit(), "vocab_size": tok.get_vocab_size(), "special_tokens": list(SPECIAL_TOKENS),
                "train_tokens": int(sum(len(d) for d in docs)),
                "train_bytes": int(sum(os.path.getsize(os.path.join(stdlib_dir(), p)) for p, _ in texts)),
                **info}
        with open(os.path.join(args.out, "manifest.json"), "w") as f:
            json.dump(meta, f, indent=1)
        print(json.dumps(meta, indent=1))
    elif args.cmd == "tokens":
        from tokenizers import Tokenizer

        info = export_tokens(Tokenizer.from_file(args.tokenizer), args.out, tokenizer_path=args.tokenizer,
                             allow_mismatch=args.allow_mismatch)
        print(f"wrote {args.out}: {info['train_tokens']} train / {info['heldout_tokens']} held-out tokens, "
              f"data hash {info['data_hash'][:12]}")


if __name__ == "__main__":
    main()
