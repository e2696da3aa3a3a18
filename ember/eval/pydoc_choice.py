"""A small multiple-choice task from offline text, for lm-eval-harness and for ember's own scorer.

Each item is a passage from Python's own documentation (`pydoc_data.topics`, in every Python install,
so nothing is downloaded) and four topic names; the answer is the topic the passage comes from. The
three wrong names are drawn with a fixed seed, so the task is the same everywhere.

`write_lm_eval_task(folder)` writes the items (JSONL) and an lm-eval task file (YAML) that reads them
through `datasets`' local json loader; `--include_path folder --tasks pydoc_topics` runs it.
`score_offline(llm, items)` scores the same items the way lm-eval scores a multiple-choice task
(the summed log-probability of " " + choice after the question, from prompt logprobs), through
ember's own engine: the two accuracies must agree.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass

TASK_NAME = "pydoc_topics"
PASSAGE_CHARS = 240
CHOICES = 4


@dataclass(frozen=True)
class Item:
    passage: str
    choices: tuple[str, ...]
    answer: int  # index into choices

    @property
    def question(self) -> str:
        """lm-eval's doc_to_text (the task file renders the same string with Jinja)."""
        return f"Passage from the Python documentation:\n{self.passage}\nTopic:"


def build_items(count: int = 40, seed: int = 0) -> list[Item]:
    """`count` items over the topics whose text is long enough, chosen and ordered by `seed`."""
    from pydoc_data.topics import topics

    names = sorted(name for name, text in topics.items() if len(" ".join(text.split())) >= PASSAGE_CHARS)
    rng = random.Random(seed)
    picked = rng.sample(names, min(count, len(names)))
    items = []
    for name in picked:
        text = " ".join(topics[name].split())
        # drop the heading (it often names the topic) and cut at a word boundary
        text = re.sub(r"^\S[^.:]{0,60}\*{3,}\s*", "", text)
        passage = text[:PASSAGE_CHARS].rsplit(" ", 1)[0]
        wrong = rng.sample([n for n in names if n != name], CHOICES - 1)
        choices = wrong + [name]
        rng.shuffle(choices)
        items.append(Item(passage, tuple(choices), choices.index(name)))
    return items


TASK_YAML = """\
# written by ember.eval.pydoc_choice: multiple choice over pydoc_data.topics passages (no download)
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Passage from the Python documentation:\\n{{{{passage}}}}\\nTopic:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_lm_eval_task(folder: str, items: list[Item]) -> str:
    """Write `<folder>/pydoc_topics.jsonl` and `<folder>/pydoc_topics.yaml`; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, f"{TASK_NAME}.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps({"passage": it.passage, "choices": list(it.choices), "answer": it.answer}) + "\n")
    with open(os.path.join(folder, f"{TASK_NAME}.yaml"), "w", encoding="utf-8") as f:
        f.write(TASK_YAML.format(task=TASK_NAME, data=json.dumps(data)))
    return folder


def choice_logprobs(llm, items: list[Item]) -> list[list[float]]:
    """Per item, per choice: log P(" " + choice | question), summed over the choice's tokens.

    Tokenized as lm-eval does for a remote tokenizer: context and context + continuation each without
    special tokens, the continuation = the whole's tokens after the context's."""
    from ember.sampling import SamplingParams

    tok = llm.tokenizer
    prompts, spans = [], []
    for it in items:
        ctx = tok.encode(it.question, add_special_tokens=False)
        for choice in it.choices:
            whole = tok.encode(it.question + " " + choice, add_special_tokens=False)
            prompts.append(whole)
            spans.append(len(ctx))
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    sums = []
    for ids, start, out in zip(prompts, spans, outs):
        sums.append(sum(out.prompt_logprobs[p][ids[p]].logprob for p in range(start, len(ids))))
    return [sums[i * CHOICES : (i + 1) * CHOICES] for i in range(len(items))]


def accuracy(items: list[Item], scores: list[list[float]]) -> dict[str, float]:
    """lm-eval's acc (argmax of the summed logprob) and acc_norm (divided by the choice's length in
    characters) of per-choice log-likelihoods."""
    acc = acc_norm = 0
    for it, lps in zip(items, scores):
        acc += max(range(CHOICES), key=lambda c: lps[c]) == it.answer
        norm = [lp / len(ch) for lp, ch in zip(lps, it.choices)]
        acc_norm += max(range(CHOICES), key=lambda c: norm[c]) == it.answer
    return {"acc": acc / len(items), "acc_norm": acc_norm / len(items)}


def score_offline(llm, items: list[Item]) -> dict[str, float]:
    """The items scored through the engine's prompt logprobs, as lm-eval scores them."""
    return accuracy(items, choice_logprobs(llm, items))


def main(argv: list[str] | None = None) -> None:
    """python -m ember.eval.pydoc_choice DIR [--items N] [--offline MODEL]: write the task into DIR (and print
    the lm-eval command for a server started with --enable-tokenizer-info-endpoint); with --offline, also
    print ember's own scores of the items on MODEL."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ember.eval.pydoc_choice", description=main.__doc__)
    p.add_argument("folder")
    p.add_argument("--items", type=int, default=40)
    p.add_argument("--offline", metavar="MODEL", default=None, help="score the items with ember on MODEL too")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    items = build_items(args.items)
    write_lm_eval_task(args.folder, items)
    print(
        f"lm_eval --model local-completions --include_path {args.folder} --tasks {TASK_NAME} --model_args "
        "base_url=http://127.0.0.1:8000/v1/completions,model=MODEL_NAME,tokenizer_backend=remote"
    )
    if args.offline:
        from ember import LLM

        print(json.dumps(score_offline(LLM(model=args.offline, dtype=args.dtype), items)))


if __name__ == "__main__":
    main()
