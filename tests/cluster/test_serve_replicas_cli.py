"""``kvloop serve --replicas``'s bad input: one line and exit 2, before any Ray starts."""

from __future__ import annotations

import pytest

from kvloop.cli.main import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replicas", "2", "--threads-per-replica", "0"], "--threads-per-replica must be >= 1"),
    (["--replicas", "2", "--num-gpus-per-replica", "-1"], "--num-gpus-per-replica must be"),
    (["--replicas", "2", "--trace-out", "steps.jsonl"], "--trace-out records one engine"),
    (["--replicas", "2", "--model", "/no/such/model"], "model '/no/such/model' not found"),
])
def test_bad_replica_flags_are_one_line(argv: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("Ray started for bad input")

    monkeypatch.setattr(ray, "init", no_ray)
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_unknown_router_is_one_line_as_in_simulate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "0", "--replicas", "2", "--router", "random"]) == 2
    serve_err = capsys.readouterr().err.strip()
    assert main(["simulate", "--router", "random", "--num-requests", "1"]) == 2
    assert serve_err == capsys.readouterr().err.strip() == (
        "kvloop: error: --router must be one of round-robin, least-loaded, kv-aware, "
        "got 'random'")
