import bz2
import json
import logging

import pytest
import torch

from compress import data

SNIPPET = """{{Infobox person|name=Ada {{nowrap|Lovelace}}|born=1815}}
'''Ada Lovelace''' was an [[England|English]] [[mathematician]] and writer.<ref name="a">{{cite book|title=X}}</ref> She worked on the [[Analytical Engine]].<ref name="b"/> See [http://example.org the archive] too.
<!-- an editor's comment -->
[[File:Ada.jpg|thumb|Portrait of [[Ada Lovelace|Ada]] in 1840]]
{| class="wikitable"
|-
| cell one || cell two
|}
== Early life ==
* She was born in London &amp; raised by her mother.
{{Main|Ada Lovelace early life}}
== References ==
{{reflist}}
* Some book, 1990.
[[Category:Mathematicians]]
[[de:Ada Lovelace]]"""


def test_clean_wikitext_keeps_prose_and_drops_markup():
    text = data.clean_wikitext(SNIPPET)
    assert text.startswith("Ada Lovelace was an English mathematician and writer. She worked on the Analytical Engine.")
    assert "See the archive too." in text
    assert "\nEarly life\n" in text  # headings become plain lines
    assert "She was born in London & raised by her mother." in text
    for residue in ("{{", "}}", "[[", "]]", "<ref", "cite", "Infobox", "thumb", "Portrait", "cell one", "comment",
                    "References", "Some book", "Category", "Mathematicians", "de:", "'''"):
        assert residue not in text, residue


def _page(title: str, ns: int, body: str) -> str:
    return f"<page><title>{title}</title><ns>{ns}</ns><revision><text>{body}</text></revision></page>"


def test_parse_wiki_dump_keeps_only_real_articles(tmp_path):
    long = "Rivers carry water to the sea. " * 30
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
           + _page("Redirected", 0, "#REDIRECT [[Somewhere]] " + long)
           + _page("Talk:River", 1, long)
           + _page("Stub", 0, "Too short.")
           + _page("River", 0, "'''River''' " + long) + "</mediawiki>")
    path = tmp_path / "dump.xml.bz2"
    path.write_bytes(bz2.compress(xml.encode()))
    assert data.parse_wiki_dump(path) == [("River " + long).strip()]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "data"


