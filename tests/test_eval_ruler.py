"""RULER through NVIDIA's generators: determinism, lengths, chat wrapping, scoring."""

import re

import pytest

from kvoffload.eval import ruler
from kvoffload.eval.metrics import ruler_postprocess


class WordTokenizer:
    """A deterministic word/punctuation tokenizer (about 4 characters a token, like real BPEs)."""

    _re = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")

    def __init__(self, chat=True):
        self.vocab = {}
        self.chat = chat

    def encode(self, text, add_special_tokens=True):
        ids = [1] if add_special_tokens else []
        for piece in self._re.findall(text):
            ids.append(self.vocab.setdefault(piece, len(self.vocab) + 10))
        return ids

    def decode(self, ids, skip_special_tokens=True):
        inv = {v: k for k, v in self.vocab.items()}
        return "".join(inv.get(i, "") for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        if not self.chat:
            return None
        # "are" and "Some" on purpose: RULER's niah str.replace must not reach the model's template
        return "<s>[SYS] Some of you are helpful [/SYS]\n[USER] " + messages[0]["content"] + " [/USER]\n[BOT]"


@pytest.fixture(scope="module")
def tok():
    return WordTokenizer()


def test_task_table_matches_ruler():
    assert len(ruler.RULER_TASKS) == 13
    for t in ruler.RULER_TASKS:
        cfg = ruler.task_config(t)
        assert cfg["metric"] == ("string_match_part" if t.startswith("qa") else "string_match_all")
        assert cfg["tokens_to_generate"] > 0 and "{context}" in cfg["template"]
    with pytest.raises(KeyError, match="unknown RULER task"):
        ruler.task_config("niah_single_9")


def test_split_sentences():
    text = ("Mr. Smith went to Washington. He arrived at 5 p.m. on Monday! Did he like it? "
            "\"Yes,\" he said. Then J. R. R. Tolkien wrote e.g. this. 2024 was a year.")
    assert ruler.split_sentences(text) == [
        "Mr. Smith went to Washington.",
        "He arrived at 5 p.m. on Monday!",
        "Did he like it?",
        "\"Yes,\" he said.",
        "Then J. R. R. Tolkien wrote e.g. this.",
        "2024 was a year.",
    ]
    assert ruler.split_sentences("") == []
    assert ruler.split_sentences("no end") == ["no end"]


@pytest.mark.parametrize("task", ruler.RULER_TASKS)
def test_generators_deterministic_and_fit(tok, task):
    L = 2048
    a = ruler.generate_samples(tok, task, L, 2, seed=42)
    b = ruler.generate_samples(tok, task, L, 2, seed=42)
    assert [(s.input, s.outputs) for s in a] == [(s.input, s.outputs) for s in b]
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    c = ruler.generate_samples(tok, task, L, 2, seed=7)
    assert [s.input for s in c] != [s.input for s in a]
    cfg = ruler.task_config(task)
    for s in a:
        assert s.task == task and s.length == L and s.outputs
        assert len(s.prompt_ids) + s.max_new_tokens <= L
        assert len(s.prompt_ids) > L // 3  # the haystack was grown towards the length
        assert s.max_new_tokens == cfg["tokens_to_generate"]
        # the model's chat template wraps the task, answer prefix after the generation prompt
        assert s.input.startswith("<s>[SYS] Some of you are helpful [/SYS]\n[USER] ")
        # cwe carries a worked example built from the same (wrapped) template, as RULER does
        assert s.input.count(" [/USER]\n[BOT]") == (2 if task == "cwe" else 1)
        assert s.input.split("[BOT]")[-1].startswith(cfg["answer_prefix"][:9])
        if task.startswith(("niah", "vt", "cwe")):
            body = s.input.split("[USER]", 1)[1]
            for ans in s.outputs:
                assert ans in body, (task, ans)


def test_generator_does_not_disturb_global_random(tok):
    import random

    import numpy as np

    random.seed(123)
    np.random.seed(123)
    ruler.generate_samples(tok, "vt", 1024, 1)
    assert random.random() == random.Random(123).random()
    assert np.random.rand() == np.random.RandomState(123).rand()


def test_no_chat_template():
    tok = WordTokenizer(chat=False)
    s = ruler.generate_samples(tok, "qa_1", 2048, 1)[0]
    assert s.input.startswith("Answer the question based on the given documents.")
    assert s.input.endswith("Answer:") and s.prompt_ids[0] == 1  # BOS added when no template


def test_too_short_lengths_are_refused(tok):
    with pytest.raises(ValueError, match="too short"):
        ruler.generate_samples(tok, "niah_single_1", 100, 2)
    with pytest.raises(ValueError, match="too short"):
        ruler.generate_samples(tok, "qa_2", 400, 2)  # needs at least the gold documents


def test_scoring_matches_ruler():
    # niah: string_match_all, case-insensitive, share of references found
    assert ruler.score_sample("niah_multivalue", " 1234567, 2345678 and 3456789.", ["1234567", "2345678",
                                                                                   "3456789", "4567890"]) == 75.0
    assert ruler.score_sample("niah_single_1", "The number is 8090293", ["8090293"]) == 100.0
    assert ruler.score_sample("niah_single_1", "The number is 809029", ["8090293"]) == 0.0
    assert ruler.score_sample("cwe", "Apple banana", ["apple", "BANANA", "cherry", "date"]) == 50.0
    # qa: string_match_part, any reference counts fully
    assert ruler.score_sample("qa_1", "It is in FRANCE.", ["France", "the French Republic"]) == 100.0
    assert ruler.score_sample("qa_2", "no idea", ["yes"]) == 0.0
    assert ruler.score_sample("string_match_part", "b", ["a", "b"]) == 100.0
    # RULER's postprocess: strip, control characters become newlines
    assert ruler_postprocess("  a\x00b\tc \n") == "a\nb\nc"
    assert ruler_postprocess(None) == ""


def test_niah_key_list_is_rulers():
    adjs = ["blue", "blue-eyed", "old", "zany", "old-fashioned", "big", "blue"]
    nouns = ["eye", "a", "zoo", "eyed-x", "fish"]
    assert ruler.niah_words(adjs, nouns) == sorted(set(f"{a}-{n}" for a in adjs for n in nouns))
    assert ruler.niah_words([], nouns) == []


@pytest.mark.slow
def test_niah_key_list_is_rulers_full():
    import wonderwords.random_word as ww

    nouns = ww._get_words_from_text_file("nounlist.txt")
    adjs = ww._get_words_from_text_file("adjectivelist.txt")
    assert ruler.niah_words(adjs, nouns) == sorted(set(f"{a}-{n}" for a in adjs for n in nouns))


def test_a_sample_rulers_retry_loop_cannot_fit_is_built_with_a_finer_step(tok, monkeypatch):
    # With this tokenizer qa_1's smallest RULER sample (10 documents) exceeds 1024 tokens: RULER's loop would spin
    # for ever; the next attempt steps 5 documents at a time, and its samples fit and hold their gold documents.
    steps = []
    run = ruler._generate_rows

    def spy(*a, **k):
        rows, infeasible, need = run(*a, **k)
        steps.append((a[-1], infeasible))
        return rows, infeasible, need

    monkeypatch.setattr(ruler, "_generate_rows", spy)
    samples = ruler.generate_samples(tok, "qa_1", 1024, 2, seed=3)
    assert steps == [(10, True), (5, False)]
    for s in samples:
        assert len(s.prompt_ids) + s.max_new_tokens <= 1024 and s.outputs
    steps.clear()
    ruler.generate_samples(tok, "qa_1", 2048, 2, seed=3)  # where RULER's own attempt fits, it alone runs
    assert steps == [(10, False)]
    with pytest.raises(ValueError, match="too short"):  # no step fits: the error, not a generator's exception
        ruler.generate_samples(tok, "qa_2", 1024, 2, seed=3)
