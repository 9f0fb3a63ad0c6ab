"""A local Ray instance and a pool of vLLM engines shared by the end-to-end tests.

An engine start costs 10-25 s on 2 cores, so tests that only need "an engine on tiny model A"
borrow one from `engine_pool` (keyed by architecture, apply mode, TP, a slot and the dtype) instead of
starting their own. After each borrow the pool loads model A back from disk through the engine's
own update path and checks that the engine scores a probe batch exactly as it did when it
started, so the next test gets an engine as if freshly started; one that does not is killed and
started anew. The pool holds at most POOL_CPUS of Ray's CPUs (least recently used engines go
first) and is emptied before any end-to-end test that does not borrow from it, so runs that start
their own actors find Ray's resources free. Sync ids on a pooled engine must be unique
(EnginePool.sync_id).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from contextlib import contextmanager

import pytest

RAY_CPUS = 6
POOL_CPUS = 6
# The options of every pooled engine: fp32 unless borrowed otherwise (parity with Megatron and transformers
# at 1e-4 or tighter).
POOL_ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="session")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    yield ray
    if _POOL is not None:
        _POOL.clear()  # shutdown first: a TP > 1 engine killed without it leaves files in /dev/shm
    ray.shutdown()


class EnginePool:
    """Started rollout actors by (arch, apply, tp, slot, dtype); see the module's docstring."""

    def __init__(self, ray, model_dir) -> None:
        self._ray, self._model_dir = ray, model_dir
        self._engines: OrderedDict[tuple, tuple] = OrderedDict()  # key → (actor, probe, its first scores)

    @contextmanager
    def borrow(self, arch: str, apply: str = "in_place", tp: int = 1, slot: int = 0, dtype: str = "float32"):
        """An engine started on tiny model `arch` (tiny_model_dir), returned to that model afterwards."""
        key = (arch, apply, tp, slot, dtype)
        engine = self._engines.pop(key, None) or self._start(key)
        self._engines[key] = engine  # most recently used last
        actor = engine[0]
        try:
            yield actor
        finally:
            self._reset(key)

    @staticmethod
    def sync_id(name: str) -> str:
        """A sync id no other test uses on a pooled engine (a receiver refuses an id it has seen)."""
        return f"{name}-{uuid.uuid4().hex[:8]}"

    def _start(self, key: tuple):
        from mrl.launch.rollout_actor import start_rollout_actor
        from mrl.models.registry import model_spec_from_hf
        from mrl.sync.parity import probe_sequences

        arch, apply, tp, _, dtype = key
        while self._engines and sum(k[2] for k in self._engines) + tp > POOL_CPUS:
            self._kill(next(iter(self._engines)))
        actor = start_rollout_actor(str(self._model_dir(arch)), POOL_ENGINE | {"weight_apply": apply, "dtype": dtype,
                                                                              "tensor_parallel_size": tp}, num_cpus=tp)
        probe = probe_sequences(model_spec_from_hf(self._model_dir(arch)).vocab_size)
        return actor, probe, self._ray.get(actor.score.remote(probe), timeout=120)

    def _reset(self, key: tuple) -> None:
        actor, probe, fresh = self._engines[key]
        try:
            report = self._ray.get(actor.load_checkpoint.remote(str(self._model_dir(key[0]))), timeout=120)
            clean = not report.not_updated and not report.misapplied
            clean = clean and self._ray.get(actor.score.remote(probe), timeout=120) == fresh
        except Exception:  # noqa: BLE001 - any failure (a test left it waiting, killed, corrupted) means a new engine
            clean = False
        if not clean:
            self._kill(key)

    def _kill(self, key: tuple) -> None:
        actor = self._engines.pop(key)[0]
        try:
            self._ray.get(actor.shutdown.remote(), timeout=60)  # TP > 1: its workers' shared memory goes too
        except Exception:  # noqa: BLE001 - already dead or hung: the kill below still frees it
            pass
        self._ray.kill(actor)

    def clear(self) -> None:
        while self._engines:
            self._kill(next(iter(self._engines)))


_POOL: EnginePool | None = None  # the session's, once a test has borrowed


@pytest.fixture
def engine_pool(ray_local, tiny_model_dir) -> EnginePool:
    global _POOL
    if _POOL is None:
        _POOL = EnginePool(ray_local, tiny_model_dir)
    return _POOL


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test that does not borrow engines gets Ray's CPUs back from the pool before its fixtures
    (a module's shared training run among them) start actors of their own."""
    if _POOL is not None and "engine_pool" not in item.fixturenames:
        _POOL.clear()


def pytest_collection_modifyitems(session, config, items):
    """The tests that borrow engines run last among the end-to-end tests, grouped by architecture
    (then in their own order), so that each pooled engine serves its tests one after another."""
    places = [i for i, item in enumerate(items) if "engine_pool" in getattr(item, "fixturenames", ())]
    borrowing = set(places)
    others = [i for i, item in enumerate(items) if "/e2e/" in str(item.path) and i not in borrowing]
    if not places:
        return

    def arch(i: int) -> str:  # tests without an architecture last
        callspec = getattr(items[i], "callspec", None)
        return callspec.params.get("arch", "~") if callspec is not None else "~"

    e2e = sorted(places + others)
    ordered = [items[i] for i in others] + [items[i] for i in sorted(places, key=arch)]
    for place, item in zip(e2e, ordered):
        items[place] = item
