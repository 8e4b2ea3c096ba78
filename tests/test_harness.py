"""The lm-evaluation-harness adapter (``--model infer``) against lm-eval's own ``hf`` model.

Three tiny tasks from local files (no hub): multiple choice (loglikelihood),
rolling log-likelihood, and generate_until, run through ``lm_eval.simple_evaluate``
on the tiny test model's Hugging Face folder, once with ``infer`` and once with
``hf`` (transformers, float32). Per request the log-likelihoods agree within
1e-3 (each is a sum over a few tokens of log-probabilities that agree within
``2 * LOGIT_RTOL * max|logit|``, about 1e-4 here: tests/test_scoring.py), and
the accuracies and greedy generations are the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from reference import tiny_model_dir

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small dog"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Once upon a", "choices": [" time", " table", " tree"], "answer": 0},
    {"question": "", "choices": ["Hello", "Goodbye"], "answer": 1},  # empty context: the prefix token
    {"question": "The sky is ", "choices": ["blue", "green"], "answer": 0},  # trailing space moves over
]
TEXTS = [{"text": "Once upon a time there was a tiny model."}, {"text": "It read texts and scored them."}]

TASKS = {
    "infer_tiny_mc": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""",
    "infer_tiny_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""",
    "infer_tiny_gen": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[0]}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    (folder / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (folder / "prompts.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS if q["question"]))
    (folder / "texts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    for name, body in TASKS.items():
        data = folder / {"infer_tiny_rolling": "texts.jsonl", "infer_tiny_gen": "prompts.jsonl"}.get(
            name, "questions.jsonl")
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
            + body)
    return folder


def _evaluate(model: str, model_args: str, tasks: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    import infer.tools.harness  # noqa: F401  (registers the model type "infer")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # include_defaults=False: indexing lm-eval's own thousands of tasks takes most of a minute.
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=sorted(TASKS), task_manager=manager,
                                   log_samples=True, batch_size=1, device="cpu")


@pytest.fixture(scope="module")
def results(tasks: Path) -> dict[str, dict[str, Any]]:
    path = tiny_model_dir("smollm2_like")
    with pytest.MonkeyPatch.context() as mp:
        return {
            "infer": _evaluate("infer", f"pretrained={path},backend=numpy", tasks, mp),
            "hf": _evaluate("hf", f"pretrained={path},dtype=float32", tasks, mp),
        }


def _responses(result: dict[str, Any], task: str) -> list[Any]:
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [s["resps"] for s in samples]


def _number(response: Any) -> float:
    """The one number of a response, however deep lm-eval nests it."""
    while isinstance(response, (list, tuple)):
        (response,) = response
    return float(response)


def test_loglikelihoods_equal_lm_evals_hf_model(results: dict[str, dict[str, Any]]) -> None:
    got, want = _responses(results["infer"], "infer_tiny_mc"), _responses(results["hf"], "infer_tiny_mc")
    assert len(got) == len(QUESTIONS)
    for doc_got, doc_want in zip(got, want):
        assert len(doc_got) == len(doc_want)
        for [(ll, greedy)], [(ll_hf, greedy_hf)] in zip(doc_got, doc_want):
            assert abs(float(ll) - float(ll_hf)) <= 1e-3, (ll, ll_hf)
            assert bool(greedy) == bool(greedy_hf)
    acc = results["infer"]["results"]["infer_tiny_mc"]["acc,none"]
    assert acc == results["hf"]["results"]["infer_tiny_mc"]["acc,none"]


def test_rolling_loglikelihoods_equal_lm_evals_hf_model(results: dict[str, dict[str, Any]]) -> None:
    got, want = _responses(results["infer"], "infer_tiny_rolling"), _responses(results["hf"], "infer_tiny_rolling")
    assert len(got) == len(TEXTS)
    for ll, ll_hf in zip(got, want):
        ll, ll_hf = _number(ll), _number(ll_hf)
        assert abs(ll - ll_hf) <= 1e-3, (ll, ll_hf)


def test_greedy_generations_equal_lm_evals_hf_model(results: dict[str, dict[str, Any]]) -> None:
    got, want = _responses(results["infer"], "infer_tiny_gen"), _responses(results["hf"], "infer_tiny_gen")
    assert got == want and any(r[0] for r in got)
