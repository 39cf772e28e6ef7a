"""Zero-shot accuracy on standard tasks through lm-eval's Python API, fully offline.

Each task is an lm-eval ``ConfigurableTask`` built here from a config dict whose ``custom_dataset`` reads the
local files (eval/task_data.py), with the prompts and metrics of lm-eval's own task YAMLs (hellaswag, piqa,
arc_easy, arc_challenge, winogrande, boolq, lambada_openai). The model is passed to ``HFLM`` already built,
so quantized models with QuantLinear modules are scored as they are (HFLM neither moves nor reloads them).
"""
from __future__ import annotations

import copy
import functools
import logging
import math
import re

from eval.progress import StepProgress, no_progress, quiet_third_party
from eval.task_data import SOURCES, load_docs

log = logging.getLogger(__name__)

ACC = {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
ACC_NORM = {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}
PPL = {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}


def _hellaswag_clean(text: str) -> str:
    """lm-eval's HellaSwag cleanup: WikiHow '[title]' markers become sentence breaks, other [tags] go."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag_doc(doc: dict) -> dict:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"query": _hellaswag_clean(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(e) for e in doc["endings"]], "gold": int(doc["label"])}


def _hellaswag_docs(ds):
    import datasets

    return datasets.Dataset.from_list([_hellaswag_doc(d) for d in ds])


def _query(doc: dict) -> str:
    return doc["query"]


def _choices(doc: dict) -> list[str]:
    return list(doc["choices"])


def _gold(doc: dict) -> int:
    return int(doc["gold"])


def _piqa_text(doc: dict) -> str:
    return f"Question: {doc['goal']}\nAnswer:"


def _piqa_choices(doc: dict) -> list[str]:
    return [doc["sol1"], doc["sol2"]]


def _label(doc: dict) -> int:
    return int(doc["label"])


def _winogrande_context_index(doc: dict) -> int:
    """Partial scoring: the contexts differ (one per option), the continuation after the blank is shared."""
    return {"1": 0, "2": 1}[doc["answer"]]


def _winogrande_continuation(doc: dict) -> str:
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()


def _winogrande_contexts(doc: dict) -> list[str]:
    cut = doc["sentence"].index("_")
    return [doc["sentence"][:cut] + option for option in (doc["option1"], doc["option2"])]


def _boolq_text(doc: dict) -> str:
    return f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"


def _boolq_target(doc: dict) -> int:
    return int(doc["answer"])


def _context(doc: dict) -> str:
    return doc["context"]


def _continuation(doc: dict) -> str:
    return doc["continuation"]


_MC = {"output_type": "multiple_choice"}
_ARC = {**_MC, "doc_to_text": _query, "doc_to_choice": _choices, "doc_to_target": _gold, "metric_list": [ACC, ACC_NORM]}
# task -> lm-eval config (prompts and metrics as in lm-eval's task YAMLs); the data comes from eval/task_data.py
TASKS: dict[str, dict] = {
    "hellaswag": {**_MC, "doc_to_text": _query, "doc_to_choice": _choices,
                  "doc_to_target": _gold, "metric_list": [ACC, ACC_NORM]},
    "piqa": {**_MC, "doc_to_text": _piqa_text, "doc_to_choice": _piqa_choices, "doc_to_target": _label,
             "metric_list": [ACC, ACC_NORM]},
    "arc_easy": _ARC,
    "arc_challenge": _ARC,
    "winogrande": {**_MC, "doc_to_text": _winogrande_context_index, "doc_to_choice": _winogrande_contexts,
                   "doc_to_target": _winogrande_continuation, "metric_list": [ACC]},
    "boolq": {**_MC, "doc_to_text": _boolq_text, "doc_to_choice": ["no", "yes"], "doc_to_target": _boolq_target,
              "metric_list": [ACC]},
    "lambada": {"output_type": "loglikelihood", "doc_to_text": _context, "doc_to_target": _continuation,
                "metric_list": [PPL, ACC]},
}
# task -> lm-eval's process_docs, applied once when the documents are loaded
PREPARE = {"hellaswag": _hellaswag_docs}
# the metric a table reports per task: length-normalized accuracy where lm-eval reports it, else accuracy
PRIMARY = {"hellaswag": "acc_norm", "piqa": "acc_norm", "arc_easy": "acc_norm", "arc_challenge": "acc_norm",
           "winogrande": "acc", "boolq": "acc", "lambada": "acc"}


def check_tasks(tasks: list[str]) -> None:
    """Raise ValueError naming the known tasks if any requested task is unknown."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}: use any of {', '.join(TASKS)}")


