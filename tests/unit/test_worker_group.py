from mrl.rank_map import local_ranks


def test_local_rank_counts_ranks_on_the_same_node():
    assert local_ranks(["a", "a", "b", "a", "b"]) == [0, 1, 0, 2, 1]
    assert local_ranks(["n0"] * 4) == [0, 1, 2, 3]
