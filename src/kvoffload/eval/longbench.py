"""LongBench (v1 and LongBench-E) from the official jsonl files in a local directory.

The data cannot be downloaded here; users point ``--data-dir`` at the unpacked
official ``data/`` folder (``{dataset}.jsonl`` and, for LongBench-E,
``{dataset}_e.jsonl``). Each line holds ``input, context, answers, length,
dataset, language, all_classes, _id``. Prompts use the official
``dataset2prompt`` templates, generation the official ``dataset2maxlen``
budgets, truncation the official middle cut (first half + last half of the
prompt's tokens), chat templates are skipped for the few-shot / code datasets as
the official ``pred.py`` does, and scores come from :mod:`kvoffload.eval.metrics`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from kvoffload.errors import KVOffloadError

from . import metrics
from .ruler import ChatWrapper

__all__ = [
    "DATASET2PROMPT",
    "DATASET2MAXLEN",
    "LONGBENCH_DATASETS",
    "LONGBENCH_E_DATASETS",
    "NO_CHAT_DATASETS",
    "LongBenchFormatError",
    "LongBenchSample",
    "read_jsonl",
    "load_longbench",
    "build_prompt",
    "middle_truncate",
    "score_sample",
    "score_dataset",
    "score_by_length",
]

# Official THUDM/LongBench config/dataset2prompt.json (v1).
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# Official THUDM/LongBench config/dataset2maxlen.json (v1): max new tokens per dataset.
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}

LONGBENCH_DATASETS: tuple[str, ...] = tuple(DATASET2PROMPT)
LONGBENCH_E_DATASETS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)
# Official pred.py: "chat models are better off without build prompts on these tasks".
NO_CHAT_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

_FIELDS: dict[str, tuple[type, ...]] = {
    "input": (str,),
    "context": (str,),
    "answers": (list,),
    "length": (int,),
    "dataset": (str,),
    "language": (str,),
    "all_classes": (list, type(None)),
    "_id": (str,),
}


class LongBenchFormatError(KVOffloadError, ValueError):
    """A LongBench jsonl file does not follow the official format; the message names file and line."""


@dataclass
class LongBenchSample:
    dataset: str
    index: int
    input: str
    context: str
    answers: list[str]
    length: int
    language: str
    all_classes: list[str] | None
    id: str
    extra: dict = field(default_factory=dict, repr=False)

    def as_format_dict(self) -> dict:
        d = dict(self.extra)
        d.update(input=self.input, context=self.context, answers=self.answers, length=self.length,
                 dataset=self.dataset, language=self.language, all_classes=self.all_classes, _id=self.id)
        return d


def read_jsonl(path: str | os.PathLike, dataset: str | None = None, limit: int | None = None) -> list[LongBenchSample]:
    """Read and validate one official LongBench jsonl file.

    Raises :class:`LongBenchFormatError` naming ``path:line`` for invalid JSON, a
    missing field or a field of the wrong type. ``dataset`` defaults to the file name
    (``hotpotqa.jsonl`` / ``hotpotqa_e.jsonl`` -> ``hotpotqa``).
    """
    path = Path(path)
    if dataset is None:
        dataset = path.stem[:-2] if path.stem.endswith("_e") else path.stem
    out: list[LongBenchSample] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise LongBenchFormatError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise LongBenchFormatError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            missing = [k for k in _FIELDS if k not in obj]
            if missing:
                raise LongBenchFormatError(f"{path}:{lineno}: missing field(s) {', '.join(missing)} "
                                           f"(LongBench lines need {', '.join(_FIELDS)})")
            for k, types in _FIELDS.items():
                v = obj[k]
                if isinstance(v, bool) or not isinstance(v, types):
                    want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
                    raise LongBenchFormatError(f"{path}:{lineno}: field {k!r} should be {want}, "
                                               f"got {type(v).__name__}")
            if not obj["answers"] or not all(isinstance(a, str) for a in obj["answers"]):
                raise LongBenchFormatError(f"{path}:{lineno}: field 'answers' should be a non-empty list of strings")
            if obj["all_classes"] is not None and not all(isinstance(c, str) for c in obj["all_classes"]):
                raise LongBenchFormatError(f"{path}:{lineno}: field 'all_classes' should be a list of strings or null")
            extra = {k: v for k, v in obj.items() if k not in _FIELDS}
            out.append(LongBenchSample(dataset, len(out), obj["input"], obj["context"], list(obj["answers"]),
                                       int(obj["length"]), obj["language"], obj["all_classes"], obj["_id"], extra))
    return out


def load_longbench(data_dir: str | os.PathLike, datasets: Sequence[str] | None = None, *,
                   longbench_e: bool = False, limit: int | None = None) -> dict[str, list[LongBenchSample]]:
    """Load ``{dataset}.jsonl`` (``{dataset}_e.jsonl`` with ``longbench_e``) from ``data_dir``.

    ``datasets``: names to load (default: every known dataset present in the folder).
    ``limit``: first N samples per dataset.
    """
    d = Path(data_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"LongBench data directory {d} does not exist (it holds the official "
                                f"{{dataset}}.jsonl files, e.g. from LongBench's data.zip)")
    suffix = "_e" if longbench_e else ""
    if datasets is None:
        names = LONGBENCH_E_DATASETS if longbench_e else LONGBENCH_DATASETS
        datasets = [n for n in names if (d / f"{n}{suffix}.jsonl").exists()]
        if not datasets:
            raise FileNotFoundError(f"no LongBench{'-E' if longbench_e else ''} jsonl files in {d} "
                                    f"(expected names like hotpotqa{suffix}.jsonl)")
    out = {}
    for name in datasets:
        if name not in DATASET2PROMPT:
            raise KeyError(f"unknown LongBench dataset {name!r}; known: {', '.join(LONGBENCH_DATASETS)}")
        p = d / f"{name}{suffix}.jsonl"
        if not p.exists():
            raise FileNotFoundError(f"{p} not found")
        out[name] = read_jsonl(p, dataset=name, limit=limit)
        if not out[name]:  # an empty table would look like a run that found nothing to score
            raise LongBenchFormatError(f"{p} holds no samples (an empty file?); nothing to evaluate")
    return out


def middle_truncate(tok, prompt: str, max_tokens: int) -> str:
    """Official middle truncation: keep the first and last ``max_tokens // 2`` tokens of the prompt."""
    ids = tok.encode(prompt, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return prompt
    half = int(max_tokens / 2)
    return tok.decode(ids[:half], skip_special_tokens=True) + tok.decode(ids[-half:], skip_special_tokens=True)


def build_prompt(tok, sample: LongBenchSample, budget: int, chat: ChatWrapper | None = None,
                 max_positions: int | None = None) -> tuple[str, list[int], int]:
    """Prompt text, token ids and max new tokens for one sample, as the official ``pred.py`` builds them.

    ``budget``: the prompt token budget (LongBench's ``model2maxlen``), applied before the
    chat template. ``max_positions``: when given, the prompt is cut further (in the middle,
    by tokens) so that prompt + max new tokens fits the model.
    """
    ds = sample.dataset
    prompt = DATASET2PROMPT[ds].format(**sample.as_format_dict())
    prompt = middle_truncate(tok, prompt, budget)
    chat = chat or ChatWrapper()
    use_chat = chat.enabled and ds not in NO_CHAT_DATASETS
    if use_chat:
        prompt = chat.wrap(prompt)
    ids = list(tok.encode(prompt, add_special_tokens=not use_chat))
    max_new = DATASET2MAXLEN[ds]
    if max_positions is not None and len(ids) + max_new > max_positions:
        keep = max_positions - max_new
        if keep < 2:
            raise ValueError(f"{ds}: the model's {max_positions} positions cannot hold {max_new} new tokens")
        ids = ids[: keep // 2] + ids[len(ids) - (keep - keep // 2):]
    return prompt, ids, max_new


def score_sample(dataset: str, pred: str, answers: Sequence[str], all_classes=None) -> float:
    """Official per-sample score, in percent (0..100)."""
    return 100.0 * metrics.longbench_sample_score(dataset, pred, answers, all_classes)


def score_dataset(dataset: str, preds: Sequence[str], answers: Sequence[Sequence[str]],
                  all_classes=None) -> float:
    """Official ``scorer``: mean per-sample score x 100, rounded to 2 decimals."""
    if not preds:
        return float("nan")
    total = sum(metrics.longbench_sample_score(dataset, p, a, all_classes) for p, a in zip(preds, answers))
    return round(100 * total / len(preds), 2)


def score_by_length(dataset: str, preds: Sequence[str], answers: Sequence[Sequence[str]],
                    lengths: Sequence[int], all_classes=None) -> dict[str, float]:
    """Official LongBench-E ``scorer_e``: scores in the 0-4k / 4-8k / 8k+ buckets of ``length``."""
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for p, a, n in zip(preds, answers, lengths):
        s = metrics.longbench_sample_score(dataset, p, a, all_classes)
        buckets["0-4k" if n < 4000 else "4-8k" if n < 8000 else "8k+"].append(s)
    return {k: (round(100 * float(np.mean(v)), 2) if v else float("nan")) for k, v in buckets.items()}
