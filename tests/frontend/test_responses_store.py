"""The Responses API's stored responses: bounded by bytes and by age, the oldest going first."""

from __future__ import annotations

from frontend_svc.service.http.responses_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, name: str, chars: int = 10) -> bool:
    return store.put(name, {"id": name, "text": "x" * chars}, [{"role": "user", "content": "hi"}])


def test_the_oldest_are_evicted_so_the_store_never_exceeds_its_bytes():
    one = ResponseStore(10**6, 60.0)
    _put(one, "a", 100)
    size = one.num_bytes
    store = ResponseStore(2 * size + size // 2, 60.0)
    for name in ("a", "b", "c"):
        assert _put(store, name, 100)
        assert store.num_bytes <= store.max_bytes
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert len(store) == 2 and store.num_bytes == 2 * size


def test_a_response_larger_than_the_store_is_not_stored_and_0_stores_none():
    store = ResponseStore(50, 60.0)
    assert not _put(store, "big", 100) and store.get("big") is None and store.num_bytes == 0
    none = ResponseStore(0, 60.0)
    assert not _put(none, "a", 0) and len(none) == 0


def test_a_response_is_dropped_max_age_after_it_was_stored():
    clock = Clock()
    store = ResponseStore(10**6, 10.0, clock)
    _put(store, "a")
    clock.now = 5.0
    _put(store, "b")
    clock.now = 9.9
    assert store.get("a") is not None
    clock.now = 10.0
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 15.0
    assert store.get("b") is None and store.num_bytes == 0


def test_delete_frees_its_bytes_once():
    store = ResponseStore(10**6, 60.0)
    _put(store, "a")
    assert store.delete("a") and not store.delete("a") and store.num_bytes == 0 and store.get("a") is None
