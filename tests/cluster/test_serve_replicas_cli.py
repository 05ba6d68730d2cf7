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
    (["--router", "magic"], "--router must be one of"),  # checked without --replicas too
    (["--replicas", "2", "--max-replicas", "1"], "--max-replicas must be >= --replicas (2)"),
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


class _FakeRay:
    """Just enough of ``ray`` and ``ray.serve`` for ``run_replicas`` to reach its checks:
    ``serve.delete``/``shutdown`` fail, as they do when Serve never started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cpus: float,
                 serve_at: tuple[str, int] | None = None) -> None:
        import types

        import ray
        import ray.serve.context
        from ray import serve

        self.inits: list[dict[str, object]] = []
        monkeypatch.setattr(ray, "init", lambda **kw: self.inits.append(kw))
        monkeypatch.setattr(ray, "shutdown", lambda: None)
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": cpus})

        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError("There is no Serve instance running on this Ray cluster.")

        for name in ("delete", "shutdown", "start", "run"):
            monkeypatch.setattr(serve, name, fail)
        client = None if serve_at is None else types.SimpleNamespace(
            http_config=types.SimpleNamespace(host=serve_at[0], port=serve_at[1]))
        monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda **kw: client)


@pytest.mark.parametrize(("argv", "cpus", "serve_at", "message"), [
    (["--replicas", "3", "--threads-per-replica", "1", "--ray-address", "auto"], 2, None,
     "3 replicas need 3 CPUs but the Ray cluster has 2: lower --replicas or "
     "--threads-per-replica"),
    (["--replicas", "8", "--threads-per-replica", "2"], 2, None,
     "8 replicas need 16 CPUs but the Ray cluster has 2"),
    (["--replicas", "1", "--max-replicas", "4", "--threads-per-replica", "1"], 2, None,
     "4 replicas need 4 CPUs but the Ray cluster has 2: lower --max-replicas or "
     "--threads-per-replica"),
    (["--replicas", "1", "--ray-address", "auto", "--port", "8018"], 2, ("127.0.0.1", 8017),
     "Ray Serve already runs on that cluster at 127.0.0.1:8017 and would ignore --host "
     "127.0.0.1 --port 8018"),
])
def test_what_the_cluster_cannot_do_is_one_line(
        argv: list[str], cpus: float, serve_at: tuple[str, int] | None, message: str,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before deploying, and a failing cleanup (Serve never started) hides nothing."""
    fake = _FakeRay(monkeypatch, cpus, serve_at)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvloop: error: {message}"] or (len(err) == 1 and message in err[0]), err
    local = "--ray-address" not in argv
    # NOTE: a Ray of our own even when `ray start` runs here, with this machine's CPUs only.
    assert fake.inits[0].get("address") == ("local" if local else "auto")


def test_max_replicas_turns_on_ray_autoscaling() -> None:
    from kvloop.cluster.ray_serve import replica_count
    from kvloop.engine.args import EngineArgs

    args = EngineArgs(max_num_seqs=64)
    assert replica_count(args, 2, None) == {"num_replicas": 2}
    assert replica_count(args, 2, 2) == {"num_replicas": 2}
    assert replica_count(args, 2, 6) == {"autoscaling_config": {
        "min_replicas": 2, "initial_replicas": 2, "max_replicas": 6,
        "target_ongoing_requests": 64}}
