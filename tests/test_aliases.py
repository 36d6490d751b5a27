"""Model aliases (issue 37): ``PUT/GET/DELETE /models/aliases/{alias}`` per tenant, resolved per
request by sync predict and prediction jobs, moves recorded and sent as ``model.alias_updated``."""

import pytest

from tests.conftest import TINY_MODEL, wait_for_status
from tests.test_evaluation import topic_rows, train, upload


@pytest.fixture(scope="module")
def two_jobs(stack) -> tuple[str, str]:
    """Two succeeded classification jobs of ``stack.tenant``, trained differently."""
    client = stack.client
    first = train(client, "classification", upload(client, topic_rows(40, seed=1), "a.jsonl"), None, "label")
    second = train(
        client, "classification", upload(client, topic_rows(40, seed=7), "b.jsonl"), None, "label", validation_split=0.0
    )
    return first["id"], second["id"]


def test_an_alias_moves_and_predictions_follow_it(stack, two_jobs, monkeypatch):
    from shared.settings import get_settings

    monkeypatch.setattr(get_settings(), "webhooks_allow_private_urls", True)
    client, (first, second) = stack.client, two_jobs
    hook = client.post("/webhooks", json={"url": "http://127.0.0.1:9/hook", "events": ["model.alias_updated"]})
    assert hook.status_code == 201, hook.text
    texts = {"inputs": ["goal match team", "bread soup cake"]}

    r = client.put("/models/aliases/production", json={"job_id": first})
    assert r.status_code == 200, r.text
    assert r.json()["job_id"] == first and r.json()["history"][0]["from_job_id"] is None
    by_alias = client.post("/models/production/predict", json=texts).json()
    assert by_alias["model"] == first
    assert by_alias["predictions"] == client.post(f"/models/{first}/predict", json=texts).json()["predictions"]

    r = client.put("/models/aliases/production", json={"job_id": second})
    history = r.json()["history"]
    assert [(h["from_job_id"], h["to_job_id"]) for h in history] == [(first, second), (None, first)]
    assert history[0]["changed_by"] and history[0]["changed_at"]
    assert client.post("/models/production/predict", json=texts).json()["model"] == second  # the new model

    prediction = client.post(
        "/predictions", json={"model": "production", "dataset": upload(client, topic_rows(6, seed=9), "score.jsonl")}
    )
    assert prediction.status_code == 201, prediction.text
    assert prediction.json()["model"] == second and prediction.json()["model_alias"] == "production"
    done = wait_for_status(client, prediction.json()["id"], {"succeeded", "failed"}, path="/predictions")
    assert done["status"] == "succeeded", done["error"]

    assert client.get("/models/aliases").json()["data"][0]["job_id"] == second
    assert client.delete("/models/aliases/production").status_code == 204
    assert client.get("/models/aliases/production").status_code == 404
    assert client.post("/models/production/predict", json=texts).status_code == 404
    deliveries = client.get(f"/webhooks/{hook.json()['id']}/deliveries").json()["data"]
    events = [d["payload"]["data"] for d in deliveries if d["event_type"] == "model.alias_updated"]
    assert [(e["previous_job_id"], e["job_id"]) for e in events] == [(second, None), (first, second), (None, first)]


@pytest.mark.parametrize(
    "alias, status, code",
    [("Production", 422, "invalid_alias"), ("-x", 422, "invalid_alias"), (TINY_MODEL, 422, "invalid_alias")],
)
def test_a_name_that_is_not_a_slug_or_is_a_base_model_is_refused(stack, two_jobs, alias, status, code):
    r = stack.client.put(f"/models/aliases/{alias}", json={"job_id": two_jobs[0]})
    assert r.status_code == status and r.json()["error"]["code"] == code and r.json()["error"]["param"] == "alias"
    assert stack.client.get("/models/aliases").json()["data"] == []


