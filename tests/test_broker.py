"""The embedded default's broker (kombu's filesystem transport, as ``shared.queue`` configures it):
a consumer polling the queue folder never reads a message file that is still being written."""

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
