"""The embedded default's broker (kombu's filesystem transport, as ``shared.queue`` configures it):
a consumer polling the queue folder never reads a message file that is still being written, and
processes that bind queues at once keep every binding."""

from queue import Empty

import pytest
from kombu import Connection
from kombu.transport import filesystem

import shared.queue
from shared.settings import Settings


def test_a_message_is_not_seen_before_it_is_written_whole(tmp_path, monkeypatch, no_tunejob_env):
    """Issue 34: kombu wrote a message under its final name and then its body, so a worker polling
    meanwhile moved and read an empty file and failed on the JSON (``JSONDecodeError``). The poll
    here runs at that moment (while the body is being encoded, the file already open)."""
    config = shared.queue.celery_config(Settings(data_dir=tmp_path))
    with Connection(
        "filesystem://", transport=config.get("broker_transport"), transport_options=config["broker_transport_options"]
    ) as connection:
        channel = connection.default_channel
        seen = []

        def encode_while_polled(payload, encode=filesystem.dumps):
            try:
                seen.append(channel._get("q"))
            except Empty:
                seen.append(None)
            return encode(payload)

        for module in (filesystem, shared.queue):
            monkeypatch.setattr(module, "dumps", encode_while_polled, raising=False)
        channel._put("q", {"body": "job_1"})
        monkeypatch.undo()
        assert seen == [None]  # nothing to read while the message is written
        assert channel._get("q") == {"body": "job_1"}
        with pytest.raises(Empty):
            channel._get("q")


def test_a_bind_between_anothers_open_and_its_lock_keeps_both(tmp_path, monkeypatch, no_tunejob_env):
    """Two processes bind a queue each to a new exchange at once (the API and a worker, or two
    workers, starting together): the second's whole bind runs after the first opened the table and
    before it took its lock. Both bindings are kept. kombu's own bind created the table empty on
    opening it, before its lock, so the second read an empty table and failed on the JSON
    (``JSONDecodeError``); later in the same window, the first overwrote the second's binding or
    left a table that no longer parses (``shared.queue.FilesystemChannel``)."""
    config = shared.queue.celery_config(Settings(data_dir=tmp_path))
    options = {"transport": config.get("broker_transport"), "transport_options": config["broker_transport_options"]}
    with Connection("filesystem://", **options) as first, Connection("filesystem://", **options) as second:
        take_lock = filesystem.lock

        def another_binds_first(file, flags):
            monkeypatch.setattr(filesystem, "lock", take_lock)
            second.default_channel._queue_bind("celery.pidbox", "", "", "worker-2.pidbox")
            take_lock(file, flags)

        monkeypatch.setattr(filesystem, "lock", another_binds_first)
        first.default_channel._queue_bind("celery.pidbox", "", "", "worker-1.pidbox")
        table = first.default_channel.get_table("celery.pidbox")
        assert sorted(b.queue for b in table) == ["worker-1.pidbox", "worker-2.pidbox"]


def test_a_table_that_is_not_json_is_written_anew_by_the_next_bind(tmp_path, no_tunejob_env):
    """A table left unreadable (by kombu's own write, before this fix) does not fail every later
    bind: it counts as empty, and each process binds its queues again when it starts."""
    config = shared.queue.celery_config(Settings(data_dir=tmp_path))
    with Connection(
        "filesystem://", transport=config.get("broker_transport"), transport_options=config["broker_transport_options"]
    ) as connection:
        channel = connection.default_channel
        channel.control_folder.mkdir(parents=True, exist_ok=True)
        (channel.control_folder / "tunejob.exchange").write_text('[["", "", "q0"]] ["", "", "q1"]]')
        channel._queue_bind("tunejob", "tunejob", "", "tunejob")
        assert channel.get_table("tunejob") == [("tunejob", "", "tunejob")]
        channel._delete("tunejob", "tunejob", "tunejob", "")
        assert channel.get_table("tunejob") == []


def test_messages_are_taken_in_the_order_they_were_sent(tmp_path, monkeypatch, no_tunejob_env):
    """kombu names a message by unpadded milliseconds and takes the first name in string order: a
    job sent when the counter had one more digit ("1066...") ran before one sent earlier ("894...")."""
    config = shared.queue.celery_config(Settings(data_dir=tmp_path))
    with Connection(
        "filesystem://", transport=config.get("broker_transport"), transport_options=config["broker_transport_options"]
    ) as connection:
        channel = connection.default_channel
        for job, ns in (("job_1", 999_000_000), ("job_2", 1_000_000_000), ("job_3", 2_000_000_000)):  # 999 ms, 1 s, 2 s
            with monkeypatch.context() as m:
                m.setattr(shared.queue.time, "time_ns", lambda ns=ns: ns)
                m.setattr(shared.queue.time, "monotonic", lambda ns=ns: ns / 1e9)  # kombu's clock
                channel._put("q", {"body": job})
        assert [channel._get("q")["body"] for _ in range(3)] == ["job_1", "job_2", "job_3"]


def test_a_redis_broker_that_does_not_answer_fails_a_send_in_seconds(no_tunejob_env):
    """A Redis that takes connections and never answers (stopped with SIGSTOP, overloaded) held a
    send, and so ``POST /jobs``, forever (redis-py waits without end by default); the job, stored,
    waits for the recovery loop instead."""
    import socket
    import threading
    import time

    silent = socket.socket()  # the kernel accepts connections to it; nothing ever answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    app = shared.queue.make_celery(Settings(broker_url=f"redis://127.0.0.1:{silent.getsockname()[1]}/0"))
    outcome: list = []

    def send() -> None:
        started = time.monotonic()
        try:
            app.send_task(shared.queue.RUN_JOB, args=["job_x"], queue=shared.queue.QUEUE)
        except Exception as e:
            outcome.append((type(e).__name__, time.monotonic() - started))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    thread.join(30)
    silent.close()
    assert not thread.is_alive(), "the send still waits after 30 s"
    assert outcome and outcome[0][1] < 4 * shared.queue.BROKER_TIMEOUT_SECONDS + 2, outcome
