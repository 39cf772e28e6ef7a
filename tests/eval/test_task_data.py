import pytest

from eval.task_data import SOURCES, load_docs
from eval.tasks import TASKS, build_task, check_tasks

# documents in each evaluation split, and the number of answer choices per document
EXPECTED = {
    "hellaswag": (10042, {4}), "piqa": (1838, {2}), "winogrande": (1267, {2}), "boolq": (3270, {2}),
    "arc_easy": (2376, {3, 4, 5}), "arc_challenge": (1172, {3, 4, 5}), "lambada": (5153, None),
}


def test_every_task_has_data_and_a_config():
    assert set(EXPECTED) == set(SOURCES) == set(TASKS)


@pytest.mark.parametrize("task", sorted(EXPECTED))
def test_docs_and_choices_match_the_published_splits(task):
    n_docs, n_choices = EXPECTED[task]
    assert len(load_docs(task)) == n_docs
    lm_task = build_task(task)
    docs = list(lm_task.eval_docs)
    assert len(docs) == n_docs
    for doc in docs[:: max(1, n_docs // 200)]:  # a spread-out sample keeps the test fast
        target = lm_task.doc_to_target(doc)
        if n_choices is None:  # lambada: a passage cut before its last word
            assert lm_task.doc_to_text(doc).strip() and target.startswith(" ") and len(target.split()) == 1
            continue
        choices = lm_task.doc_to_choice(doc)
        assert len(choices) in n_choices and all(isinstance(c, str) and c for c in choices)
        text = lm_task.doc_to_text(doc)
        if task == "winogrande":  # partial scoring: text is the gold context's index, target the shared ending
            assert text in (0, 1) and isinstance(target, str)
        else:
            assert isinstance(text, str) and 0 <= target < len(choices)


def test_arc_docs_are_unique_test_questions():
    ids = load_docs("arc_challenge")["id"]
    assert len(set(ids)) == len(ids)


def test_unknown_task_lists_known_ones():
    with pytest.raises(ValueError, match="hellaswag, piqa"):
        check_tasks(["piqa", "mmlu"])
    with pytest.raises(ValueError, match="unknown task 'mmlu'"):
        load_docs("mmlu")