def test_wiki_splits_are_disjoint_60_40_and_cached(cache):
    calib, held_out = data.load_texts("wiki", "calib"), data.load_texts("wiki", "eval")
    n = len(calib) + len(held_out)
    assert n > 50 and len(calib) == int(n * data.CALIB_FRACTION)
    assert not set(calib) & set(held_out)
    assert min(map(len, calib + held_out)) >= data.MIN_ARTICLE_CHARS
    cached = list(cache.glob("wiki-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == calib + held_out


def test_lambada_splits_halves():
    calib, held_out = data.load_texts("lambada", "calib"), data.load_texts("lambada", "eval")
    assert (len(calib), len(held_out)) == (2576, 2577)
    assert not set(calib) & set(held_out)


def test_txt_and_jsonl_split_60_40(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("\n\n".join(f"paragraph {i}" for i in range(5)))
    assert data.load_texts(str(txt), "calib") == ["paragraph 0", "paragraph 1", "paragraph 2"]
    assert data.load_texts(str(txt), "eval") == ["paragraph 3", "paragraph 4"]
    jl = tmp_path / "a.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"doc {i}", "id": i}) for i in range(10)))
    assert data.load_texts(str(jl), "eval") == [f"doc {i}" for i in range(6, 10)]


def test_single_document_file_serves_both_splits_with_warning(tmp_path, caplog):
    txt = tmp_path / "one.txt"
    txt.write_text("just one paragraph\nover two lines")
    with caplog.at_level(logging.WARNING, logger="compress.data"):
        assert data.load_texts(str(txt), "calib") == data.load_texts(str(txt), "eval")
    assert "single document" in caplog.text


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="wiki, lambada"):
        data.load_texts("no-such-source-anywhere", "calib")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.load_texts(str(tmp_path / "missing.txt"), "calib")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(ValueError, match="no text"):
        data.load_texts(str(empty), "eval")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        data.load_texts(str(bad), "calib")
    with pytest.raises(ValueError, match="split 'train'"):
        data.load_texts("wiki", "train")
    other = tmp_path / "notes.md"
    other.write_text("text")
    with pytest.raises(ValueError, match=r"\.txt or \.jsonl"):
        data.load_texts(str(other), "calib")


class CharTokenizer:
    def __call__(self, text, **_):
        return {"input_ids": list(text.encode("utf-8"))}


def test_calibration_batches_shape_seed_and_windows(tmp_path):
    txt = tmp_path / "c.txt"
    txt.write_text("\n\n".join(f"paragraph number {i} with some words" for i in range(50)))
    tok = CharTokenizer()
    a = data.calibration_batches(tok, str(txt), nsamples=6, seqlen=40, seed=3)
    assert a.shape == (6, 40) and a.dtype == torch.long
    assert torch.equal(a, data.calibration_batches(tok, str(txt), nsamples=6, seqlen=40, seed=3))
    assert not torch.equal(a, data.calibration_batches(tok, str(txt), nsamples=6, seqlen=40, seed=4))
    stream = bytes("\n\n".join(data.load_texts(str(txt), "calib")), "utf-8")
    for row in a:
        assert bytes(row.tolist()) in stream  # each sample is a contiguous window of the calib split


def test_calibration_batches_too_short_names_the_numbers(tmp_path):
    txt = tmp_path / "s.txt"
    txt.write_text("tiny\n\ntext")
    with pytest.raises(ValueError, match=r"has 4 tokens; need at least seqlen=64"):
        data.calibration_batches(CharTokenizer(), str(txt), nsamples=2, seqlen=64)


def test_news_splits_60_40():
    calib, held_out = data.load_texts("news", "calib"), data.load_texts("news", "eval")
    assert (len(calib), len(held_out)) == (180, 120) and not set(calib) & set(held_out)
    assert calib[0].startswith("Hundreds of people have been forced to vacate their homes")


def test_coqa_passages_split_60_40_once_each():
    """CoQA's file holds one row per question: each passage is taken once, in file order."""
    calib, held_out = data.load_texts("coqa", "calib"), data.load_texts("coqa", "eval")
    assert (len(calib), len(held_out)) == (299, 200) and not set(calib) & set(held_out)
    assert calib[0].startswith("Once upon a time, in a barn near a farm house")
    assert len(set(calib + held_out)) == 499


def test_calibration_mix_draws_each_source_alike_and_shuffles(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n\n".join("a" * 30 for _ in range(20)))
    b.write_text("\n\n".join("b" * 30 for _ in range(20)))
    tok = CharTokenizer()
    mix = data.calibration_batches(tok, f"{a}+{b}", nsamples=9, seqlen=8, seed=1)
    from_a = (mix == ord("a")).any(dim=1)
    assert mix.shape == (9, 8) and int(from_a.sum()) == 5  # 5 + 4: the first source takes the remainder
    assert not from_a[:5].all(), "the windows are shuffled, not one source after the other"
    assert torch.equal(mix, data.calibration_batches(tok, f"{a}+{b}", nsamples=9, seqlen=8, seed=1))
    plus = tmp_path / "x+y.txt"  # a file whose name holds a + is a file, not a mix
    plus.write_text("\n\n".join("c" * 30 for _ in range(20)))
    assert data.calibration_batches(tok, str(plus), nsamples=2, seqlen=8).shape == (2, 8)
    with pytest.raises(ValueError, match="distinct sources"):
        data.calibration_batches(tok, f"{a}+{a}", nsamples=4, seqlen=8)
    with pytest.raises(ValueError, match="nsamples=1 cannot draw a window from each of the 2 sources"):
        data.calibration_batches(tok, f"{a}+{b}", nsamples=1, seqlen=8)


def test_calibration_batches_with_the_real_tokenizer(smol_tokenizer):
    batch = data.calibration_batches(smol_tokenizer, "lambada", nsamples=4, seqlen=128, seed=0)
    assert batch.shape == (4, 128) and int(batch.max()) < len(smol_tokenizer)
