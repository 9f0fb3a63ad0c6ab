"""The engine fleet's load spreading (mrl.launch.fleet.assign_by_load): every prompt on exactly one
engine (its n samples with it), the engines' work balanced, each engine's prompts in batch order."""

import itertools
import random

import pytest

from mrl.launch.fleet import assign_by_load, prompt_costs
from mrl.rollout.engine import SamplingSettings


def _loads(costs, parts):
    return [sum(costs[i] for i in part) for part in parts]


def _best_makespan(costs, engines):
    """The smallest possible load of the busiest engine, by trying every assignment (tiny inputs)."""
    return min(max(sum(c for c, e in zip(costs, choice) if e == k) for k in range(engines))
               for choice in itertools.product(range(engines), repeat=len(costs)))


def test_one_engine_gets_the_batch_as_it_is():
    assert assign_by_load([5, 1, 9, 3], 1) == [[0, 1, 2, 3]]


def test_every_prompt_lands_on_exactly_one_engine_in_batch_order():
    costs = [random.Random(seed).randint(1, 100) for seed in range(37)]
    parts = assign_by_load(costs, 4)
    assert sorted(i for part in parts for i in part) == list(range(37))
    assert all(part == sorted(part) for part in parts)


def test_longest_first_on_the_least_loaded_engine():
    # 9 → e0; 7 → e1; 5 → e1 (7 < 9)... loads end 9+3+1 = 13 and 7+5 = 12.
    assert assign_by_load([1, 9, 5, 7, 3], 2) == [[0, 1, 4], [2, 3]]
    # Equal costs: round robin in batch order, so equal prompts split evenly.
    assert assign_by_load([4] * 6, 3) == [[0, 3], [1, 4], [2, 5]]


@pytest.mark.parametrize("seed", range(20))
def test_the_busiest_engine_stays_within_4_3_of_the_best_split(seed):
    rng = random.Random(seed)
    costs, engines = [rng.randint(1, 50) for _ in range(rng.randint(3, 8))], rng.randint(2, 3)
    assert max(_loads(costs, assign_by_load(costs, engines))) <= 4 / 3 * _best_makespan(costs, engines)


def test_more_engines_than_prompts_leaves_some_idle():
    assert assign_by_load([2, 8], 4) == [[1], [0], [], []]


def test_no_engine_is_refused():
    with pytest.raises(ValueError, match="at least one engine"):
        assign_by_load([1.0], 0)


def test_cost_is_prompt_and_response_tokens_times_samples():
    sampling = SamplingSettings(max_tokens=10, n=4)
    assert prompt_costs([[1, 2, 3], [7]], sampling) == [52.0, 44.0]


def test_continued_samples_cost_their_own_budget():
    """Partial rollout sends one prompt per unfinished sample, each with the tokens it has left."""
    settings = [SamplingSettings(max_tokens=10), SamplingSettings(max_tokens=3)]
    assert prompt_costs([[1, 2, 3], [7, 8, 9, 10]], settings) == [13.0, 7.0]
    with pytest.raises(ValueError, match="2 sampling settings for 1 prompts"):
        prompt_costs([[1]], settings)