def test_only_a_succeeded_job_of_the_same_tenant(stack, two_jobs):
    client = stack.client
    other = stack.client_for("tenant-b")
    assert other.put("/models/aliases/stolen", json={"job_id": two_jobs[0]}).status_code == 404
    assert client.put("/models/aliases/x", json={"job_id": "job_doesnotexist"}).status_code == 404
    queued = client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "training_dataset": upload(client, topic_rows(20, seed=3), "c.jsonl"),
            "hyperparameters": {"epochs": 1},
        },
    ).json()["id"]
    client.post(f"/jobs/{queued}/cancel")
    r = client.put("/models/aliases/staging", json={"job_id": queued})
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_succeeded"
    client.put("/models/aliases/mine", json={"job_id": two_jobs[0]})
    assert other.get("/models/aliases/mine").status_code == 404  # aliases are per tenant
    assert other.post("/models/mine/predict", json={"inputs": ["goal"]}).status_code == 404  # aliases are per tenant
    # a base model's name says what to do with it (it said "no such training job")
    r = client.post(f"/models/{TINY_MODEL}/predict", json={"inputs": ["goal"]})
    assert r.status_code == 404 and "a base model, not a fine-tuned one" in r.json()["error"]["message"], r.text
    assert [a["alias"] for a in client.get("/models/aliases").json()["data"]] == ["mine"]
    client.delete("/models/aliases/mine")


def test_the_cli_sets_lists_and_shows_aliases_and_the_evaluation(stack, two_jobs):
    import argparse
    import io

    from rich.console import Console

    from client import Client, cli
    from tests.conftest import BASE_URL
    from tests.test_webhooks import ViaTestClient

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers(dest="command", required=True))
    key = stack.client.headers["Authorization"].removeprefix("Bearer ")
    screen = io.StringIO()
    out = Console(file=screen, width=200)
    with Client(BASE_URL, api_key=key, transport=ViaTestClient(stack.client)) as client:
        for argv in (
            ["models", "alias", "set", "canary", two_jobs[0]],
            ["models", "alias", "list"],
            ["models", "alias", "get", "canary"],
            ["jobs", "evaluation", two_jobs[0]],
        ):
            args = parser.parse_args(argv)
            args.handler(client, args, out)
        assert f"canary -> {two_jobs[0]}" in screen.getvalue()
        assert "accuracy" in screen.getvalue() and "precision" in screen.getvalue()  # the evaluation's table
        args = parser.parse_args(["models", "--json"])
        assert args.handler is cli.list_models  # `tunejob models` still lists the base models
        client.delete_alias("canary")


def test_predicting_by_alias_reads_the_store_as_often_as_by_job_id(stack, two_jobs):
    """Sync predict reads an alias with its job in one statement: as many reads of the job store
    (SELECTs naming the job or the alias; the key's and other threads' reads aside) as by job id."""
    from tests.test_feeds import selects

    client, first = stack.client, two_jobs[0]
    assert client.put("/models/aliases/counted", json={"job_id": first}).status_code == 200
    reads = {}
    try:
        for ref in (first, "counted"):
            with selects() as seen:
                r = client.post(f"/models/{ref}/predict", json={"inputs": ["goal match team"]})
            assert r.status_code == 200 and r.json()["model"] == first, r.text
            reads[ref] = [statement for statement, params in seen if params & {first, "counted"}]
    finally:
        client.delete("/models/aliases/counted")
    assert len(reads["counted"]) == len(reads[first]) == 1, reads


def test_a_model_an_alias_names_cannot_be_deleted(stack, two_jobs):
    """Deleting the job an alias names would break every client predicting by the alias: 409
    ``model_has_alias`` naming it, the job and its model kept; once the alias moves, it can go."""
    client, (first, _) = stack.client, two_jobs
    assert client.put("/models/aliases/staging", json={"job_id": first}).status_code == 200
    try:
        r = client.delete(f"/jobs/{first}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_has_alias", r.text
        assert "'staging'" in r.json()["error"]["message"]
        assert client.post("/models/staging/predict", json={"inputs": ["goal match team"]}).status_code == 200
    finally:
        assert client.delete("/models/aliases/staging").status_code == 204
