"""Cached machine measurements: final when quiet, measured again (up to MAX_ATTEMPTS) when busy."""

import json
import time

import pytest
import torch

from specdecode import measured


@pytest.fixture
def share(monkeypatch):
    """Fake the share of the cores a measurement gets (`value[0]`), whatever else the test
    machine runs."""
    value = [1.0]
    monkeypatch.setattr(measured, "run_with_share", lambda fn: (fn(), value[0]))
    return value


def test_the_share_is_read_from_the_process_clock(monkeypatch, quiet_measurements):
    threads = torch.get_num_threads()
    monkeypatch.setattr(measured.time, "process_time", lambda: time.perf_counter() * threads * 0.25)
    out, share = quiet_measurements(lambda: time.sleep(0.01) or {"x": 1})  # the real timing
    assert out == {"x": 1} and share == pytest.approx(0.25, rel=0.05)


def _counted(calls: list, result: float = 1.0):
    def measure():
        calls.append(1)
        return {"x": result + len(calls)}

    return measure


def test_a_quiet_measurement_is_final(tmp_path, share):
    calls, path = [], tmp_path / "rec.json"
    first = measured.cached_measurement(path, _counted(calls))
    again = measured.cached_measurement(path, _counted(calls))
    assert calls == [1] and again == first and first["cpu_share"] >= measured.QUIET_SHARE
    assert json.loads(path.read_text())["x"] == first["x"]


def test_a_busy_measurement_is_taken_again_and_the_quietest_stays(tmp_path, share):
    calls, path = [], tmp_path / "rec.json"
    share[0] = 0.5
    first = measured.cached_measurement(path, _counted(calls))
    share[0] = 0.3  # busier still: the first record stays, its attempt counted
    second = measured.cached_measurement(path, _counted(calls))
    assert len(calls) == 2 and second["x"] == first["x"] and second["attempts"] == 2
    share[0] = 0.6  # quieter than the first, still busy: this one stays
    third = measured.cached_measurement(path, _counted(calls))
    assert len(calls) == 3 and third["x"] == 4.0 and third["attempts"] == measured.MAX_ATTEMPTS
    share[0] = 1.0  # attempts used up: the record is final as it is
    assert measured.cached_measurement(path, _counted(calls)) == third and len(calls) == 3


def test_records_without_a_share_or_that_do_not_answer_are_measured_anew(tmp_path, share):
    calls, path = [], tmp_path / "rec.json"
    path.write_text(json.dumps({"x": 0.5}))  # written before the rule: a busy first attempt
    rec = measured.cached_measurement(path, _counted(calls))
    assert calls == [1] and rec["attempts"] == 2 and rec["x"] == 2.0
    rec = measured.cached_measurement(path, _counted(calls), valid=lambda old: old["x"] > 5)
    assert len(calls) == 2 and rec["attempts"] == 1  # an invalid record starts over


def test_device_measurements_do_not_read_the_cpu_share(tmp_path, share):
    share[0] = 0.0  # the host only waits for the device
    rec = measured.cached_measurement(tmp_path / "rec.json", _counted([]), cpu=False)
    assert rec["cpu_share"] == 1.0 and measured.is_final(rec)
