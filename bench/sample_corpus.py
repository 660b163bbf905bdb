"""The sample model's corpus: five labelled domains of text found offline on a stock Debian machine.

Domains and sources (files are read in sorted order; a document's split is a hash of its path, so adding
or removing a file never moves another document between train and held-out):
  python_code      /usr/lib/python3.X/**/*.py (stdlib; tests, site-/dist-packages, idlelib, lib2to3 and the
                   generated _sysconfigdata skipped), docstrings
                   blanked out so that they form their own domain
  python_docstring the same files' docstrings (module, class, function), extracted with `ast`
  license          /usr/share/common-licenses/* and /usr/share/doc/*/copyright (deduplicated by content)
  changelog        /usr/share/doc/*/changelog.Debian.gz
  manpage          /usr/share/man/man1/*.gz (roff source; `.so` redirects skipped)

Writes into the corpus folder: documents.jsonl.gz (one {"domain", "source", "split", "text"} a line),
tokenizer.json (byte-level BPE trained with `tokenizers` on a balanced sample of the train split) and
manifest.json (sources, counts, bytes per domain and split).

Run:   .venv/bin/python -m bench.sample_corpus --corpus .corpus
Smoke: .venv/bin/python -m bench.sample_corpus --smoke   (2 documents a domain and split, a temporary folder)
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import hashlib
import inspect
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

DOMAINS = ("python_code", "python_docstring", "license", "changelog", "manpage")
EOT = "<|endoftext|>"  # id 0: document separator, bos and eos of the sample model
HELDOUT_PERCENT = 8  # of each domain's documents, by path hash (docstrings: ~30 modules, ~20k tokens)
MAX_DOC_CHARS = 48_000  # one long changelog must not outweigh hundreds of short ones
MIN_DOC_CHARS = 200
DOMAIN_CAP_CHARS = 12_000_000  # ~12 MB of text a domain: ~4M tokens at ~3 chars/token
TOKENIZER_SAMPLE_CHARS = 2_000_000  # per domain, train split only


class Document(NamedTuple):
    domain: str
    source: str
    split: str  # train | heldout
    text: str


def _hash(source: str) -> int:
    return int(hashlib.sha1(source.encode()).hexdigest()[:8], 16)


def split_of(source: str) -> str:
    return "heldout" if _hash(source) % 100 < HELDOUT_PERCENT else "train"


def _stdlib_dir() -> Path:
    for cand in sorted(glob.glob("/usr/lib/python3.[0-9]*"), reverse=True):
        if (Path(cand) / "os.py").is_file():
            return Path(cand)
    # Not Debian: the running interpreter's stdlib (same layout, different path).
    return Path(ast.__file__).parent


def _python_files(root: Path) -> list[Path]:
    skip = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__"}
    return [p for p in sorted(root.rglob("*.py"))
            if not skip & set(p.relative_to(root).parts[:-1]) and not p.name.startswith("_sysconfigdata")]


def _docstring_nodes(tree: ast.Module) -> Iterator[ast.Constant]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                yield first.value


def python_documents() -> Iterator[Document]:
    for path in _python_files(_stdlib_dir()):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        docs: list[str] = []
        for node in _docstring_nodes(tree):
            docs.append(inspect.cleandoc(str(node.value)))
            assert node.end_lineno is not None
            for i in range(node.lineno - 1, node.end_lineno):
                lines[i] = ""  # docstring lines go to the docstring domain
        name = str(path)
        yield Document("python_code", name, split_of(name), "".join(lines))
        yield Document("python_docstring", name, split_of(name), "\n\n".join(d for d in docs if d.strip()))


def license_documents() -> Iterator[Document]:
    seen: set[str] = set()
    paths = sorted(glob.glob("/usr/share/common-licenses/*"))
    paths += sorted(glob.glob("/usr/share/doc/*/copyright"))
    for name in paths:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha1(text.encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            yield Document("license", name, split_of(name), text)


def _gz_documents(domain: str, pattern: str) -> Iterator[Document]:
    # Hash order, not name order: where the domain cap cuts, the kept pages are spread over the alphabet.
    for name in sorted(glob.glob(pattern), key=_hash):
        try:
            text = gzip.decompress(Path(name).read_bytes()).decode("utf-8")
        except (UnicodeDecodeError, OSError, EOFError):
            continue
        if text.startswith(".so "):  # a roff redirect to another page
            continue
        yield Document(domain, name, split_of(name), text)


def document_sources() -> list[tuple[tuple[str, ...], Iterator[Document]]]:
    """Each source's generator with the domains it yields, in corpus order."""
    return [
        (("python_code", "python_docstring"), python_documents()),
        (("license",), license_documents()),
        (("changelog",), _gz_documents("changelog", "/usr/share/doc/*/changelog.Debian.gz")),
        (("manpage",), _gz_documents("manpage", "/usr/share/man/man1/*.gz")),
    ]


def build_corpus(out: Path, per_split: int = 0) -> dict[str, object]:
    """Collect, cap and write the documents, then train the tokenizer. Returns the manifest. per_split > 0 (the
    smoke run): at most that many documents a domain and split, each source read only until its domains have them."""
    out.mkdir(parents=True, exist_ok=True)
    chars = {d: {"train": 0, "heldout": 0} for d in DOMAINS}
    docs = {d: {"train": 0, "heldout": 0} for d in DOMAINS}
    sample: dict[str, list[str]] = {d: [] for d in DOMAINS}

    def full(domain: str, split: str | None = None) -> bool:
        return per_split > 0 and all(docs[domain][s] >= per_split for s in ([split] if split else docs[domain]))

    with gzip.open(out / "documents.jsonl.gz", "wt", encoding="utf-8", compresslevel=6) as f:
        for domains, source in document_sources():
            for doc in source:
                text = doc.text.replace(EOT, "")[:MAX_DOC_CHARS]
                if (len(text.strip()) < MIN_DOC_CHARS or sum(chars[doc.domain].values()) >= DOMAIN_CAP_CHARS
                        or full(doc.domain, doc.split)):
                    continue
                f.write(json.dumps(doc._replace(text=text)._asdict(), ensure_ascii=False) + "\n")
                chars[doc.domain][doc.split] += len(text)
                docs[doc.domain][doc.split] += 1
                if doc.split == "train" and sum(len(t) for t in sample[doc.domain]) < TOKENIZER_SAMPLE_CHARS:
                    sample[doc.domain].append(text)
                if all(full(d) for d in domains):
                    break
    train_tokenizer([t for d in DOMAINS for t in sample[d]], out / "tokenizer.json")
    manifest: dict[str, object] = {
        "domains": list(DOMAINS), "documents": docs, "chars": chars, "heldout_percent": HELDOUT_PERCENT,
        "max_doc_chars": MAX_DOC_CHARS, "domain_cap_chars": DOMAIN_CAP_CHARS, "python": str(_stdlib_dir()),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def train_tokenizer(texts: list[str], path: Path, vocab_size: int = 4096) -> None:
    """Byte-level BPE (GPT-2 style pre-tokenisation); EOT is id 0. Deterministic for a given input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))


def read_documents(corpus: Path) -> list[Document]:
    with gzip.open(corpus / "documents.jsonl.gz", "rt", encoding="utf-8") as f:
        return [Document(**json.loads(line)) for line in f]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path(".corpus"))
    ap.add_argument("--smoke", action="store_true", help="2 documents a domain and split in a temporary folder")
    args = ap.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            json.dump(build_corpus(Path(tmp), per_split=2)["documents"], sys.stdout)
        print()
        return
    json.dump(build_corpus(args.corpus), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