def _dataset(task: str, split: str, **_):
    import datasets

    docs = load_docs(task)
    return datasets.DatasetDict({split: PREPARE[task](docs) if task in PREPARE else docs})


def build_task(name: str):
    """An lm-eval ConfigurableTask for ``name``, reading its local data."""
    from lm_eval.api.task import ConfigurableTask

    check_tasks([name])
    split = SOURCES[name][2]
    cfg = {"task": name, **copy.deepcopy(TASKS[name]), "custom_dataset": functools.partial(_dataset, name, split),
           f"{split}_split": split, "num_fewshot": 0, "metadata": {"version": 1.0}}
    return ConfigurableTask(config=cfg)


def _metrics(result: dict) -> dict[str, float]:
    """lm-eval's 'acc,none' keys -> 'acc'; non-numeric entries (alias, N/A stderr) dropped."""
    out = {}
    for key, value in result.items():
        name = key.split(",", 1)[0]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


class RequestProgress:
    """Mixin for an lm-eval model class: one bar per task over its loglikelihood requests, ``"{label}{task}"``;
    the subclass calls ``_tick(n)`` as requests finish. Set ``progress``, ``label`` and ``task`` on the instance."""

    task, label = "", ""
    progress = staticmethod(no_progress)  # a StepProgress

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._done, self._total = 0, len(requests)
        self.progress(f"{self.label}{self.task}", 0, self._total, "req")
        out = super().loglikelihood(requests, disable_tqdm=True)
        self.progress(f"{self.label}{self.task}", self._total, self._total, "req")
        return out

    def _tick(self, n: int) -> None:
        self._done = min(self._done + n, self._total - 1)
        self.progress(f"{self.label}{self.task}", self._done, self._total, "req")


def _progress_lm(model, tokenizer, batch_size: int, progress: StepProgress, label: str):
    """lm-eval's HFLM with its own bars off and ours on: one bar per task over its requests."""
    from lm_eval.models.huggingface import HFLM

    class ProgressLM(RequestProgress, HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            logits = super()._model_call(inps, attn_mask=attn_mask, labels=labels)
            # one row per request, except requests sharing a context and a one-token continuation
            self._tick(inps.shape[0])
            return logits

    # HFLM re-ties the embeddings of the model it is given; ours come loaded and tied, and a quantized embedding
    # (QuantEmbedding, recipes with `embed: int8`) has no .weight for transformers' tie_weights to read
    model.tie_weights = lambda *args, **kwargs: None  # shadows the method on this instance only
    try:
        lm = ProgressLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    finally:
        del model.tie_weights
    lm.progress, lm.label = progress, label
    return lm


def run_tasks(model, tokenizer, tasks: list[str], limit: int | None = None, batch_size: int = 8,
              progress: StepProgress = no_progress, label: str = "") -> dict[str, dict[str, float]]:
    """Zero-shot lm-eval metrics per task (``limit`` = first N documents of each), e.g. {"piqa": {"acc": ...}};
    ``progress`` sees one stage per task, ``"{label}{task}"``, counting its requests."""
    check_limit(tasks, limit)
    return score_tasks(_progress_lm(model, tokenizer, batch_size, progress, label), tasks, limit)


def check_limit(tasks: list[str], limit: int | None) -> None:
    """ValueError for an unknown task or a limit below 1, before any model is loaded or server asked."""
    check_tasks(tasks)
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be at least 1 (or None for every document)")


def score_tasks(lm, tasks: list[str], limit: int | None,
                quiet: tuple[str, ...] = ("lm_eval.api.task",)) -> dict[str, dict[str, float]]:
    """Run each task through lm-eval with ``lm`` (any lm-eval model; ``lm.task`` is set to the running task)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    metrics = {}
    with quiet_third_party(quiet):
        for t in tasks:  # one task at a time, so the bar can say which
            lm.task = t
            # bootstrap_iters=0: no stderr estimates (lm-eval would bootstrap the lambada perplexity in a process pool)
            out = simple_evaluate(model=lm, tasks=[build_task(t)], limit=limit, bootstrap_iters=0,
                                  log_samples=False, task_manager=TaskManager(include_defaults=False))
            names = {m["metric"] for m in TASKS[t]["metric_list"]}
            metrics[t] = {k: v for k, v in _metrics(out["results"][t]).items() if k in names}
            metrics[t]["samples"] = float(out["n-samples"][t]["effective"])
    return metrics
