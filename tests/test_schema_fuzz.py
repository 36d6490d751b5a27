"""Schema-driven fuzzing: schemathesis generates requests for every operation of the app's own
OpenAPI schema (valid and invalid ones, from a fixed seed) and runs all its checks on every
response: never a 5xx, every status and body as documented (errors as ``ErrorBody``), invalid
input refused with a 4xx, the ``Allow`` header on 405s.

The app runs on the embedded default with one uploaded dataset whose id is the one in the schema's
examples, so that the example job spec reaches the dry run and the job store, not only 4xx paths.
"""

import io

import hypothesis
import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis.python.asgi import ASGIClient
from schemathesis.specs.openapi.checks import positive_data_acceptance

from api.main import create_app
from shared.schemas.jobs import JOB_CREATE_EXAMPLE
from tests.conftest import BASE_URL, auth_header, configure_stack

EXAMPLES_PER_OPERATION = 100  # per operation and stack: about a minute in all on a 2-core CPU

APP = create_app()  # settings are read per request, so the fixture below can point it at a fresh data dir
schema = schemathesis.openapi.from_dict(APP.openapi())  # what GET /openapi.json serves
schema.app = APP
# The key is not a generated parameter: requests carry the fuzz tenant's (FuzzKey), and what
# happens without one is tested in tests/test_auth.py.
schema.config.generation.update(with_security_parameters=False)
FUZZ_KEY: dict[str, str] = {}  # the fixture's API key, for the stack under test


@schema.auth(refresh_interval=None)
class FuzzKey:
    """Every generated request carries a key of the fuzz tenant (through schemathesis' auth, so
    that negative cases leave the key alone: its checks are in tests/test_auth.py)."""

    def get(self, case, ctx):
        return FUZZ_KEY.get("Authorization")  # None while collecting: the session sends the key then

    def set(self, case, data, ctx):
        case.headers = {**(case.headers or {}), "Authorization": data}


@pytest.fixture(scope="module", params=["embedded", "postgres+redis"])
def client(request, tmp_path_factory):
    """The app, started once (migrations, recovery loop) for every generated request, on each
    stack (PostgreSQL refuses inputs SQLite takes, e.g. NUL characters)."""
    drop = configure_stack(request.param, {"TUNEJOB_DATA_DIR": str(tmp_path_factory.mktemp("fuzz"))})
    try:
        with TestClient(APP, base_url=BASE_URL):  # runs the app's start-up (migrations, recovery loop), shutdown
            client = ASGIClient(
                APP, base_url=BASE_URL
            )  # not entered: schemathesis would start a lifespan it never stops
            FUZZ_KEY.update(auth_header("fuzz"))  # a key of its own tenant, for every generated request (FuzzKey)
            client.headers.update(FUZZ_KEY)
            assert client.get("/openapi.json").json() == APP.openapi()
            seed_example_dataset(client)
            yield client
    finally:
        drop()


def seed_example_dataset(client) -> None:
    """Upload a small labelled CSV and give it the dataset id of the schema's example job spec."""
    from sqlalchemy import update

    from shared.store.engine import session_scope
    from shared.store.rows import Dataset

    rows = "".join(f"{['a good film', 'a dull plot'][i % 2]} number {i},{['pos', 'neg'][i % 2]}\n" for i in range(40))
    r = client.post("/datasets", files={"file": ("reviews.csv", io.BytesIO(f"text,label\n{rows}".encode()))})
    assert r.status_code == 201, r.text
    with session_scope() as s:
        s.execute(update(Dataset).where(Dataset.id == r.json()["id"]).values(id=JOB_CREATE_EXAMPLE["training_dataset"]))


@schema.parametrize()
@hypothesis.seed(20261121)
@hypothesis.settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_every_operation_conforms_to_its_schema(case, client):
    case.call_and_validate(
        base_url=BASE_URL,
        session=client,
        excluded_checks=[positive_data_acceptance],
        additional_checks=[schema_valid_requests_pass_request_validation],
    )


@schemathesis.check
def schema_valid_requests_pass_request_validation(ctx, response, case):
    """schemathesis' ``positive_data_acceptance``, for an API that checks data beyond its schema: a
    request the schema calls valid may be refused for its data (an upload that is not a dataset, a
    dataset id that names nothing: 404 or a 4xx naming the data problem) or for a rule across
    fields that JSON Schema does not express (``param`` null, e.g. validation_dataset together with
    validation_split), but never as ``invalid_request`` naming a field (``param``): that would mean
    the schema documents values of that field the API does not take."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code < 400:
        return None
    error = response.json().get("error") or {}
    if error.get("code") == "invalid_request" and error.get("param") is not None:
        raise AssertionError(f"a request valid by the schema was refused as invalid: {response.text}")
    return None
