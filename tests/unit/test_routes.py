"""mrl.routes: the route contract's dtype, its checks (the first problem named) and the agreement metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrl.routes import ROUTES_KEY, agreement, agreement_counts, agreement_from_counts, check_routes, route_dtype


def _routes(tokens=4, layers=3, top_k=2, n_experts=8):
    rng = np.random.default_rng(0)
    rows = [rng.permutation(n_experts)[:top_k] for _ in range(tokens * layers)]
    return np.stack(rows).reshape(tokens, layers, top_k).astype(route_dtype(n_experts))


def test_the_key_and_the_smallest_dtype_that_holds_the_ids():
    assert ROUTES_KEY == "routed_experts"
    assert route_dtype(8) == np.uint8 and route_dtype(256) == np.uint8
    assert route_dtype(257) == np.int16 and route_dtype(32768) == np.int16
    with pytest.raises(ValueError, match="int16"):
        route_dtype(40000)


def test_good_routes_pass_and_torch_is_accepted():
    routes = _routes()
    kw = dict(tokens=4, layers=3, top_k=2, n_experts=8, sample=5)
    assert np.array_equal(check_routes(routes, **kw), routes)
    assert np.array_equal(check_routes(torch.from_numpy(routes.astype(np.int64)), **kw), routes)


@pytest.mark.parametrize("shape, expected", [((3, 3, 2), r"shape \(3, 3, 2\), expected \(4, 3, 2\)"),
                                             ((4, 2, 2), r"shape \(4, 2, 2\)"),
                                             ((4, 3), r"shape \(4, 3\)")])
def test_a_wrong_shape_is_named(shape, expected):
    with pytest.raises(ValueError, match=f"sample 7: routes have {expected}"):
        check_routes(np.zeros(shape, np.uint8), tokens=4, layers=3, top_k=2, n_experts=8, sample=7)


def test_missing_and_float_routes_are_refused():
    kw = dict(tokens=4, layers=3, top_k=2, n_experts=8, sample="a")
    with pytest.raises(ValueError, match="sample a: no routes .'routed_experts' missing"):
        check_routes(None, **kw)
    with pytest.raises(ValueError, match="dtype float32"):
        check_routes(_routes().astype(np.float32), **kw)


def test_the_first_out_of_range_id_is_named_by_sample_layer_and_token():
    routes = _routes().astype(np.int16)
    routes[2, 1, 1] = 8
    routes[3, 0, 0] = -1  # a later problem: the first (token-major) is named
    with pytest.raises(ValueError, match=r"sample 3, MoE layer 1, token 2: expert ids \[\d, 8\] outside \[0, 8\)"):
        check_routes(routes, tokens=4, layers=3, top_k=2, n_experts=8, sample=3)


def test_a_repeated_id_and_an_all_zero_row_are_refused():
    routes = _routes()
    routes[1, 2] = [5, 5]
    with pytest.raises(ValueError, match=r"sample 0, MoE layer 2, token 1: expert ids \[5, 5\] repeat"):
        check_routes(routes, tokens=4, layers=3, top_k=2, n_experts=8, sample=0)
    with pytest.raises(ValueError, match="MoE layer 0, token 0: .*all-zero row"):
        check_routes(np.zeros((4, 3, 2), np.uint8), tokens=4, layers=3, top_k=2, n_experts=8, sample=0)


def test_agreement_compares_sets_and_counts_only_masked_tokens():
    given = torch.tensor([[[0, 1], [2, 3]],    # token 0: both layers agree (order ignored)
                          [[4, 5], [6, 7]],    # token 1: layer 1 differs
                          [[0, 1], [0, 1]]])   # token 2: masked out, differs everywhere
    trainer = torch.tensor([[[1, 0], [3, 2]],
                            [[5, 4], [6, 0]],
                            [[2, 3], [2, 3]]])
    mask = torch.tensor([True, True, False])
    metrics = agreement(trainer, given, mask)
    assert metrics == {"rollout/routing_agreement": 0.75, "rollout/routing_agreement_min_layer": 0.5,
                       "rollout/routing_tokens_any_diff": 0.5}


def test_counts_add_across_batches_and_an_empty_mask_gives_no_metric():
    given = torch.tensor([[[0, 1]], [[2, 3]]])
    first = agreement_counts(given, given, torch.tensor([True, False]))
    second = agreement_counts(given.flip(0), given, torch.tensor([True, True]))
    assert agreement_from_counts(first + second) == {"rollout/routing_agreement": 1 / 3,
                                                     "rollout/routing_agreement_min_layer": 1 / 3,
                                                     "rollout/routing_tokens_any_diff": 2 / 3}
    assert agreement(given, given, torch.tensor([False, False])) == {}
    with pytest.raises(ValueError, match="one shape"):
        agreement_counts(given, given[:, :, :1], torch.tensor([True, True]))
