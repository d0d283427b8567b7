"""Progress of long work: stages and ticks reach a listener (the CLI's lines), with the time
left estimated from the pace so far; without a listener nothing happens."""

import time

from tfgraph import progress
from tfgraph.cli.output import StageLines


class _Record(progress.Listener):
    def __init__(self):
        self.events = []

    def started(self, name):
        self.events.append(("start", name))

    def finished(self, name, seconds):
        self.events.append(("end", name, seconds >= 0))

    def ticked(self, what, done, total, seconds):
        self.events.append(("tick", what, done, total))


def test_stages_and_ticks_reach_the_listener():
    record = _Record()
    with progress.listening(record):
        with progress.stage("save"):
            for i in range(3):
                progress.tick("tensors written", i + 1, 3)
    assert record.events == [
        ("start", "save"),
        ("tick", "tensors written", 1, 3),
        ("tick", "tensors written", 2, 3),
        ("tick", "tensors written", 3, 3),
        ("end", "save", True),
    ]
    progress.tick("ignored", 1, 2)  # no listener: nothing, no error
    assert len(record.events) == 5


def test_eta_from_the_pace():
    assert progress.eta(0, 10, 5.0) is None
    assert progress.eta(5, 10, 5.0) == 5.0
    assert progress.eta(10, 10, 5.0) == 0.0


def test_cli_lines_say_counts_and_time_left(capsys, monkeypatch):
    lines = StageLines(2)
    monkeypatch.setattr(StageLines, "EVERY_S", 0.0)
    with progress.listening(lines):
        with progress.stage("save"):
            progress.tick("tensors written", 1, 4)
            time.sleep(0.01)
            progress.tick("tensors written", 2, 4)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[1/2] save …")
    assert any("tensors written: 2/4" in line and "left" in line for line in err), err
    assert err[-1].startswith("[1/2] save: ") and err[-1].endswith(" s")
