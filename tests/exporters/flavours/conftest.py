"""Shared fixtures of the flavour tests."""

import pytest


@pytest.fixture
def no_trace(monkeypatch):
    """The export's trace fails the test: a flavour's refusal must come before it (a trace
    takes the time of a whole export)."""
    import tfgraph.exporting as exporting

    def traced(*args, **kwargs):
        raise AssertionError("traced a model the flavour refuses")

    monkeypatch.setattr(exporting, "trace_source", traced)
