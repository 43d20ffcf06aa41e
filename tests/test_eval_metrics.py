"""LongBench's official metrics on crafted predictions, against hand-computed scores."""

import pytest

from kvoffload.eval import metrics as m


def test_normalize_answer():
    assert m.normalize_answer("The  Cat, sat on A mat!") == "cat sat on mat"
    assert m.normalize_zh_answer("北京，是 中国的首都。") == "北京是中国的首都"


def test_qa_f1():
    # pred tokens cat sat on mat (articles/punctuation dropped), gold cat on mat: P=3/4, R=1
    assert m.qa_f1_score("The cat sat on the mat.", "cat on mat") == pytest.approx(2 * 0.75 / 1.75)
    assert m.qa_f1_score("Paris", "paris") == 1.0
    assert m.qa_f1_score("London", "Paris") == 0.0
    assert m.qa_f1_score("", "Paris") == 0.0


def test_qa_f1_zh():
    # jieba: 北京/是/中国/的/首都 vs 北京: P=1/5, R=1
    assert m.qa_f1_zh_score("北京是中国的首都", "北京") == pytest.approx(2 * 0.2 / 1.2)
    assert m.qa_f1_zh_score("北京。", "北京") == 1.0


def test_rouge_l():
    # LCS "the cat down" = 3 of 4 words each side: P = R = F = 0.75
    assert m.rouge_score("the cat sat down", "the cat lay down") == pytest.approx(0.75, abs=1e-6)
    # LCS 2, P = 2/6, R = 1: F = 0.5
    assert m.rouge_score("a b c d e f", "a b") == pytest.approx(0.5, abs=1e-6)
    assert m.rouge_score("same words here", "same words here") == pytest.approx(1.0, abs=1e-6)
    assert m.rouge_score("", "anything") == 0.0  # the official scorer maps failures to 0
    # Chinese: jieba words 北京/是/中国/的/首都 vs 中国/的/首都/是/北京: LCS 中国 的 首都 = 3/5
    assert m.rouge_zh_score("北京是中国的首都", "中国的首都是北京") == pytest.approx(0.6, abs=1e-6)


def test_classification():
    classes = ["Location", "Human", "Entity", "Numeric value", "value"]
    assert m.classification_score("Human being", "Human", all_classes=classes) == 1.0
    assert m.classification_score("Location or Human", "Human", all_classes=classes) == 0.5
    assert m.classification_score("nothing matches", "Human", all_classes=classes) == 0.0
    # 'value' is inside the gold 'Numeric value' and is dropped from the matches
    assert m.classification_score("Numeric value", "Numeric value", all_classes=classes) == 1.0


def test_retrieval_and_count():
    assert m.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert m.retrieval_score("Paragraph 3 or Paragraph 5", "Paragraph 3") == 0.5
    assert m.retrieval_score("no number", "Paragraph 3") == 0.0
    assert m.retrieval_zh_score("答案是段落2", "段落2") == 1.0
    assert m.retrieval_zh_score("段落12", "段落2") == 0.0
    assert m.count_score("There are 12 unique paragraphs out of 20", "12") == 0.5
    assert m.count_score("12", 12) == 1.0


def test_code_sim():
    # first line without ` # // is "x = foo(1)"; vs "x = foo(2)": 9 of 10 chars each -> ratio 90
    assert m.code_sim_score("```python\n# comment\nx = foo(1)\n", "x = foo(2)") == 0.9
    assert m.code_sim_score("\n\nreturn a + b", "return a + b") == 1.0
    assert m.code_sim_score("// only comments", "return a") == 0.0


def test_sample_score_rules():
    # best over the gold answers
    assert m.longbench_sample_score("hotpotqa", "Paris", ["London", "Paris"]) == 1.0
    # trec / triviaqa / samsum / lsht: only the first line counts
    assert m.longbench_sample_score("triviaqa", "\nParis\nLondon", ["London"]) == 0.0
    assert m.longbench_sample_score("triviaqa", "\nParis\nLondon", ["Paris"]) == 1.0
    assert m.longbench_sample_score("trec", "Human\nLocation", ["Human"], ["Human", "Location"]) == 1.0
    with pytest.raises(KeyError, match="no LongBench metric"):
        m.longbench_sample_score("nosuchset", "a", ["a"])
    assert set(m.LONGBENCH_METRICS) == {
        "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
        "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
        "passage_retrieval_en", "passage_count", "passage_retrieval_zh", "lcc", "repobench-p"}
