"""Data: samples from files or the built-in synthetic task, and their rendering into model prompts.

    from llamarl.data import Sample, load_dataset, ArithmeticTask, PromptDataset, PromptFormat
    samples = load_dataset("gsm8k_test.jsonl", prompt_field="question", answer_field="answer")
    task = ArithmeticTask(digits=3, n_terms=2, ops=("+",), seed=0)
    train, heldout = task.train_samples(1000), task.heldout_samples(200)   # never share a problem
    prompts = PromptDataset(train, tokenizer, PromptFormat(template="{prompt}"))

Modules: datasets (Sample, JSONL/Parquet I/O), prompts (templates, few-shot, chat templates,
PromptDataset), synthetic (ArithmeticTask).
"""

from llamarl.data.datasets import Sample, load_dataset, reduce_answer, write_jsonl
from llamarl.data.prompts import (Prompt, PromptDataset, PromptFormat, PromptFormatter, distinct_problems, select_shots,
                                  shot_key)
from llamarl.data.synthetic import SYNTHETIC_PREFIX, ArithmeticTask, parse_synthetic_spec

__all__ = [
    "SYNTHETIC_PREFIX",
    "ArithmeticTask",
    "Prompt",
    "PromptDataset",
    "PromptFormat",
    "PromptFormatter",
    "Sample",
    "distinct_problems",
    "load_dataset",
    "parse_synthetic_spec",
    "reduce_answer",
    "select_shots",
    "shot_key",
    "write_jsonl",
]
