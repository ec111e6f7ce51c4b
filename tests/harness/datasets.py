"""Stands in for Hugging Face ``datasets``, which ``sglang.test.test_utils`` imports (for
benchmarks) and the pinned environment lacks: upstream's tests import ``CustomTestCase``
and ``find_available_port`` from that module. Any use of it fails."""


def load_dataset(*args, **kwargs):
    raise NotImplementedError("datasets is not installed; this is the tests' stand-in")
