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
