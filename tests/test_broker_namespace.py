"""Deployments that share one Redis database keep apart with ``TUNEJOB_BROKER_KEY_PREFIX``
(kombu's ``global_keyprefix``): a job one sends lands only under its own prefix, where a worker of
the other never sees it. The test suite relies on it (``tests.conftest.redis_broker_env``)."""

import uuid

import redis

from shared.queue import QUEUE, RUN_JOB, make_celery
from shared.settings import Settings
from tests.conftest import REDIS_RUN_PREFIX, REDIS_URL, require_services


def test_a_job_sent_with_a_key_prefix_is_queued_under_that_prefix_only(no_tunejob_env):
    require_services()
    client = redis.Redis.from_url(REDIS_URL)
    mine, theirs = (f"{REDIS_RUN_PREFIX}{uuid.uuid4().hex[:8]}:" for _ in range(2))
    app = make_celery(Settings(broker_url=REDIS_URL, broker_key_prefix=mine))
    try:
        app.send_task(RUN_JOB, args=["job-1"], queue=QUEUE)
    finally:
        app.close()
    assert client.llen(f"{mine}{QUEUE}") == 1
    assert client.llen(f"{theirs}{QUEUE}") == 0
    assert not client.exists(QUEUE)  # nothing outside the prefix
    assert make_celery(Settings(broker_url=REDIS_URL)).conf.broker_transport_options.get("global_keyprefix") is None
