"""Run with `python3 test_stats.py` (or pytest, where it is installed)."""

from stats import mean, median, value_range


def test_mean() -> None:
    assert mean([1, 2, 3, 4]) == 2.5


def test_median_odd() -> None:
    assert median([5, 1, 3]) == 3


def test_median_even() -> None:
    assert median([4, 1, 3, 2]) == 2.5


def test_value_range() -> None:
    assert value_range([3, -2, 7]) == 9


if __name__ == "__main__":
    for name, test in list(globals().items()):
        if name.startswith("test_"):
            test()
    print("all tests passed")
