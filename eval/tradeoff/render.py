"""The report's files: one table (markdown and HTML), the recommendations, and a self-contained HTML page
with the plots embedded as data URIs (no external resource: it reads offline)."""
from __future__ import annotations

import base64
import html
from pathlib import Path

from eval.report import SIZE_ON_DISK

STAR = "★"


def _num(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _get(row: dict, *keys):
    cur = row
    for k in keys:
        if not isinstance(cur, dict) or cur.get(k) is None:
            return None
        cur = cur[k]
    return cur


def columns(result: dict) -> list[tuple[str, object]]:
    """(header, row -> cell text) for every column the report's settings produce."""
    s = result["settings"]
    texts, primary = s["ppl"], s["ppl"][0]
    base = result.get("baseline_ppl") or {}
    cols = [("variant", lambda r: r["label"] + (f" {STAR}" if r.get("pareto") else "")),
            ("size MiB", lambda r: _num(_get(r, "quality", "size_bytes") and r["quality"]["size_bytes"] / 2**20,
                                         "{:.1f}")),
            ("bits/weight", lambda r: _num(_get(r, "quality", "bits_per_weight"), "{:.2f}"))]
    for t in texts:
        def ppl(r, t=t):
            v = _get(r, "quality", "ppl", t)
            delta = f" ({100 * (v / base[t] - 1):+.1f}%)" if v is not None and base.get(t) else ""
            return _num(v, "{:.2f}") + delta
        cols.append((f"ppl {Path(t).name}", ppl))
    cols += [(f"KL mean {Path(primary).name}", lambda r: _num(_get(r, "quality", "kl", primary, "mean"), "{:.4f}")),
             (f"KL p99 {Path(primary).name}", lambda r: _num(_get(r, "quality", "kl", primary, "p99"), "{:.3f}"))]
    if s["tasks"]:
        cols.append(("avg acc %", lambda r: _num(_get(r, "quality", "accuracy_avg") and
                                                 100 * r["quality"]["accuracy_avg"], "{:.1f}")))
    if s["speed"]:
        n = s["concurrency"]
        cols += [("TTFT ms", lambda r: _num(_get(r, "speed", "ttft_ms"), "{:.0f}")),
                 ("TPOT ms", lambda r: _num(_get(r, "speed", "tpot_ms"), "{:.1f}")),
                 ("decode tok/s", lambda r: _num(_get(r, "speed", "decode_tok_s"), "{:.1f}")),
                 (f"tok/s @{n}", lambda r: _num(_get(r, "speed", "output_tok_s"), "{:.1f}")),
                 ("KV B/token", lambda r: _num(_get(r, "speed", "kv_bytes_per_token"), "{:,.0f}")),
                 ("runtime", lambda r: _get(r, "speed", "runtime") or "-")]
    cols += [("quantize s", lambda r: _num(_get(r, "made", "quantize", "seconds"), "{:.0f}")),
             ("peak MiB", lambda r: _num(_get(r, "made", "quantize", "peak_rss_bytes") and
                                         r["made"]["quantize"]["peak_rss_bytes"] / 2**20, "{:.0f}")),
             ("error", lambda r: (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160] or "")]
    return cols


def table_cells(result: dict) -> tuple[list[str], list[list[str]]]:
    cols = columns(result)
    return [h for h, _ in cols], [[get(r) for _, get in cols] for r in result["rows"]]


def notes(result: dict) -> list[str]:
    """Lines under the table: what each column measures and on which settings."""
    s = result["settings"]
    out = [f"{STAR}: Pareto-optimal on (size, perplexity on {Path(s['ppl'][0]).name}, batch-1 decode speed): "
           "no other variant is at least as good on all three and better on one.",
           f"Perplexity: eval split, {result['windows']} windows of {s['seqlen']} tokens; change in % against "
           f"{result['baseline'] or 'no baseline'}. KL: KL(fp || variant) of the next-token distributions on the "
           "same tokens, mean and 99th percentile over tokens.",
           "Size: weight files on disk (ONNX: its .onnx files; GGUF: the file)"
           + "".join(f"; {r['label']}: {r['quality']['size_label']}" for r in result["rows"]
                     if r.get("quality") and r["quality"]["size_label"] != SIZE_ON_DISK)
           + "; bits/weight = 8 x size / parameters of the fp model."]
    if s["speed"]:
        out.append(f"Speed: prompts of {s['prompt_len']} tokens, {s['output_len']} new tokens each, EOS ignored; "
                   f"TTFT/TPOT medians at batch 1, tok/s @{s['concurrency']} = output tokens per second with "
                   f"{s['concurrency']} requests at once; each row in the runtime that serves its artifact, "
                   f"threads: {result['machine'].get('threads', '?')}.")
    paired = [r["label"] for r in result["rows"] if r.get("overrides")]
    if paired:
        out.append(f"{', '.join(paired)}: the recipe of the same name with its embedding and LM head kept full width "
                   "(embed/head none, in the source's dtype), quantized and measured as any other row: the "
                   "difference to that row is what the quantized tables save and cost.")
    if s["tasks"]:
        out.append(f"Accuracy: mean of {', '.join(s['tasks'])}" + (f", first {s['limit']} documents each"
                                                                     if s["limit"] else "") + ".")
    return out


def markdown(result: dict, plots: list[str]) -> str:
    head, rows = table_cells(result)
    lines = [f"# Trade-off report: {result['model']}", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + [f"- {n}" for n in notes(result)] + ["", "## Recommendations", ""]
    lines += [f"- {r['goal']}: **{r['label'] or '-'}** ({r['why']})" for r in result["recommendations"]]
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    lines += ["", f"Made by: `{result['command']}` on {result['machine']['cpu']} ({result['date']})", ""]
    return "\n".join(lines)


CSS = ("body{font-family:sans-serif;margin:2em;color:#222}table{border-collapse:collapse;font-size:13px}"
       "td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}td:first-child,th:first-child{text-align:left}"
       "tr.front td:first-child{font-weight:bold}img{max-width:100%;margin:1em 0}code{background:#f4f4f4}")


def html_page(result: dict, plots: dict[str, bytes]) -> str:
    """One self-contained page: inline CSS, the table, recommendations, notes and the plots as data URIs."""
    e = html.escape
    head, rows = table_cells(result)
    body = [f"<h1>Trade-off report: {e(result['model'])}</h1>", "<table><tr>"
            + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for row, cells in zip(result["rows"], rows):
        cls = ' class="front"' if row.get("pareto") else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    body.append("</table><ul>" + "".join(f"<li>{e(n)}</li>" for n in notes(result)) + "</ul>")
    body.append("<h2>Recommendations</h2><ul>" + "".join(
        f"<li>{e(r['goal'])}: <b>{e(r['label'] or '-')}</b> ({e(r['why'])})</li>" for r in result["recommendations"])
        + "</ul><h2>Plots</h2>")
    for name, png in plots.items():
        data = base64.b64encode(png).decode("ascii")
        body.append(f'<img alt="{e(name)}" src="data:image/png;base64,{data}">')
    body.append(f"<p>Made by: <code>{e(result['command'])}</code> on {e(result['machine']['cpu'])} "
                f"({e(result['date'])})</p>")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Trade-off report: "
            f"{e(result['model'])}</title><style>{CSS}</style></head><body>" + "\n".join(body) + "</body></html>\n")
