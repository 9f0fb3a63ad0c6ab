"""Each prompt's sampling seed (mrl.rollout.engine.seeded_per_prompt): its own, from its key."""

from mrl.rollout.engine import SamplingSettings, seeded_per_prompt


def test_each_prompt_its_own_seed_from_its_key_not_its_place():
    base = SamplingSettings(temperature=1.0, n=8, seed=1234)
    settings = seeded_per_prompt(base, [5, 9, 2])
    seeds = [s.seed for s in settings]
    assert len(set(seeds)) == 3 and all(0 <= s < 2**56 for s in seeds)
    assert [s.seed for s in seeded_per_prompt(base, [2, 5])] == [seeds[2], seeds[0]]  # the key decides
    assert all(s.n == 8 and s.temperature == 1.0 for s in settings)  # everything else as given
    # sample i of prompt p draws from seed + i: no two prompts' ranges overlap
    ranges = sorted((s, s + base.n) for s in seeds)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def test_another_step_seed_gives_other_seeds_and_unseeded_stays_unseeded():
    a = seeded_per_prompt(SamplingSettings(seed=1), range(50))
    b = seeded_per_prompt(SamplingSettings(seed=2), range(50))
    assert not {s.seed for s in a} & {s.seed for s in b}
    assert [s.seed for s in seeded_per_prompt(SamplingSettings(seed=None), [0, 1])] == [None, None]
