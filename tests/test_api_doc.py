"""`docs/api.md`, the notebook API, runs as written: each example is a doctest."""

from __future__ import annotations

import doctest
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_the_api_documents_examples_that_run_as_written():
    result = doctest.testfile(str(DOC), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted >= 20, result  # the examples were found
    assert result.failed == 0, result
