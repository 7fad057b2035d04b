"""The whole-repo lock: one fetch at a time per repository and cache, the rest wait."""

from __future__ import annotations

import threading
import time

from shoal.contract.model_fetch import HubRef
from shoal.fetch.lock import lock_path, repo_lock

REF = HubRef("acme/llama")


def test_lock_lives_beside_huggingface_hubs_locks(tmp_path) -> None:
    assert lock_path(tmp_path, REF) == tmp_path / ".locks/models--acme--llama/shoal-fetch.lock"


def test_a_free_lock_is_taken_without_waiting(tmp_path) -> None:
    waits = []
    with repo_lock(tmp_path, REF, on_wait=waits.append) as held:
        assert not held.waited and held.path.is_file()
    assert waits == []


def test_a_second_fetch_waits_for_the_first(tmp_path) -> None:
    order, waits = [], []
    first_in = threading.Event()

    def first() -> None:
        with repo_lock(tmp_path, REF):
            first_in.set()
            time.sleep(0.3)
            order.append("first out")

    def second() -> None:
        first_in.wait(5)
        with repo_lock(tmp_path, REF, on_wait=waits.append) as held:
            order.append("second in")
            assert held.waited and held.waited_s >= 0.1

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["first out", "second in"]
    assert waits == [lock_path(tmp_path, REF)]


def test_other_repositories_do_not_wait(tmp_path) -> None:
    with repo_lock(tmp_path, REF):
        with repo_lock(tmp_path, HubRef("acme/other")) as held:
            assert not held.waited


def test_a_waiting_fetch_reports_while_it_waits(tmp_path) -> None:
    first_in, reports = threading.Event(), []

    def first() -> None:
        with repo_lock(tmp_path, REF):
            first_in.set()
            time.sleep(1.0)

    t = threading.Thread(target=first)
    t.start()
    first_in.wait(5)
    with repo_lock(tmp_path, REF, while_waiting=lambda: reports.append(time.monotonic()),
                   interval_s=0.25, poll_s=0.05) as held:
        assert held.waited
    t.join(5)
    assert 2 <= len(reports) < 10, reports  # paced by interval_s, not by every poll
