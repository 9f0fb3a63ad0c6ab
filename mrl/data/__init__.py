"""Training data: prompt files and templates, the synthetic arithmetic task, a resumable sampler."""

from mrl.data.arithmetic import ArithmeticTask
from mrl.data.prompts import DataError, PromptTemplate, load_records, prompt_samples
from mrl.data.sampler import EpochSampler
from mrl.data.splits import load_splits

__all__ = ["ArithmeticTask", "DataError", "EpochSampler", "PromptTemplate", "load_records", "load_splits", "prompt_samples"]
