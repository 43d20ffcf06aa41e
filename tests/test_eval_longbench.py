"""LongBench loader, prompts, truncation and scoring on small jsonl files written here."""

import json

import pytest

from kvoffload.eval import longbench as lb
from kvoffload.eval.ruler import ChatWrapper
from kvoffload.models.tokenizer import byte_tokenizer


def _row(dataset, i, **kw):
    r = {"input": f"question {i}?", "context": f"context {i} " * 20, "answers": [f"answer {i}"],
         "length": 100 * (i + 1), "dataset": dataset, "language": "en", "all_classes": None, "_id": f"{dataset}-{i}"}
    r.update(kw)
    return r


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


@pytest.fixture
def data_dir(tmp_path):
    _write(tmp_path / "hotpotqa.jsonl", [_row("hotpotqa", i) for i in range(3)])
    _write(tmp_path / "trec.jsonl", [_row("trec", i, answers=["Human"], all_classes=["Human", "Location"])
                                     for i in range(2)])
    _write(tmp_path / "passage_count.jsonl", [_row("passage_count", 0, answers=["7"])])
    _write(tmp_path / "multifieldqa_zh.jsonl", [_row("multifieldqa_zh", 0, answers=["北京"], language="zh")])
    _write(tmp_path / "hotpotqa_e.jsonl", [_row("hotpotqa", i, length=n) for i, n in enumerate((3000, 5000, 9000))])
    (tmp_path / "README.txt").write_text("not data")
    return tmp_path


def test_load_finds_known_datasets(data_dir):
    data = lb.load_longbench(data_dir)
    assert list(data) == ["multifieldqa_zh", "hotpotqa", "trec", "passage_count"]  # official order
    s = data["hotpotqa"][1]
    assert (s.dataset, s.index, s.input, s.answers, s.length, s.id) == (
        "hotpotqa", 1, "question 1?", ["answer 1"], 200, "hotpotqa-1")
    assert data["trec"][0].all_classes == ["Human", "Location"]
    assert len(lb.load_longbench(data_dir, ["hotpotqa"], limit=2)["hotpotqa"]) == 2
    e = lb.load_longbench(data_dir, longbench_e=True)
    assert list(e) == ["hotpotqa"] and [x.length for x in e["hotpotqa"]] == [3000, 5000, 9000]


def test_load_errors(tmp_path, data_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lb.load_longbench(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no LongBench jsonl files"):
        lb.load_longbench(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else None)
    with pytest.raises(KeyError, match="unknown LongBench dataset"):
        lb.load_longbench(data_dir, ["hotpot"])
    with pytest.raises(FileNotFoundError, match="qasper.jsonl not found"):
        lb.load_longbench(data_dir, ["qasper"])


@pytest.mark.parametrize("bad, message", [
    ('{"input": "q", "context": ', r"bad\.jsonl:2: invalid JSON"),
    ('[1, 2]', r"bad\.jsonl:2: expected a JSON object"),
    (json.dumps({k: v for k, v in _row("hotpotqa", 0).items() if k != "answers"}),
     r"bad\.jsonl:2: missing field\(s\) answers"),
    (json.dumps(_row("hotpotqa", 0, length="12")), r"bad\.jsonl:2: field 'length' should be int, got str"),
    (json.dumps(_row("hotpotqa", 0, answers="Paris")), r"bad\.jsonl:2: field 'answers' should be list"),
    (json.dumps(_row("hotpotqa", 0, answers=[])), r"bad\.jsonl:2: field 'answers' should be a non-empty list"),
    (json.dumps(_row("hotpotqa", 0, all_classes="Human")), r"bad\.jsonl:2: field 'all_classes' should be list or null"),
])
def test_malformed_lines_are_named(tmp_path, bad, message):
    p = _write(tmp_path / "bad.jsonl", [_row("hotpotqa", 0), bad, _row("hotpotqa", 2)])
    with pytest.raises(lb.LongBenchFormatError, match=message):
        lb.read_jsonl(p, dataset="hotpotqa")


def test_blank_lines_are_skipped_but_counted(tmp_path):
    p = _write(tmp_path / "hotpotqa.jsonl", [_row("hotpotqa", 0), "", "{oops"])
    with pytest.raises(lb.LongBenchFormatError, match=r"hotpotqa\.jsonl:3:"):
        lb.read_jsonl(p)


def test_prompt_template_and_budget():
    tok = byte_tokenizer()
    s = lb.LongBenchSample("hotpotqa", 0, "Who?", "C" * 50, ["x"], 10, "en", None, "id")
    prompt, ids, max_new = lb.build_prompt(tok, s, budget=10_000)
    assert prompt == lb.DATASET2PROMPT["hotpotqa"].format(context="C" * 50, input="Who?")
    assert max_new == 32 and ids[0] == tok.bos_token_id and len(ids) == len(prompt.encode()) + 1
    # middle truncation: the first and last budget/2 tokens of the prompt survive
    s.context = "A" * 500 + "MIDDLE" + "B" * 500
    full = lb.DATASET2PROMPT["hotpotqa"].format(context=s.context, input="Who?")
    prompt, ids, _ = lb.build_prompt(tok, s, budget=400)
    assert prompt == full[:200] + full[-200:] and "MIDDLE" not in prompt and len(ids) == 401
    # a model too small for budget + answer gets a middle token cut too
    _, ids, _ = lb.build_prompt(tok, s, budget=400, max_positions=300)
    assert len(ids) == 300 - 32


def test_chat_template_skipped_where_official():
    tok = byte_tokenizer()
    chat = ChatWrapper("<u>", "</u><a>", True)
    qa = lb.LongBenchSample("hotpotqa", 0, "Who?", "ctx", ["x"], 10, "en", None, "id")
    trec = lb.LongBenchSample("trec", 0, "What is X?", "examples", ["Human"], 10, "en", ["Human"], "id")
    p, ids, _ = lb.build_prompt(tok, qa, 1000, chat)
    assert p.startswith("<u>Answer the question") and p.endswith("Answer:</u><a>")
    assert ids[0] != tok.bos_token_id  # a chat template carries its own BOS text
    p, ids, max_new = lb.build_prompt(tok, trec, 1000, chat)
    assert p == lb.DATASET2PROMPT["trec"].format(context="examples", input="What is X?") and max_new == 64


def test_dataset_scores():
    # hotpotqa: qa F1 per sample: 1, 0, and 0.8 for "city of paris" vs "paris city" (P 2/3, R 1)
    preds = ["Paris", "London", "city of Paris"]
    answers = [["Paris"], ["Paris"], ["Paris city"]]
    assert lb.score_dataset("hotpotqa", preds, answers) == round(100 * (1 + 0 + 0.8) / 3, 2)
    assert lb.score_sample("hotpotqa", "Paris", ["Paris"]) == 100.0
    assert lb.score_dataset("passage_count", ["7", "7 or 8"], [["7"], ["7"]]) == 75.0
    assert lb.score_dataset("trec", ["Human\nLocation", "Location"], [["Human"], ["Human"]],
                            ["Human", "Location"]) == 50.0
    assert lb.score_by_length("hotpotqa", ["x1", "y", "z1"], [["x1"], ["q"], ["z1"]], [3000, 5000, 9000]) == {
        "0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}


def test_official_tables_cover_every_dataset():
    assert set(lb.DATASET2PROMPT) == set(lb.DATASET2MAXLEN) == set(lb.LONGBENCH_DATASETS)
    assert set(lb.LONGBENCH_E_DATASETS) <= set(lb.LONGBENCH_DATASETS)
    for name, tpl in lb.DATASET2PROMPT.items():
        assert "{context}" in tpl, name
