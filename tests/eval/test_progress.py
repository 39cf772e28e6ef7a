import pytest

from eval.perplexity import perplexity
from eval.progress import Bars, quiet_third_party
from eval.tasks import run_tasks


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, what, done, total, unit="it"):
        self.calls.append((what, done, total, unit))


def test_perplexity_reports_every_batch(make_lm, char_tokenizer, text_file):
    seen = []
    perplexity(make_lm("llama"), char_tokenizer, [text_file.read_text()], seqlen=64, max_windows=5, batch_size=2,
               progress=lambda d, n: seen.append((d, n)))
    assert seen == [(0, 5), (2, 5), (4, 5), (5, 5)]


def test_tasks_report_one_stage_per_task_from_zero_to_all_requests(make_lm, smol_tokenizer):
    rec = Recorder()
    run_tasks(make_lm("llama", vocab=len(smol_tokenizer)), smol_tokenizer, ["piqa", "boolq"], limit=3, batch_size=2,
              progress=rec, label="tiny: ")
    for task, requests in (("piqa", 6), ("boolq", 6)):  # 2 choices per document
        calls = [c for c in rec.calls if c[0] == f"tiny: {task}"]
        assert calls[0] == (f"tiny: {task}", 0, requests, "req") and calls[-1][1:3] == (requests, requests)
        assert [c[1] for c in calls] == sorted(c[1] for c in calls)  # never backwards


def test_quiet_third_party_silences_and_restores():
    import datasets
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    with quiet_third_party():
        assert not datasets.is_progress_bar_enabled()
        assert gguf_utils.tqdm([1, 2]).disable
    assert gguf_utils.tqdm is original and datasets.is_progress_bar_enabled()


def test_bars_draw_on_stderr_and_quiet_draws_nothing(capsys):
    bars = Bars()
    for done in range(4):
        bars("model: ppl wiki", done, 3, "window")
    bars.note("next")
    err = capsys.readouterr().err
    assert "model: ppl wiki" in err and "3/3" in err and "next" in err
    quiet = Bars(quiet=True)
    quiet("x", 0, 2)
    quiet("x", 2, 2)
    quiet.note("hidden")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("quiet", [False, True])
def test_cli_eval_quiet_flag(quiet, tmp_path, make_lm, smol_tokenizer, text_file):
    from click.testing import CliRunner

    import cli

    path = tmp_path / "m"
    make_lm("llama", vocab=len(smol_tokenizer)).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    res = CliRunner().invoke(cli.main, ["eval", str(path), "--ppl", str(text_file), "--seqlen", "32",
                                        "--max-windows", "2"] + (["--quiet"] if quiet else []))
    assert res.exit_code == 0, res.output
    assert ("m: ppl story.txt" in res.stderr) is not quiet
