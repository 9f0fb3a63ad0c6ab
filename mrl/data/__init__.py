"""Training data: prompt files and templates, the synthetic arithmetic task, a resumable sampler."""

from mrl.data.arithmetic import ArithmeticTask
from mrl.data.prompts import DataError, PromptTemplate, load_records, prompt_samples
from mrl.data.sampler import EpochSampler

__all__ = ["ArithmeticTask", "DataError", "EpochSampler", "PromptTemplate", "load_records", "prompt_samples"]
